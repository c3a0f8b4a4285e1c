"""Prefix blocks: how a capsule's KV rows are cut into shared, content-addressed blocks.

A block holds `rows` token rows (rows = the capsule's grid) of each block tensor (the attention
KV, cut along its token dimension). Block i of a capsule covers tokens [i*rows, (i+1)*rows) and its key is
a chained sha256: key(i) = sha256(key(i-1) || tokens of block i), key(-1) = sha256 of a seed naming the
namespace, the model fingerprint (weights version included), the layout version, rows and the *origin*
(the numerics that computed the bytes: device, torch, kernels). So a key names the whole token prefix up
to the block's end in one namespace of one model under one numerics; by the canonical grid state
(docs/design.md, exactness v2) equal keys mean equal bytes, and one copy serves every capsule that
references it. The chain also makes the keys a trie: a key names its path from the root, and a lookup
walks a new prompt block by block, probing a hash map (prefix_index.py).

The *grid-state block*: the tensors that hold a capsule's recurrent and conv state at its grid point G
(`BlockLayout.grid_state`: the live state of an on-grid capsule, the grid checkpoint of an off-grid one)
are, like the KV rows [0, G), a pure function of tokens[:G] (canonical grid state). They are one more
block, keyed by the key of the KV block ending at G under a distinct kind tag (state_key), so every
capsule (and prefix entry) standing on or past the same grid point of the same prefix holds one copy.
Nothing computed from tokens past G (the live state off the grid, the last hidden state, the KV rows
[G, P)) is ever in a block: decode computes those with other arithmetic than a cold prefill, so they
depend on how the tokens were produced, not on the tokens alone.

Only capsules whose origin the store knows are cut (the engine's own snapshots); others stay whole.
"""
from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator, Mapping, Sequence

import torch

from capsulert.capsule_store.capsule import CapsuleMeta, TensorSpec, tensor_specs
from capsulert.kernels.triton_copy import Strided

KEY_SEED = b"capsulert-block-1"
STATE_TAG = b"capsulert-grid-state-1\x00"  # the kind tag of grid-state keys: never a KV block's key


@dataclass(frozen=True)
class BlockLayout:
    """Which capsule tensors a store cuts into blocks, and whose numerics computed them."""

    tensors: tuple[str, ...]  # cut along token_dim, e.g. ("kv_k", "kv_v")
    token_dim: int
    origin: str  # the numerics of the engine that snapshots into the store (its capsules are canonical)
    complete: str  # a tensor whose presence in an on-grid capsule means its state at the grid point is complete
    # the state at the grid point, shared as one block: (its name in an on-grid capsule, which is also its
    # name in the block; its name in an off-grid capsule), e.g. (("ssm", "ssm_grid"), ("conv", "conv_grid"))
    grid_state: tuple[tuple[str, str], ...] = ()


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
    return _extend_chain(seed, tokens, rows, 0, n)


def _extend_chain(prev: bytes, tokens: Sequence[int], rows: int, start: int, n: int) -> list[str]:
    """The keys of blocks [start, n) of `tokens`, `prev` the digest of block start - 1's key (or the seed)."""
    data, step = _token_bytes(tokens[start * rows:n * rows]), 4 * rows  # encoded once, not per block
    keys = []
    for i in range(n - start):
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step]).digest()
        keys.append(prev.hex())
    return keys


class ChainKeys:
    """`chain_keys` that remembers the chains it computed last (`capacity` of them, least recently used
    dropped): an agent that snapshots every turn, or a prompt looked up at every append, repeats its prefix, and
    hashing its blocks again was a third of a repeated 16k-token snapshot's host time. A remembered chain is found
    by its seed and first block's key; the whole blocks a new sequence shares with it keep their keys and only the
    rest is hashed, so every key is what chain_keys gives. One lock: the store's puts and the prefix lookups come
    from several threads."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._chains: OrderedDict[tuple[bytes, str], tuple[tuple[int, ...], list[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The chains it remembers."""
        return len(self._chains)

    def keys(self, seed: bytes, tokens: Sequence[int], rows: int, n: int | None = None) -> list[str]:
        n = len(tokens) // rows if n is None else n
        if n == 0:
            return []
        held = tuple(tokens[:n * rows])  # the memo keeps its own: a caller's list may change
        first = _extend_chain(seed, held, rows, 0, 1)[0]
        with self._lock:
            hit = self._chains.get((seed, first))
        shared = 1
        if hit is not None:
            shared = max(1, _shared_blocks(held, hit[0], rows, min(n, len(hit[1]))))
            keys = hit[1][:shared]
        else:
            keys = [first]
        keys = keys + _extend_chain(bytes.fromhex(keys[-1]), held, rows, shared, n)
        with self._lock:
            if hit is None or n >= len(hit[1]):  # the longer chain stays (a shorter look-up shares its start)
                self._chains[(seed, first)] = (held, keys)
            self._chains.move_to_end((seed, first))
            while len(self._chains) > self.capacity:
                self._chains.popitem(last=False)
        return keys


