"""Prefix blocks: how a capsule's KV rows are cut into shared, content-addressed blocks.

A block holds `rows` token rows (rows = the capsule's prefill_chunk) of each block tensor (the attention
KV, cut along its token dimension). Block i of a capsule covers tokens [i*rows, (i+1)*rows) and its key is
a chained sha256: key(i) = sha256(key(i-1) || tokens of block i), key(-1) = sha256 of a seed naming the
namespace, the model fingerprint (weights version included), the layout version, rows and the *origin*
(the numerics that computed the bytes: device, torch, kernels). So a key names the whole token prefix up
to the block's end in one namespace of one model under one numerics; by the canonical grid state
(docs/design.md, exactness v2) equal keys mean equal bytes, and one copy serves every capsule that
references it. The chain also makes the keys a trie: a key names its path from the root, and a lookup
walks a new prompt block by block, probing a hash map (prefix_index.py).

Only capsules whose origin the store knows are cut (the engine's own snapshots); others stay whole.
"""
from __future__ import annotations

import hashlib
import json
import sys
from array import array
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from capsulert.capsule_store.capsule import CapsuleMeta, TensorSpec

KEY_SEED = b"capsulert-block-1"


@dataclass(frozen=True)
class BlockLayout:
    """Which capsule tensors a store cuts into blocks, and whose numerics computed them."""

    tensors: tuple[str, ...]  # cut along token_dim, e.g. ("kv_k", "kv_v")
    token_dim: int
    origin: str  # the numerics of the engine that snapshots into the store (its capsules are canonical)
    complete: str  # a tensor whose presence in an on-grid capsule means its state at the grid point is complete


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("i", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def chain_seed(namespace: str, fingerprint: str, layout_version: int, rows: int, origin: str) -> bytes:
    head = "\x00".join((namespace, fingerprint, str(layout_version), str(rows), origin))
    return hashlib.sha256(KEY_SEED + b"\x00" + head.encode("utf-8")).digest()


def chain_keys(seed: bytes, tokens: Sequence[int], rows: int, n: int | None = None) -> list[str]:
    """The keys of the first n blocks (default: every complete block) of `tokens`."""
    n = len(tokens) // rows if n is None else n
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(prev + _token_bytes(tokens[i * rows:(i + 1) * rows])).digest()
        keys.append(prev.hex())
    return keys


def keys_for(meta: CapsuleMeta, origin: str, n: int) -> list[str]:
    seed = chain_seed(meta.namespace, meta.fingerprint, meta.layout_version, meta.prefill_chunk, origin)
    return chain_keys(seed, meta.tokens, meta.prefill_chunk, n)


@dataclass(frozen=True)
class BlockRefs:
    """The blocks one capsule references, in order; what its file header records about them."""

    keys: tuple[str, ...]
    rows: int
    token_dim: int
    origin: str
    specs: Mapping[str, TensorSpec]  # of one block: every block tensor, `rows` rows along token_dim

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(sorted(self.specs))

    @property
    def grid(self) -> int:
        """Tokens the blocks cover: the capsule's grid point."""
        return len(self.keys) * self.rows

    @property
    def block_nbytes(self) -> int:
        return sum(s.dtype.itemsize * _numel(s.shape) for s in self.specs.values())

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_nbytes

    def to_json(self) -> str:
        specs = {k: {"shape": list(s.shape), "dtype": str(s.dtype).replace("torch.", "")} for k, s in self.specs.items()}
        return json.dumps({"keys": list(self.keys), "rows": self.rows, "token_dim": self.token_dim,
                           "origin": self.origin, "specs": specs}, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BlockRefs":
        """ValueError on anything malformed (the disk reader turns it into CorruptCapsuleError)."""
        d = json.loads(text)
        if not isinstance(d, dict) or set(d) != {"keys", "rows", "token_dim", "origin", "specs"}:
            raise ValueError("block references must be an object of keys, rows, token_dim, origin, specs")
        keys, rows, dim, origin, specs = d["keys"], d["rows"], d["token_dim"], d["origin"], d["specs"]
        if not (isinstance(keys, list) and all(isinstance(k, str) and len(k) == 64 for k in keys)):
            raise ValueError("block keys must be 64-character hex strings")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (rows, dim)):
            raise ValueError("rows and token_dim must be ints >= 1")
        if not isinstance(origin, str) or not isinstance(specs, dict) or not specs:
            raise ValueError("origin must be a string and specs a non-empty object")
        parsed = {}
        for name, s in specs.items():
            dtype = getattr(torch, s.get("dtype", "") if isinstance(s, dict) else "", None)
            shape = s.get("shape") if isinstance(s, dict) else None
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or len(shape) <= dim \
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape) \
                    or shape[dim] != rows:
                raise ValueError(f"block tensor spec {name!r} is malformed")
            parsed[name] = TensorSpec(tuple(shape), dtype)
        return cls(tuple(keys), rows, dim, origin, parsed)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Parts:
    """A capsule's bytes as the store holds them: its own tensors (state, and the KV rows past its last
    block) and, in order, the tensors of each block it references."""

    own: Mapping[str, torch.Tensor]
    blocks: tuple[Mapping[str, torch.Tensor], ...] = ()
    refs: BlockRefs | None = None

    def full(self) -> dict[str, torch.Tensor]:
        """The capsule's tensors as one piece each (blocks and tail concatenated: a copy when blocked)."""
        if not self.blocks:
            return dict(self.own)
        out = dict(self.own)
        for name in self.refs.specs:
            out[name] = torch.cat([b[name] for b in self.blocks] + [self.own[name]], dim=self.refs.token_dim)
        return out


def split(meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor], layout: BlockLayout | None,
          origin: str | None) -> Parts:
    """Cut a capsule's tensors into blocks (views) and own tensors. A capsule stays whole (refs None) when
    the store has no layout, its origin is unknown, or it does not have the layout's shape."""
    whole = Parts(dict(tensors))
    if layout is None or origin is None or meta.prefill_chunk < 1:
        return whole
    rows, dim, P = meta.prefill_chunk, layout.token_dim, meta.boundary
    n = P // rows
    if meta.grid_pos != n * rows:
        return whole
    for name in layout.tensors:
        t = tensors.get(name)
        if t is None or t.dim() <= dim or t.shape[dim] != P:
            return whole
    blocks = tuple({name: tensors[name].narrow(dim, i * rows, rows) for name in layout.tensors} for i in range(n))
    own = dict(tensors)
    for name in layout.tensors:
        own[name] = tensors[name].narrow(dim, n * rows, P - n * rows)
    # a capsule shorter than a block references none, but still records its origin (restoring it gives
    # a session whose state is canonical for that origin)
    specs = {name: TensorSpec(tuple(rows if d == dim else x for d, x in enumerate(tensors[name].shape)),
                              tensors[name].dtype) for name in layout.tensors}
    return Parts(own, blocks, BlockRefs(tuple(keys_for(meta, origin, n)), rows, dim, origin, specs))


def full_specs(own: Mapping[str, TensorSpec], refs: BlockRefs | None) -> dict[str, TensorSpec]:
    """The specs of the whole tensors of a capsule held as own tensors + blocks."""
    out = dict(own)
    if refs is None:
        return out
    for name, s in refs.specs.items():
        tail = own[name].shape
        shape = list(s.shape)
        shape[refs.token_dim] = refs.grid + tail[refs.token_dim]
        out[name] = TensorSpec(tuple(shape), s.dtype)
    return out
