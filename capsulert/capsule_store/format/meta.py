"""CapsuleMeta as JSON: how a capsule's metadata is written into a capsule file's header and an export.

The data model (fields, their validation) is capsule.CapsuleMeta; this module owns its encoding: compact,
sorted keys, no NaN or infinity, the optional fields left out at their defaults (so such capsules read as
before those fields existed), and the names older layouts wrote read as what they were. Any refusal while
reading is CorruptCapsuleError.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CorruptCapsuleError, InvalidCapsuleNameError

OPTIONAL_FIELDS: dict[str, Any] = {"decoded_from": None, "replay_from": None}


def meta_to_json(meta: CapsuleMeta) -> str:
    # shallow: every field is a plain value, and dataclasses.asdict deep-copies each of the token ids
    # (12 ms for 16k tokens on a small CPU, on the path of every device transfer's manifest)
    d = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    d["tokens"] = list(meta.tokens)
    for f in OPTIONAL_FIELDS:  # left out at their defaults: such capsules read as before this field
        if d[f] == OPTIONAL_FIELDS[f]:
            del d[f]
    return json.dumps(d, separators=(",", ":"), sort_keys=True, allow_nan=False)


def meta_from_json(text: str | bytes) -> CapsuleMeta:
    try:
        d = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, TypeError, RecursionError) as e:
        raise CorruptCapsuleError(f"capsule metadata is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CorruptCapsuleError("capsule metadata must be a JSON object")
    if "prefill_chunk" in d and "grid" not in d:
        # layout 2 kept its state on the prefill-chunk grid under this name: read it as what it was, so
        # the capsule is listed and its restore refused by the layout check, never misread
        d["grid"] = d.pop("prefill_chunk")
    fields = {f.name for f in dataclasses.fields(CapsuleMeta)}
    if not fields - set(OPTIONAL_FIELDS) <= set(d) <= fields:
        missing, extra = sorted(fields - set(d)), sorted(set(d) - fields)
        raise CorruptCapsuleError(f"capsule metadata fields wrong: missing {missing}, unexpected {extra}")
    for f in ("name", "namespace", "token_digest", "fingerprint", "checksum"):
        if not isinstance(d[f], str):
            raise CorruptCapsuleError(f"capsule metadata field {f!r} must be a string")
    if not isinstance(d["tokens"], list):
        raise CorruptCapsuleError("capsule metadata field 'tokens' must be a list")
    try:
        return CapsuleMeta(**{**d, "tokens": tuple(d["tokens"])})
    except (ValueError, TypeError, OverflowError, InvalidCapsuleNameError) as e:
        raise CorruptCapsuleError(f"capsule metadata is invalid: {e}") from None


def _refuse_constant(c: str) -> Any:
    raise ValueError(f"non-finite number {c} in capsule metadata")