def _shared_blocks(a: tuple[int, ...], b: tuple[int, ...], rows: int, most: int) -> int:
    """How many whole blocks (at most `most`) `a` and `b` start with in common."""
    if a[:most * rows] == b[:most * rows]:
        return most
    lo, hi = 0, most - 1  # blocks [0, lo) are shared, block `hi` is not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * rows] == b[:mid * rows]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def state_key(last_key: str) -> str:
    """The key of the grid-state block at the end of the KV block `last_key` (same prefix, another kind)."""
    return hashlib.sha256(STATE_TAG + bytes.fromhex(last_key)).hexdigest()


def keys_for(meta: CapsuleMeta, origin: str, n: int, chains: ChainKeys | None = None) -> list[str]:
    seed = chain_seed(meta.namespace, meta.fingerprint, meta.layout_version, meta.grid, origin)
    if chains is not None:
        return chains.keys(seed, meta.tokens, meta.grid, n)
    return chain_keys(seed, meta.tokens, meta.grid, n)


@dataclass(frozen=True)
class BlockRefs:
    """The blocks one capsule references, in order; what its file header records about them (as JSON:
    format/block_refs.py): the KV blocks [0, G) (`keys`) and, when it shares its state at G, the grid-state
    block (`state`)."""

    keys: tuple[str, ...]
    rows: int
    token_dim: int
    origin: str
    specs: Mapping[str, TensorSpec]  # of one KV block: every block tensor, `rows` rows along token_dim
    state: str | None = None  # the grid-state block's key (state_key(keys[-1])); None: held by the capsule
    state_specs: Mapping[str, TensorSpec] = field(default_factory=dict)  # its tensors, by their block name
    state_names: Mapping[str, str] = field(default_factory=dict)  # capsule tensor name -> block tensor name

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(sorted(self.specs))

    @property
    def grid(self) -> int:
        """Tokens the blocks cover: the capsule's grid point."""
        return len(self.keys) * self.rows

    @cached_property  # asked on every read, reference and plan step
    def all_keys(self) -> tuple[str, ...]:
        """Every block the capsule references: its KV blocks, then its grid-state block."""
        return self.keys + ((self.state,) if self.state is not None else ())

    @cached_property  # asked once per block by every plan and tier move
    def block_nbytes(self) -> int:
        """Bytes of one KV block."""
        return _spec_nbytes(self.specs)

    @cached_property
    def state_nbytes(self) -> int:
        return _spec_nbytes(self.state_specs) if self.state is not None else 0

    def nbytes_of(self, key: str) -> int:
        return self.state_nbytes if key == self.state else self.block_nbytes

    def specs_of(self, key: str) -> Mapping[str, TensorSpec]:
        return self.state_specs if key == self.state else self.specs

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_nbytes + self.state_nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _spec_nbytes(specs: Mapping[str, TensorSpec]) -> int:
    return sum(s.dtype.itemsize * _numel(s.shape) for s in specs.values())


Tensors = Mapping[str, torch.Tensor]


