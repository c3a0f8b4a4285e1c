"""A client's JSON schema checked before llguidance (or json.dumps) sees it.

llguidance converts a Python dict recursively: a schema 20,000 levels deep crashed the process inside that
conversion (SIGSEGV), and one whose dicts share subtrees (2^40 nodes once expanded, a few hundred objects)
hung for minutes. Both are refused here, typed, by a walk that neither recurses nor expands: each distinct
object is visited once and its expanded size computed from its children's. `x-guidance` (llguidance's own
settings, e.g. whitespace) is the server's to set, so a client schema that carries it is refused too.
"""
from __future__ import annotations

from typing import Any

from capsulert.errors import InvalidRequestError

MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 20_000  # values in the schema as written out (shared subtrees counted each time)
GUIDANCE_KEY = "x-guidance"


def check_schema(schema: Any, what: str = "schema") -> None:
    """InvalidRequestError unless `schema` (dicts, lists and scalars) is at most MAX_SCHEMA_DEPTH deep,
    MAX_SCHEMA_NODES values written out, acyclic and free of `x-guidance`."""
    size: dict[int, int] = {}  # id -> expanded size, once its children are done
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]
    while stack:
        value, depth, children_done = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        key = id(value)
        if children_done:
            on_path.discard(key)
            kids = value.values() if isinstance(value, dict) else value
            size[key] = 1 + sum(size.get(id(k), 1) for k in kids)
            if size[key] > MAX_SCHEMA_NODES:
                raise InvalidRequestError(f"{what} has more than {MAX_SCHEMA_NODES} values written out")
            continue
        if key in on_path:
            raise InvalidRequestError(f"{what} contains itself")
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if key in size:
            continue
        if isinstance(value, dict) and GUIDANCE_KEY in value:
            raise InvalidRequestError(f"{what} sets {GUIDANCE_KEY!r}: the server's grammar settings are not a "
                                      "client's to change")
        on_path.add(key)
        stack.append((value, depth, True))
        for child in (value.values() if isinstance(value, dict) else value):
            stack.append((child, depth + 1, False))
