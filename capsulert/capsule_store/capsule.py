"""The capsule data model: metadata, listing records, references, name rules and digests.

A capsule is a named, immutable copy of one session slot's complete state at a boundary P. Its
tensors live in the store; this module holds what describes them. Nothing here touches the disk or
the device.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
from dataclasses import InitVar, dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from capsulert.protocol.names import DEFAULT_NAMESPACE, MAX_NAME_LEN, validate_name  # noqa: F401  (the capsule data model's rule)

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_INT32_MAX = 2**31 - 1


def packed_tokens(tokens: Any) -> tuple[tuple[int, ...], bytes]:
    """The token ids as Python ints and as little-endian int32 bytes. Any integers (numpy and torch ones too)
    in [0, 2**31 - 1] are accepted, ValueError for anything else; the checks run in C (struct), since a
    snapshot packs every capsule's tokens (16k of them in ~0.6 ms)."""
    seq = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    fmt = struct.Struct(f"<{len(seq)}i")
    try:
        raw = fmt.pack(*seq)  # struct.error for non-integers and beyond int32
    except struct.error as e:
        raise ValueError(f"tokens must be ints in [0, 2**31 - 1]: {e}") from None
    if not raw[3::4].isascii():  # every high byte < 0x80: no int32 sign bit set
        raise ValueError("tokens must be ints in [0, 2**31 - 1]: a token is negative")
    return fmt.unpack(raw), raw


def token_digest(tokens: Any) -> str:
    """sha256 hex of the token ids as little-endian int32 bytes."""
    return hashlib.sha256(packed_tokens(tokens)[1]).hexdigest()


def tensor_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float (e.g. 10**400 from hostile JSON)
        return False


# fingerprint = "<model>" for the loaded weights, "<model>@w<identity>.<N>" after weight updates: the identity
# names the update (random per update, or the one an orchestrator gave every worker), so capsules of other
# weights are stale whatever the counter N says, across processes and restarts (counters start at 0 in each)
WEIGHTS_MARK = "@w"


def model_of(fingerprint: str) -> str:
    """The model part of a fingerprint (which weights made it aside)."""
    return fingerprint.split(WEIGHTS_MARK, 1)[0]


def weights_fingerprint(model: str, identity: str, version: int) -> str:
    """The fingerprint of weights `identity` (version `version` of this process) of `model`."""
    return f"{model_of(model)}{WEIGHTS_MARK}{identity}.{version}"


def weights_version_of(fingerprint: str) -> int:
    """The weights version a fingerprint names (0: the loaded weights); files of the old "<model>@w<N>"
    form read as N."""
    _, _, v = fingerprint.partition(WEIGHTS_MARK)
    v = v.rpartition(".")[2]
    return int(v) if v.isdigit() else 0


def weights_identity_of(fingerprint: str) -> str:
    """The weights identity a fingerprint names ("" for the loaded weights)."""
    _, _, v = fingerprint.partition(WEIGHTS_MARK)
    return v.rpartition(".")[0]


