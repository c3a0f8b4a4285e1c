"""BlockRefs as JSON: the `capsulert.blocks` entry of a capsule file's header (formats 2 and 3), naming the
blocks the capsule references, their tensors' specs and, for format 3, its grid-state block."""
from __future__ import annotations

import json
from typing import Mapping

import torch

from capsulert.capsule_store.blocks import BlockRefs
from capsulert.capsule_store.capsule import TensorSpec


def refs_to_json(refs: BlockRefs) -> str:
    d = {"keys": list(refs.keys), "rows": refs.rows, "token_dim": refs.token_dim, "origin": refs.origin,
         "specs": _specs_json(refs.specs)}
    if refs.state is not None:
        d["state"] = {"key": refs.state, "names": dict(refs.state_names), "specs": _specs_json(refs.state_specs)}
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def refs_from_json(text: str) -> BlockRefs:
    """ValueError on anything malformed (the disk reader turns it into CorruptCapsuleError)."""
    d = json.loads(text)
    fields = {"keys", "rows", "token_dim", "origin", "specs"}
    if not isinstance(d, dict) or not fields <= set(d) <= fields | {"state"}:
        raise ValueError("block references must be an object of keys, rows, token_dim, origin, specs (and state)")
    keys, rows, dim, origin, specs = d["keys"], d["rows"], d["token_dim"], d["origin"], d["specs"]
    if not (isinstance(keys, list) and all(_is_key(k) for k in keys)):
        raise ValueError("block keys must be 64-character hex strings")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (rows, dim)):
        raise ValueError("rows and token_dim must be ints >= 1")
    if not isinstance(origin, str) or not isinstance(specs, dict) or not specs:
        raise ValueError("origin must be a string and specs a non-empty object")
    parsed = _parse_specs(specs, dim, rows)
    if "state" not in d:
        return BlockRefs(tuple(keys), rows, dim, origin, parsed)
    st = d["state"]
    if not isinstance(st, dict) or set(st) != {"key", "names", "specs"} or not _is_key(st["key"]):
        raise ValueError("the grid-state block must be an object of key, names, specs")
    names, sspecs = st["names"], st["specs"]
    if not isinstance(sspecs, dict) or not sspecs or not isinstance(names, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()) \
            or sorted(names.values()) != sorted(sspecs) or set(names) & set(specs):
        raise ValueError("the grid-state block's names must map capsule tensors onto each of its tensors once")
    return BlockRefs(tuple(keys), rows, dim, origin, parsed, st["key"], _parse_specs(sspecs), dict(names))


def _is_key(k: object) -> bool:
    return isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)


def _specs_json(specs: Mapping[str, TensorSpec]) -> dict:
    return {k: {"shape": list(s.shape), "dtype": str(s.dtype).replace("torch.", "")} for k, s in specs.items()}


def _parse_specs(specs: dict, dim: int | None = None, rows: int | None = None) -> dict[str, TensorSpec]:
    """Specs from JSON; with `dim` every tensor has `rows` rows along it (a KV block)."""
    parsed = {}
    for name, s in specs.items():
        dtype = getattr(torch, s.get("dtype", "") if isinstance(s, dict) else "", None)
        shape = s.get("shape") if isinstance(s, dict) else None
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) \
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape) \
                or (dim is not None and (len(shape) <= dim or shape[dim] != rows)):
            raise ValueError(f"block tensor spec {name!r} is malformed")
        parsed[name] = TensorSpec(tuple(shape), dtype)
    return parsed
