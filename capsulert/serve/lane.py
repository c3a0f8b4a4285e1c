"""The generation routes' own lane: POST /v1/completions and /v1/chat/completions with a plain-JSON body that
validates are served straight from ASGI, not through FastAPI's routing.

FastAPI's path for `async def route(body: Model, ns = Depends(tenant))` passes each request through its
exception and exit-stack layers and the router, builds a Request, decodes the body with json.loads,
validates the dict and solves the route's parameters in Python, and wraps `send` twice more for every
message it sends (every event of a stream): about a fifth of the app's work on a request (stub worker, the
2-core CPU box). Here the body is read from `receive`, parsed by pydantic's JSON parser straight into the
route's model (one pass), and the endpoint is called with the caller's namespace.

Anything else goes to the FastAPI app unchanged, with the body read here given back to it first: another
route or method, another content type, a body that does not parse or does not validate. So every refusal
of a body is FastAPI's own (status, message, `param`); and a body the fast parser refuses that FastAPI
accepts (a byte-order mark, a lone surrogate escape, which pydantic's parser refuses and json.loads
accepts) is still served. A body both accept gives the same model: pydantic's parser reads numbers and
strings as json.loads does (tests/serve/test_fast_paths.py checks the cases where they could differ).

An endpoint's refusal (ApiError, CapsuleRTError) is answered as the app's exception handler answers it
(`refusal`); any other exception goes up to the app's outermost handler (a 500), as from a route.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from capsulert.errors import CapsuleRTError
from capsulert.serve.http_errors import ApiError

JSON = b"application/json"


@dataclass(frozen=True)
class GenerationRoute:
    model: type[BaseModel]  # the body's
    endpoint: Callable[..., Awaitable[Response]]  # endpoint(body, ns)


def fast_body(content_type: bytes | None, body: bytes, model: type[BaseModel]) -> BaseModel | None:
    """The body as `model` when it is plain JSON and valid; None: leave it to FastAPI."""
    if content_type != JSON:
        return None
    try:
        return model.model_validate_json(body)
    except ValidationError:
        return None


def _replay(messages: list[dict], receive):
    """`receive` with the messages already read from it first."""
    async def again() -> dict:
        return messages.pop(0) if messages else await receive()
    return again


class GenerationLane:
    """ASGI middleware in front of the FastAPI app's routing (inside its error handling and request counting):
    `routes` by path; `namespace(authorization header)` is the caller's namespace handle (raising as the
    route's dependency does, e.g. 401); `refusal(method, path, exc)` the response to an ApiError or
    CapsuleRTError."""

    def __init__(self, app, routes: dict[str, GenerationRoute], namespace: Callable[[str | None], Any],
                 refusal: Callable[[str, str, Exception], Response]):
        self.app, self.routes, self.namespace, self.refusal = app, routes, namespace, refusal

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            return await self.app(scope, receive, send)
        content_type = authorization = None
        for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get
            if name == b"content-type" and content_type is None:
                content_type = value
            elif name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
        messages, chunks = [], []
        while True:  # the whole body (uvicorn holds it already, or reads on as it is asked)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return await self.app(scope, _replay(messages, receive), send)  # gone: FastAPI says so
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = fast_body(content_type, b"".join(chunks), route.model)
        if body is None:
            return await self.app(scope, _replay(messages, receive), send)
        try:
            response = await route.endpoint(body, self.namespace(authorization))
        except (ApiError, CapsuleRTError) as e:
            response = self.refusal("POST", scope["path"], e)
        await response(scope, receive, send)