class BlockViews:
    """The KV blocks of whole tensors as views, made when asked for: a put into a memory tier copies each slab
    from the whole tensors' rows and never looks at a block (at 2k, 32 blocks of 4 tensors: 128 views a
    snapshot would make for nothing); a disk write iterates them."""

    def __init__(self, tensors: Tensors, names: Sequence[str], dim: int, rows: int, n: int):
        self._tensors, self._names, self._dim, self._rows, self._n = tensors, tuple(names), dim, rows, n

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Tensors]:
        return (self[i] for i in range(self._n))

    def __getitem__(self, i: int) -> Tensors:
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} of {self._n}")
        return {name: self._tensors[name].narrow(self._dim, i * self._rows, self._rows) for name in self._names}


class KeyedBlocks:
    """A capsule's KV blocks in order, each looked up by its key only when asked for: a memory tier makes a
    slab-held block's views on first use, and a restore copies slab runs without them (a crowd's 64 restores at
    3.5k would otherwise make 3,500 blocks' views, tens of ms, on every capsule's first read)."""

    def __init__(self, keys: Sequence[str], by_key: "Mapping[str, Tensors] | BlockLookup"):
        self._keys, self._by_key = tuple(keys), by_key

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Tensors]:
        return (self._by_key[k] for k in self._keys)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            return [self._by_key[k] for k in self._keys[i]]
        return self._by_key[self._keys[i]]


class BlockLookup:
    """Blocks' tensors by key, each looked up when asked for (`tensors_of`: a memory tier's record lookup)."""

    def __init__(self, tensors_of: Callable[[str], Tensors]):
        self._tensors_of = tensors_of

    def __getitem__(self, key: str) -> Tensors:
        return self._tensors_of(key)


@dataclass(frozen=True, eq=False)
class SlabRow:
    """Where a block a memory tier holds lives: row `index` of its slabs (one [count, *block shape] tensor per
    block tensor, allocated together: transfer.slabs_for)."""

    slabs: Mapping[str, torch.Tensor]
    index: int


@dataclass(frozen=True)
class BlockRun:
    """Blocks first..first+count of a capsule held in consecutive rows of one slab, from row `index` on: the
    run copies as one pair per tensor, not one per block."""

    first: int
    count: int
    slabs: Mapping[str, torch.Tensor]
    index: int

    def rows(self, name: str, skip: int = 0) -> Strided:
        """Slab `name`'s rows of the run's blocks past its first `skip`, [count - skip, *block shape], as a view
        not made yet (a restore's plan reads its address alone)."""
        slab = self.slabs[name]
        stride = slab.stride()
        return Strided(slab, (self.count - skip, *slab.shape[1:]), stride,
                       slab.storage_offset() + (self.index + skip) * stride[0])

    @property
    def tensors(self) -> Tensors:
        """The run's rows of every slab, as views."""
        return {n: self.rows(n).view() for n in self.slabs}


def block_runs(rows: Sequence[SlabRow | None]) -> tuple[BlockRun, ...] | None:
    """The maximal runs of a capsule's blocks (in order) that lie in consecutive rows of one slab; None when a
    block's place is unknown (a block read from a file, one held only until its disk write settles)."""
    spans: list[list] = []  # [first block, count, slab row of the first]
    for i, row in enumerate(rows):
        if row is None:
            return None
        last = spans[-1] if spans else None
        if last is not None and last[2].slabs is row.slabs and last[2].index + last[1] == row.index:
            last[1] += 1
        else:
            spans.append([i, 1, row])
    return tuple(BlockRun(first, count, row.slabs, row.index) for first, count, row in spans)


