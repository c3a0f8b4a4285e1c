"""The state set: every piece of live session state, as named buffers with a slot dimension.

Allocated once when the engine starts and never re-allocated, resized or replaced: forward passes update
them in place, snapshot/restore copy between them and capsules. Data pointers are stable for the life of
the engine (tested), which is what lets captured CUDA graphs and capsules refer to them.

`ssm_grid` / `conv_grid` hold the recurrent and conv state of each slot at its last grid point
G = floor(len / 64) * 64 (engine.GRID). Appends re-run the tokens [G, len) from there, so a prefill
split on the grid, a restore + append, and a cold prefill all run the same kernels on the same shapes.

`tail_in` / `tail_gates` are the exact-replay buffer: per linear-attention layer, the conv inputs and the raw
gate projections (b | a) of the prefilled tokens past the grid point, at most GRID - 1 of them. With them an
append re-runs those tokens through the linear-attention layers' conv and chunk math only (their projections,
MLPs and attention rows, KV included, are what they were: split-invariant prefill), instead of through the
whole model. Decoded tokens have none (decode computes other bits), so they are re-run in full.

`mtp_k` / `mtp_v` (a model with an MTP head, engine/mtp.py) are the head's KV cache, one row per token like
`kv_k`: row p holds the head's entry for token p (computed from the main model's hidden state at p - 1 and
token p; row 0 has none and is never read), so the rows [0, G) of a prefix are a function of tokens[:G] and
are cut into prefix blocks with the model's KV. The head's seed (the hidden state its next row starts from)
is `last_hidden`; on such a model `grid_hidden` is kept at every grid point (the seed there: a re-run from
the grid point starts with it), as part of the grid checkpoint, and `tail_hidden` at the end of the kept tail (the
seed there: an append after decoded tokens re-runs them from the tail's end, where `last_hidden` has moved on).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from capsulert.config.model import ModelConfig
from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK

# 3: as 2 (the live state at P, KV [0, P), plus the grid checkpoint off the grid) on the 64-token grid; 2 kept
# its grid checkpoint and prefix blocks every prefill_chunk tokens. A v3 capsule off the grid may also hold
# the exact-replay rows of its tail (tail_in, tail_gates); one without them re-runs its tail in full.
# 4: as 3, plus on a model with an MTP head its KV rows (mtp_k, mtp_v, cut into blocks like the KV) and the
# hidden state before the grid point (grid_hidden, in the grid-state block). A v4 capsule on such a model whose tail
# decoded tokens follow also holds the head's seed at the tail's end (tail_hidden); before that tensor such a
# capsule kept no tail rows, so every v4 capsule reads the same.
LAYOUT_VERSION = 4
# rows of the exact-replay buffer: a grid chunk (engine.GRID, the gated delta rule's chunk)
TAIL_ROWS = GATED_DELTA_CHUNK
# buffers that only prefill writes (the grid checkpoint and what a piece keeps with it): a decode step leaves
# them as they are, so a speculative step has nothing of them to roll back
PREFILL_ONLY = frozenset({"ssm_grid", "conv_grid", "grid_hidden", "tail_in", "tail_gates", "tail_hidden"})


@dataclass(frozen=True)
class StateLayout:
    slots: int
    max_seq: int
    attn_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_dim: int
    conv_width: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    tail_rows: int = 0  # rows of the exact-replay buffer (TAIL_ROWS), 0: no such buffer
    mtp_layers: int = 0  # the MTP head's attention layers (0: no head, no MTP state)

    @classmethod
    def for_model(cls, cfg: ModelConfig, slots: int, max_seq: int, dtype, device,
                  tail_replay: bool = False) -> "StateLayout":
        return cls(
            slots=slots,
            max_seq=max_seq,
            attn_layers=len(cfg.attention_layers),
            linear_layers=len(cfg.linear_layers),
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            v_heads=cfg.linear_num_value_heads,
            k_dim=cfg.linear_key_head_dim,
            v_dim=cfg.linear_value_head_dim,
            conv_dim=cfg.conv_dim,
            conv_width=cfg.linear_conv_kernel_dim - 1,
            hidden=cfg.hidden_size,
            dtype=dtype,
            device=torch.device(device),
            tail_rows=TAIL_ROWS if tail_replay else 0,
            mtp_layers=cfg.mtp_num_hidden_layers,
        )

    @property
    def block_tensors(self) -> tuple[str, ...]:
        """The buffers with one row per token ([layers, slots, rows, ...]): a capsule holds rows [0, P) of
        them, and its rows [0, G) are cut into prefix blocks."""
        return ("kv_k", "kv_v") + (("mtp_k", "mtp_v") if self.mtp_layers else ())

    @property
    def grid_state(self) -> tuple[tuple[str, str], ...]:
        """The state at a grid point, shared as one block: (its name in an on-grid capsule, in an off-grid one)."""
        hidden = (("last_hidden", "grid_hidden"),) if self.mtp_layers else ()
        return (("ssm", "ssm_grid"), ("conv", "conv_grid")) + hidden

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffer name -> (shape, dtype). The slot dimension is 1 for attention/linear buffers, 0 otherwise."""
        kv = (self.attn_layers, self.slots, self.max_seq, self.kv_heads, self.head_dim)
        ssm = (self.linear_layers, self.slots, self.v_heads, self.k_dim, self.v_dim)
        conv = (self.linear_layers, self.slots, self.conv_dim, self.conv_width)
        return {
            "kv_k": (kv, self.dtype),
            "kv_v": (kv, self.dtype),
            "ssm": (ssm, torch.float32),
            "conv": (conv, self.dtype),
            "ssm_grid": (ssm, torch.float32),
            "conv_grid": (conv, self.dtype),
            "pos": ((self.slots,), torch.int32),
            "last_hidden": ((self.slots, self.hidden), self.dtype),
            # the hidden state of the token before the grid point a prefill piece crossed (its logits), so
            # the checkpoint kept there needs no cut of the piece; meaningful only right after that piece
            "grid_hidden": ((self.slots, self.hidden), self.dtype),
            **self.tail_shapes(self.slots, self.tail_rows),
            **self.mtp_shapes(),
            **self.tail_seed_shapes(),
        }

    def rollback_names(self) -> list[str]:
        """The buffers a decode step may change as a whole for its slot: every buffer but the per-token
        ones (block_tensors: the KV and the MTP head's KV, whose rows past a position no step reads before it
        writes them) and the prefill-only ones (PREFILL_ONLY). A speculative step rolls these back to its last
        accepted token; a buffer added to the layout is in it unless it is one of those."""
        return [n for n in self.shapes() if n not in PREFILL_ONLY and n not in self.block_tensors]

    def mtp_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The MTP head's KV (module doc), none without a head. One row more than the model's KV: the head's
        kernels see it from row 1 on, and a padded piece may write one row further."""
        if not self.mtp_layers:
            return {}
        kv = (self.mtp_layers, self.slots, self.max_seq + 1, self.kv_heads, self.head_dim)
        return {"mtp_k": (kv, self.dtype), "mtp_v": (kv, self.dtype)}

    def tail_seed_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The hidden state before the end of each slot's kept tail (module doc): a model with an MTP head that
        keeps tails has it. A capsule holds it only where decoded tokens follow its tail (else its tail ends
        where the capsule does, and the seed there is its last_hidden)."""
        if not (self.mtp_layers and self.tail_rows):
            return {}
        return {"tail_hidden": ((self.slots, self.hidden), self.dtype)}

    def tail_shapes(self, slots: int, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The exact-replay buffers (module doc) for `slots` slots of `rows` rows: conv inputs, and b | a;
        none for rows = 0. A capsule holds them with one slot, squeezed, and the rows of its tail."""
        if not rows:
            return {}
        tail = (self.linear_layers, slots, rows)
        return {"tail_in": (tail + (self.conv_dim,), self.dtype), "tail_gates": (tail + (2 * self.v_heads,), self.dtype)}


class StateSet:
    """Owner of the live-state buffers. Nothing else allocates session state."""

    def __init__(self, layout: StateLayout):
        self.layout = layout
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.zeros(shape, dtype=dtype, device=layout.device)
            for name, (shape, dtype) in layout.shapes().items()
        }
        # each slot's part of every buffer, made once: a crowd's restore names a dozen of them per capsule, and
        # making the views was a sixth of its host time
        self._slot_parts = [{name: t[:, slot] if t.dim() >= 4 else t[slot] for name, t in self.buffers.items()}
                            for slot in range(layout.slots)]

    def __getattr__(self, name: str) -> torch.Tensor:
        buffers = self.__dict__.get("buffers")
        if buffers is not None and name in buffers:
            return buffers[name]
        raise AttributeError(name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def data_ptrs(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.buffers.items()}

    def slot_view(self, name: str, slot: int) -> torch.Tensor:
        """The part of buffer `name` that belongs to one slot (a view, no copy): [:, slot] of a buffer of four or
        more dimensions ([layers, slots, ...]), [slot] of the others. The same view object every call: callers
        write through it and never change its shape or strides."""
        return self._slot_parts[slot][name]

    def save_grid(self, slot: int) -> None:
        """The slot's live recurrent/conv state (and, with an MTP head, its seed) becomes its grid checkpoint."""
        self.ssm_grid[:, slot].copy_(self.ssm[:, slot])
        self.conv_grid[:, slot].copy_(self.conv[:, slot])
        if self.layout.mtp_layers:
            self.grid_hidden[slot].copy_(self.last_hidden[slot])

    def load_grid(self, slot: int, seed: bool = True) -> None:
        """Rewind the slot's live recurrent/conv state to its grid checkpoint and, with an MTP head and `seed`,
        its seed (last_hidden) too: a re-run from the grid point starts the head's rows with it. seed=False
        for a re-run whose full-model rows start past the grid point (the linear layers replay the tail)."""
        self.ssm[:, slot].copy_(self.ssm_grid[:, slot])
        self.conv[:, slot].copy_(self.conv_grid[:, slot])
        if self.layout.mtp_layers and seed:
            self.last_hidden[slot].copy_(self.grid_hidden[slot])

    def load_tail_seed(self, slot: int) -> None:
        """The slot's MTP seed (last_hidden) back to the end of its kept tail, for a re-run from there of the
        tokens decoded since; nothing without a head (no seed) or without tails."""
        if self.keeps_tail_seed:
            self.last_hidden[slot].copy_(self.tail_hidden[slot])

    @property
    def keeps_tail_seed(self) -> bool:
        """Whether a re-run from the end of a slot's kept tail can seed an MTP head there (load_tail_seed)."""
        return "tail_hidden" in self.buffers