@dataclass(frozen=True)
class CapsuleMeta:
    """Everything that describes a capsule except its tensors. Validated on construction (ValueError
    or InvalidCapsuleNameError). Its JSON encoding is format/meta.py's (a refusal there is
    CorruptCapsuleError)."""

    name: str
    namespace: str
    boundary: int  # P: tokens covered
    grid_pos: int  # G <= P: the last grid point (multiple of grid) at or before P
    tokens: tuple[int, ...]
    token_digest: str
    fingerprint: str
    layout_version: int
    grid: int  # canonical state and prefix blocks every `grid` tokens (the engine's GRID)
    nbytes: int
    created_at: float
    recompute_cost_s: float
    checksum: str = ""
    # tokens[:decoded_from] were folded in by the prefill path from the grid checkpoint (a pure function of
    # the tokens), tokens[decoded_from:] by one-token decode steps (G <= decoded_from <= P); None: unknown
    decoded_from: int | None = None
    # a replay capsule holds only the state at the grid point replay_from <= G (KV rows [0, replay_from), the
    # recurrent and conv state there) and rebuilds the rest on restore by re-running tokens[replay_from:] as
    # they were made (engine/capsules.py); None: the capsule holds its complete state at P
    replay_from: int | None = None
    # set by build(), which checked the tokens and computed their digest itself (on the snapshot hot path)
    tokens_checked: InitVar[bool] = False

    def __post_init__(self, tokens_checked: bool) -> None:
        validate_name(self.name)
        validate_name(self.namespace, "namespace")
        toks = self.tokens
        if isinstance(toks, (str, bytes)) or not isinstance(toks, (tuple, list)):
            raise ValueError(f"tokens must be a tuple of ints, got {type(toks).__name__}")
        # type / min / max run in C: a 16k-token capsule validates in well under a millisecond
        if not tokens_checked and toks and (
                not set(map(type, toks)) <= {int} or min(toks) < 0 or max(toks) > _INT32_MAX):
            raise ValueError("tokens must be ints in [0, 2**31 - 1]")
        object.__setattr__(self, "tokens", tuple(toks))
        for f in ("boundary", "grid_pos", "layout_version", "grid", "nbytes"):
            v = getattr(self, f)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{f} must be an int >= 0, got {v!r}")
        if self.grid < 1:
            raise ValueError(f"grid must be >= 1, got {self.grid}")
        if self.boundary != len(self.tokens):
            raise ValueError(f"boundary {self.boundary} != number of tokens {len(self.tokens)}")
        if self.grid_pos > self.boundary:
            raise ValueError(f"grid_pos {self.grid_pos} > boundary {self.boundary}")
        if self.decoded_from is not None and (
                not _is_int(self.decoded_from) or not self.grid_pos <= self.decoded_from <= self.boundary):
            raise ValueError(f"decoded_from must be None or an int in [grid_pos, boundary], got {self.decoded_from!r}")
        if self.replay_from is not None and (
                not _is_int(self.replay_from) or not 0 <= self.replay_from <= self.grid_pos
                or self.replay_from % self.grid or self.replay_from == self.boundary):
            raise ValueError(f"replay_from must be None or a grid point below boundary and <= grid_pos, "
                             f"got {self.replay_from!r}")
        if self.replay_from is not None and self.decoded_from is None:
            raise ValueError("a replay capsule needs decoded_from (how its tokens past the grid point were made)")
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise ValueError("fingerprint must be a non-empty str")
        for f in ("created_at", "recompute_cost_s"):
            v = getattr(self, f)
            if not _is_num(v) or v < 0:
                raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if not isinstance(self.token_digest, str) or _HEX64_RE.fullmatch(self.token_digest) is None:
            raise ValueError("token_digest must be 64 lowercase hex characters")
        if not tokens_checked and self.token_digest != token_digest(self.tokens):
            raise ValueError("token_digest does not match tokens")
        if not isinstance(self.checksum, str) or (
            self.checksum and _HEX64_RE.fullmatch(self.checksum) is None
        ):
            raise ValueError("checksum must be '' or 64 lowercase hex characters")

    @property
    def held(self) -> int:
        """The position whose state the capsule's tensors hold: P, or replay_from for a replay capsule."""
        return self.boundary if self.replay_from is None else self.replay_from

    @property
    def held_grid(self) -> int:
        """The last grid point at or before `held`: where its KV blocks end and its grid state is."""
        return self.held // self.grid * self.grid

    @classmethod
    def build(cls, *, name: str, namespace: str = DEFAULT_NAMESPACE, tokens: Any, grid_pos: int,
              fingerprint: str, layout_version: int, grid: int, nbytes: int,
              recompute_cost_s: float = 0.0, created_at: float | None = None,
              decoded_from: int | None = None, replay_from: int | None = None) -> "CapsuleMeta":
        """Convenience constructor: fills boundary, token_digest and created_at; tokens as packed_tokens takes
        them."""
        import time

        toks, raw = packed_tokens(tokens)
        return cls(name=name, namespace=namespace, boundary=len(toks), grid_pos=grid_pos,
                   tokens=toks, token_digest=hashlib.sha256(raw).hexdigest(), fingerprint=fingerprint,
                   layout_version=layout_version, grid=grid, nbytes=nbytes,
                   created_at=time.time() if created_at is None else created_at,
                   recompute_cost_s=recompute_cost_s, decoded_from=decoded_from, replay_from=replay_from,
                   tokens_checked=True)

    def replace(self, **changes: Any) -> "CapsuleMeta":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one capsule tensor: enough to check a capsule fits a state layout without
    touching (or moving) its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, TensorSpec]:
    return MappingProxyType({k: TensorSpec(tuple(t.shape), t.dtype) for k, t in tensors.items()})


@dataclass(frozen=True)
class CapsuleInfo:
    """One row of CapsuleStore.list(): the metadata plus where the capsule is now.

    `nbytes` is what the capsule holds alone: the state it does not share (computed past its grid point)
    and the KV rows past its last prefix block (its whole size, meta.nbytes, when it is held whole). The
    blocks it shares with other capsules (`blocks` of them, `shared_nbytes` bytes: its KV blocks and its
    grid-state block) are counted once per tier in the store's stats()."""

    meta: CapsuleMeta
    tier: str
    pinned: bool
    last_used: float
    own_nbytes: int | None = None  # None: held whole (meta.nbytes)
    blocks: int = 0
    # its file is in disk_dir: a disk-tier capsule, or one promoted out of disk (promotion copies; the file,
    # counted in the disk tier's bytes, stays until a delete, a drop or disk budget pressure removes it)
    on_disk: bool = False

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def namespace(self) -> str:
        return self.meta.namespace

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes if self.own_nbytes is None else self.own_nbytes

    @property
    def shared_nbytes(self) -> int:
        return self.meta.nbytes - self.nbytes


@dataclass(frozen=True)
class CapsuleRef:
    """What snapshot returns: a handle by name, not the tensors. `nbytes`: the capsule's whole size
    (meta.nbytes: its state and every KV row, shared prefix blocks included)."""

    name: str
    namespace: str
    tier: str
    nbytes: int
    boundary: int