@dataclass(frozen=True)
class Parts:
    """A capsule's bytes as the store holds them: its own tensors (the KV rows past its last block, the
    state it does not share), in order the tensors of each KV block it references, and the tensors of its
    grid-state block (by their block names). `file_origin`: for a whole capsule read from a file, the
    origin that file records (None: unknown)."""

    own: Tensors
    blocks: "tuple[Tensors, ...] | BlockViews | KeyedBlocks" = ()
    refs: BlockRefs | None = None
    state: Tensors | None = None
    file_origin: str | None = None
    runs: tuple[BlockRun, ...] | None = None  # the KV blocks as slab runs, where a memory tier holds them

    @classmethod
    def of(cls, own: Tensors, refs: BlockRefs | None, by_key: "Mapping[str, Tensors] | BlockLookup",
           slab_rows: Sequence[SlabRow | None] | None = None) -> "Parts":
        """A capsule's parts from its own tensors and its blocks' tensors by key (and, for blocks a memory tier
        holds, the slab row of each KV block, in the order of refs.keys)."""
        if refs is None:
            return cls(own)
        runs = block_runs(slab_rows) if slab_rows is not None else None
        return cls(own, KeyedBlocks(refs.keys, by_key), refs,
                   by_key[refs.state] if refs.state is not None else None, runs=runs)

    @property
    def origin(self) -> str | None:
        """The numerics that computed the bytes, when known."""
        return self.refs.origin if self.refs is not None else self.file_origin

    def by_key(self) -> dict[str, Tensors]:
        """The tensors of every block it references, by key (KV blocks, then the grid-state block)."""
        if self.refs is None:
            return {}
        out = dict(zip(self.refs.keys, self.blocks))
        if self.refs.state is not None:
            out[self.refs.state] = self.state  # type: ignore[assignment]
        return out

    def own_view(self) -> dict[str, torch.Tensor]:
        """Every capsule tensor but the KV blocks, by its capsule name: its own tensors and the grid state
        its state block holds (views, no copy)."""
        out = dict(self.own)
        if self.refs is not None and self.refs.state is not None:
            out.update({name: self.state[b] for name, b in self.refs.state_names.items()})  # type: ignore[index]
        return out

    def pieces(self) -> tuple[dict[str, list[torch.Tensor]], int]:
        """Each capsule tensor as the pieces the store holds it in (views: its KV blocks then its tail, or
        the one tensor), and the dimension block pieces join on."""
        out = {name: [t] for name, t in self.own_view().items()}
        if not self.blocks:
            return out, 0
        for name in self.refs.specs:  # type: ignore[union-attr]
            out[name] = [b[name] for b in self.blocks] + [self.own[name]]
        return out, self.refs.token_dim  # type: ignore[union-attr]

    def full(self) -> dict[str, torch.Tensor]:
        """The capsule's tensors as one piece each (blocks and tail concatenated: a copy when blocked)."""
        pieces, dim = self.pieces()
        return {name: ps[0] if len(ps) == 1 else torch.cat(ps, dim=dim) for name, ps in pieces.items()}


def split(meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor], layout: BlockLayout | None,
          origin: str | None, chains: ChainKeys | None = None) -> Parts:
    """Cut a capsule's tensors into blocks (views) and own tensors. A capsule stays whole (refs None) when
    the store has no layout, its origin is unknown, or it does not have the layout's shape. Its state at
    the grid point becomes the grid-state block when the layout names it and the capsule covers a block.
    `chains`: the store's memo of chain keys (else each key is hashed)."""
    whole = Parts(dict(tensors))
    if layout is None or origin is None or meta.grid < 1:
        return whole
    rows, dim, P = meta.grid, layout.token_dim, meta.held
    n = P // rows
    if meta.held_grid != n * rows:
        return whole
    for name in layout.tensors:
        t = tensors.get(name)
        if t is None or t.dim() <= dim or t.shape[dim] != P:
            return whole
    blocks = BlockViews(tensors, layout.tensors, dim, rows, n)
    own = dict(tensors)
    own.update({name: tensors[name].narrow(dim, n * rows, P - n * rows) for name in layout.tensors})
    # a capsule shorter than a block references none, but still records its origin (restoring it gives
    # a session whose state is canonical for that origin)
    specs = {name: TensorSpec(tuple(rows if d == dim else x for d, x in enumerate(tensors[name].shape)),
                              tensors[name].dtype) for name in layout.tensors}
    keys = tuple(keys_for(meta, origin, n, chains))
    # on the grid the live state is the state at G; off it the grid checkpoint is (the live state at P is
    # computed from tokens past G: never shared)
    names = {(on if P == n * rows else off): on for on, off in layout.grid_state}
    if not keys or not names or not all(c in tensors for c in names):
        return Parts(own, blocks, BlockRefs(keys, rows, dim, origin, specs))
    state = {b: own.pop(c) for c, b in names.items()}
    return Parts(own, blocks, BlockRefs(keys, rows, dim, origin, specs, state_key(keys[-1]), tensor_specs(state),
                                        names), state)


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
    out.update({name: refs.state_specs[b] for name, b in refs.state_names.items()})
    return out
