"""The HTTP edge: what a request must pass before the app reads its body or makes a capsule for it.

- The API key is checked first, from the headers alone: an unauthenticated request is refused (401) before
  a byte of its body is read (a 300 MB body used to be read whole, growing the replica by 1.18 GB, before
  its 401).
- A body larger than `max_body_bytes` is refused with 413: at once when its Content-Length says so, else
  as soon as the bytes read pass the limit (chunked uploads); the rest is never read.
- Capsule quotas per tenant (namespace): a request that would make a capsule (snapshot_as) is refused with
  403 naming the quota when the tenant holds `max_capsules` capsules, or `max_capsule_bytes` bytes of them,
  already. Checked on the listing the duplicate-name check reads anyway (one round trip).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from starlette.responses import JSONResponse

from capsulert.serve.http_errors import ApiError, ErrorKind, error_body
from capsulert.serve.tenants import Tenants

DEFAULT_MAX_BODY_BYTES = 8 << 20
TOO_LARGE = ErrorKind(413, "invalid_request_error", "request_too_large")
QUOTA = ErrorKind(403, "permission_error", "capsule_quota_exceeded")
OPEN_PATHS = frozenset({"/metrics"})  # served without a key (Prometheus scrapes carry none)


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_capsules: int | None = None  # per tenant; None: no count quota
    max_capsule_bytes: int | None = None  # per tenant, the capsules' whole sizes; None: no byte quota


def check_capsule_quota(rows: list[dict], limits: EdgeLimits, is_client_capsule: Callable[[str], bool]) -> None:
    """ApiError 403 when the tenant's capsules (`rows`, its listing; the server's own left out) leave no room
    for one more under its quotas."""
    mine = [r for r in rows if is_client_capsule(r["name"])]
    if limits.max_capsules is not None and len(mine) >= limits.max_capsules:
        raise ApiError(QUOTA, f"this key's namespace holds {len(mine)} capsules, its quota "
                              f"(--capsule-quota {limits.max_capsules}); delete some to make new ones")
    held = sum(r["size_bytes"] for r in mine)
    if limits.max_capsule_bytes is not None and held >= limits.max_capsule_bytes:
        raise ApiError(QUOTA, f"this key's namespace holds {held} bytes of capsules, at or past its quota "
                              f"(--capsule-quota-mb: {limits.max_capsule_bytes} bytes); delete some to make new ones")


class _BodyTooLarge(Exception):
    pass


class EdgeGuard:
    """ASGI middleware in front of the app: the key, then the body's size (see the module docstring). The
    body is read here, bounded, and handed to the app as it came."""

    def __init__(self, app, tenants: Tenants, max_body_bytes: int):
        self.app, self.tenants, self.max_body_bytes = app, tenants, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        authorization = length = None
        for name, value in scope["headers"]:
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-length" and length is None:
                length = value
        try:
            if scope["path"] not in OPEN_PATHS:
                self.tenants.namespace_for(authorization)  # 401 from the headers alone
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                raise _BodyTooLarge
            messages = await self._read_body(receive)
        except ApiError as e:
            return await self._refuse(e.kind, e.message, scope, receive, send)
        except _BodyTooLarge:
            return await self._refuse(TOO_LARGE, f"the request body is larger than this server's limit of "
                                                 f"{self.max_body_bytes} bytes (--max-body-mb)", scope, receive, send)

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> list[dict]:
        messages, total = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # gone: the app sees it so
            total += len(message.get("body", b""))
            if total > self.max_body_bytes:
                raise _BodyTooLarge
            if not message.get("more_body", False):
                return messages

    @staticmethod
    async def _refuse(kind: ErrorKind, message: str, scope, receive, send) -> None:
        # Connection: close, so the server does not read the unread rest of the body as the next request
        await JSONResponse(error_body(kind, message), status_code=kind.status,
                           headers={"Connection": "close"})(scope, receive, send)
