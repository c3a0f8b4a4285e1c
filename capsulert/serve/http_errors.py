"""Errors as the OpenAI API reports them: a status code and `{"error": {"message", "type", "param", "code"}}`.

Every refusal capsulert makes is a typed error (capsulert.errors); this module decides the status each
one gets. The body carries the error's message, never a traceback: anything unexpected is a 500 with a
fixed message, and its traceback goes to the server's log only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from capsulert import errors as E


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str | None = None


class ApiError(Exception):
    """A refusal made by the HTTP layer itself (bad key, unknown model, ...)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


INVALID = ErrorKind(400, "invalid_request_error")
UNAUTHORIZED = ErrorKind(401, "authentication_error", "invalid_api_key")
NOT_FOUND = ErrorKind(404, "not_found_error")
MODEL_NOT_FOUND = ErrorKind(404, "not_found_error", "model_not_found")
CONFLICT = ErrorKind(409, "conflict_error")
RATE_LIMITED = ErrorKind(429, "rate_limit_error", "queue_full")
INTERNAL = ErrorKind(500, "server_error", "internal_error")
UNAVAILABLE = ErrorKind(503, "service_unavailable_error", "worker_lost")
TOO_COSTLY = ErrorKind(400, "invalid_request_error", "grammar_too_costly")  # to compile, or a mask past its budget

# most specific first: the first class the error is an instance of decides
_BY_CLASS: tuple[tuple[type[E.CapsuleRTError], ErrorKind], ...] = (
    (E.UnknownCapsuleError, ErrorKind(404, "not_found_error", "capsule_not_found")),
    (E.DuplicateCapsuleError, ErrorKind(409, "conflict_error", "capsule_exists")),
    (E.StaleCapsuleError, ErrorKind(409, "conflict_error", "capsule_stale")),
    (E.IncompatibleCapsuleError, ErrorKind(409, "conflict_error", "capsule_incompatible")),
    (E.CapsuleInUseError, ErrorKind(409, "conflict_error", "capsule_in_use")),
    (E.BudgetExceededError, ErrorKind(507, "insufficient_storage_error", "capsule_budget_exceeded")),
    (E.InvalidCapsuleNameError, ErrorKind(400, "invalid_request_error", "invalid_capsule_name")),
    (E.SequenceTooLongError, ErrorKind(400, "invalid_request_error", "context_length_exceeded")),
    (E.InvalidTokenError, ErrorKind(400, "invalid_request_error", "invalid_tokens")),
    (E.ExceedsCapacityError, ErrorKind(400, "invalid_request_error", "exceeds_capacity")),
    (E.GrammarTooCostlyError, TOO_COSTLY),
    (E.InvalidRequestError, INVALID),
    (E.StaleSessionError, ErrorKind(409, "conflict_error", "weights_updated")),
    (E.QueueFullError, RATE_LIMITED),
    (E.NoFreeSlotError, ErrorKind(429, "rate_limit_error", "no_free_slot")),
    (E.WorkerLost, UNAVAILABLE),
)


def kind_of(error: BaseException) -> ErrorKind:
    if isinstance(error, ApiError):
        return error.kind
    for cls, kind in _BY_CLASS:
        if isinstance(error, cls):
            return kind
    return INTERNAL


def retry_headers(kind: ErrorKind, error: BaseException) -> dict[str, str]:
    """`Retry-After` (whole seconds) for a 429: the refusing queue's estimate, else 1."""
    if kind.status != 429:
        return {}
    return {"Retry-After": str(max(1, math.ceil(getattr(error, "retry_after_s", None) or 1)))}


def error_body(kind: ErrorKind, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind.type, "param": param, "code": kind.code}}


def describe(error: BaseException) -> tuple[ErrorKind, dict]:
    """The status kind and JSON body of an error. Only errors capsulert raised on purpose show their
    message; anything else is reported without detail."""
    kind = kind_of(error)
    if isinstance(error, ApiError):
        return kind, error_body(kind, error.message, error.param)
    if isinstance(error, E.CapsuleRTError):
        return kind, error_body(kind, str(error))
    return INTERNAL, error_body(INTERNAL, "internal server error; the server's log has the details")
