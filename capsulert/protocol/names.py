"""The name rule of capsules and namespaces, checked where a request is made."""
from __future__ import annotations

import re

from capsulert.errors import InvalidCapsuleNameError

#: the namespace of every verb that names none (the one place it is written)
DEFAULT_NAMESPACE = "default"
MAX_NAME_LEN = 200
_NAME_RE = re.compile(r"[A-Za-z0-9_:@+=\-][A-Za-z0-9._:@+=\-]{0,199}")


def validate_name(name: object, what: str = "capsule name") -> str:
    """Return `name` if it is a valid capsule name (or namespace); else InvalidCapsuleNameError.

    Rule: 1..200 characters of [A-Za-z0-9._:@+=-], not starting with '.' (so never '.', '..' or a
    hidden file). '/', '\\', NUL, spaces and non-ASCII are refused. A name is never a path: file
    names on disk derive from a hash of (namespace, name).
    """
    if not isinstance(name, str):
        raise InvalidCapsuleNameError(f"{what} must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidCapsuleNameError(f"{what} must not be empty")
    if len(name) > MAX_NAME_LEN:
        raise InvalidCapsuleNameError(f"{what} is {len(name)} characters long; the limit is {MAX_NAME_LEN}")
    if name.startswith("."):
        raise InvalidCapsuleNameError(f"{what} {name!r} must not start with '.' (names are not paths)")
    if _NAME_RE.fullmatch(name) is None:
        raise InvalidCapsuleNameError(
            f"{what} {name!r} may only contain ASCII letters, digits and . _ : @ + = - "
            f"(no '/', '\\', NUL, spaces or other characters: names are not paths)"
        )
    return name
