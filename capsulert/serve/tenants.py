"""Tenants: API keys and the capsule namespace each one acts in.

The keys file (YAML) maps each key to a namespace; several keys may share one:

    keys:
      sk-acme-7f3a9c...: acme
      sk-acme-ci-51b2...: acme
      sk-globex-0d44...: globex

A request's `Authorization: Bearer <key>` picks its namespace, and every capsule verb it makes runs on
that namespace's handle, which cannot see or touch another namespace's capsules. A missing or unknown key
is 401. Without a keys file the server is open: every request acts in namespace "default".
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from capsulert.errors import CapsuleRTError, ConfigError
from capsulert.serve.http_errors import UNAUTHORIZED, ApiError
from capsulert.protocol.names import DEFAULT_NAMESPACE, validate_name

OPEN_NAMESPACE = DEFAULT_NAMESPACE
MIN_KEY_LENGTH = 8


class KeysFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    keys: dict[str, str] = Field(min_length=1, description="API key -> namespace")

    @field_validator("keys")
    @classmethod
    def _valid(cls, keys: dict[str, str]) -> dict[str, str]:
        for key, namespace in keys.items():
            if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
                raise ValueError(f"API keys must be at least {MIN_KEY_LENGTH} characters without spaces "
                                 f"(one starting {key[:4]!r} is not)")
            try:
                validate_name(namespace, "namespace")
            except CapsuleRTError as e:
                raise ValueError(str(e)) from None
        return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Tenants:
    # sha256(key) -> namespace: keys are compared as digests in constant time, never kept in the clear
    by_digest: dict[bytes, str] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.by_digest

    @property
    def namespaces(self) -> list[str]:
        return sorted(set(self.by_digest.values())) or [OPEN_NAMESPACE]

    @classmethod
    def from_keys(cls, keys: dict[str, str]) -> "Tenants":
        return cls.from_data({"keys": keys}, "keys")

    @classmethod
    def load(cls, path: str | Path | None) -> "Tenants":
        """The tenants of a keys file; None: an open server (one namespace, no auth)."""
        if path is None:
            return cls()
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read keys file {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"keys file {path} is not valid YAML: {e}") from None
        return cls.from_data(data, f"keys file {path}")

    @classmethod
    def from_data(cls, data: object, origin: str) -> "Tenants":
        try:
            keys = KeysFile.model_validate(data if data is not None else {})
        except ValidationError as e:
            raise ConfigError(f"{origin}: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors(include_url=False))) from None
        return cls({_digest(k): ns for k, ns in keys.keys.items()})

    def namespace_for(self, authorization: str | None) -> str:
        """The namespace of a request's Authorization header; ApiError 401 for a missing or unknown key."""
        if self.open:
            return OPEN_NAMESPACE
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(UNAUTHORIZED, "missing API key: send `Authorization: Bearer <key>`")
        digest = _digest(key.strip())
        found = None
        for known, namespace in self.by_digest.items():  # every entry, so timing does not tell which matched
            if hmac.compare_digest(known, digest):
                found = namespace
        if found is None:
            raise ApiError(UNAUTHORIZED, "invalid API key")
        return found
