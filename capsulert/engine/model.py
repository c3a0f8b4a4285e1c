"""Qwen3.5 hybrid text model (Gated DeltaNet + gated full attention) running on a StateSet; its MLPs are dense
or, for a Qwen3.5-MoE config, mixtures of experts (engine/moe.py).

Functional: weights are plain tensors, every piece of session state lives in the StateSet and is
updated in place. One forward handles B slots x T tokens: prefill (B = 1, T <= prefill_chunk, chunked
gated delta rule) or decode (T = 1, recurrent step). Positions are read from `state.pos` on the device.

Batch invariance of decode: a session's logits must not depend on the batch it runs in. GEMM kernels and
reductions pick their algorithm (tiling, split-K, split reductions) from the number of rows, so a row's bits
change with the batch size (measured on the H200: 4096x4096 projections from 25 rows on, the down projection
from 9, RMSNorm's reduction at 2-8 rows vs 1 or 64). Three ways out:
- `decode_rows=None` (CUDA, when the engine's start-up check passes): every op runs on the step's own rows.
  Our kernels are per-row; the GEMMs keep a row's bits at any row count under the engine's cuBLASLt settings
  on the H200, for every weight shape of the 9B and 35B-A3B models, and Engine checks that for this model's
  shapes at 1..64 rows before it relies on it (numerics.first_row_variant_gemm).
- `decode_rows=R` (CUDA, where that check fails): every dense op of a decode step (norms, projections, gates,
  the LM head) runs on exactly R rows, the batch padded with zero rows; only the ops that touch per-slot state
  (conv, recurrent step, KV write, attention) run on the real rows, and those are per-row kernels. A batch-1
  step then pays for 64 rows: ~0.4 ms on the H200 (bench/RESULTS.md).
- `rowwise=True` (CPU): a decode step (and the logits) runs each row through the model alone, so a row's
  result equals its solo result by construction. CPU kernels are batch-variant in many places: GEMMs at
  M = 1 use gemv; vectorised transcendental ops (softplus, exp, sigmoid) compute an element in the vector
  body or in the scalar tail depending on the tensor's size, with different bits; reductions over a
  non-innermost dim change order with the other rows' contents.
decode_rows=None with rowwise=False on a device whose GEMMs do not pass that check is the plain batch-dependent
path; the engine never runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from capsulert.config.model import FULL, ModelConfig
from capsulert.kernels.moe import AddNorm
from capsulert.kernels.ops import KernelSet, reference_kernels
from capsulert.engine.moe import moe_mlp
from capsulert.engine.moe_weights import MOE_KERNEL_WEIGHTS
from capsulert.engine.numerics import row_linear
from capsulert.engine.packing import PACKS, pack_layer, split_sizes
from capsulert.engine.state import StateSet
from capsulert.engine.tail_replay import keep_tail, new_rows, with_tail
from capsulert.engine.verify_rows import VerifyRows


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended along dim 0 up to `rows`."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


class KeptStates(Protocol):
    """Where a verify forward keeps each speculating slot's state after its positions (engine/rollback.py)."""

    def keep_layer(self, layer: int, position: int, sets: torch.Tensor, slots: torch.Tensor) -> None: ...

    def keep_rows(self, position: int, sets: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> None: ...


class MtpRows(Protocol):
    """The MTP head's part of a forward (engine/mtp.py: MtpHead), run by HybridModel.forward on the same slots:
    its KV rows are session state like the model's, so every prefill piece and decode step keeps them."""

    def piece(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, seed: torch.Tensor,
              start: torch.Tensor, kv_len: int) -> None: ...

    def step(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
             kv_len: int) -> torch.Tensor: ...

    def seeded_step(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
                    seed: torch.Tensor, kv_len: int, lin: Callable = F.linear) -> torch.Tensor: ...

    def gemm_weights(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Layer:
    index: int
    kind: str  # "linear_attention" or "full_attention"
    state_index: int  # index into the linear-layer or attention-layer buffers
    w: dict[str, torch.Tensor]


def layer_gemm_weights(layer: Layer) -> list[torch.Tensor]:
    """The weights a layer multiplies by through F.linear: its packed projections (not the named views into
    them) and the others, but the conv and what the MoE kernels read themselves."""
    skip = {n for pack, names in PACKS.items() if pack in layer.w for n in names} | set(MOE_KERNEL_WEIGHTS)
    return [t for n, t in layer.w.items() if t.dim() == 2 and n not in skip and n != "conv"]


class HybridModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelSet | None = None,
                 decode_rows: int | None = None, rowwise: bool = False):
        self.cfg = cfg
        self.decode_rows = decode_rows  # pad every dense op of a decode step to this many rows
        self.rowwise = rowwise  # run each decode row through the model alone
        self.kernels = kernels or reference_kernels()
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        attn_idx = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        lin_idx = {layer: i for i, layer in enumerate(cfg.linear_layers)}
        self.layers: list[Layer] = []
        for i, kind in enumerate(cfg.layer_types):
            prefix = f"model.layers.{i}."
            w = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            if kind != FULL:
                w["conv"] = w["linear_attn.conv1d.weight"][:, 0, :]
                w["neg_A"] = -w["linear_attn.A_log"].float().exp()
            if self.kernels.packed_projections:
                pack_layer(weights, prefix, w)
            state_index = attn_idx[i] if kind == FULL else lin_idx[i]
            self.layers.append(Layer(i, kind, state_index, w))
        self.mtp: MtpRows | None = None  # the MTP head's rows of each forward (attach_mtp)
        rot = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=self.device) / rot))

    def attach_mtp(self, head: MtpRows) -> None:
        """Run the MTP head's rows in every forward from now on (the runner attaches it at start)."""
        self.mtp = head

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., rotary_dim] in the model dtype for integer positions [...]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def gemm_weights(self) -> list[torch.Tensor]:
        """Every weight a forward multiplies by through F.linear: the LM head and each layer's projections (the
        packed ones, not the named views into them; an MoE MLP's router and experts run in the MoE kernels),
        the MTP head's included."""
        out = [self.lm_head]
        for layer in self.layers:
            out += layer_gemm_weights(layer)
        return out + (self.mtp.gemm_weights() if self.mtp is not None else [])

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def refresh_derived(self) -> None:
        """Recompute, in place, what __init__ derived from the weights (after the weights changed)."""
        for layer in self.layers:
            if layer.kind != FULL:
                layer.w["neg_A"].copy_(-layer.w["linear_attn.A_log"].float().exp())

    @torch.inference_mode()
    def forward(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, kv_len: int,
                valid: torch.Tensor | None = None, decode: bool = False,
                grid_at: int | torch.Tensor | None = None, replay: int | torch.Tensor | None = None,
                tail_from: int | torch.Tensor | None = None) -> None:
        """Run tokens [B, T] for slots [B] at positions state.pos[slots] + t; updates every state buffer
        of those slots in place, stores the last token's hidden state in last_hidden and advances pos.

        decode=True: one token per slot (T = 1) through the recurrent step, batch-invariant (module doc).
        `valid` [B] (device) marks only the first valid[b] tokens of a row as real: the rest is padding
        that a captured graph of a fixed T carries; it neither writes state nor advances pos.

        `grid_at` (prefill, an int or a [B] device tensor for a graph): the piece crosses a grid point that many
        tokens in; the recurrent and conv state there become the slots' grid checkpoints (ssm_grid, conv_grid)
        and the hidden state before it goes to grid_hidden, so a piece past its last grid point needs no cut
        there (and no second pass of the weights).

        `replay` (prefill; an int, or [B] for a graph): the linear-attention layers run that many rows of the
        slots' tail buffers before the new tokens, from the recurrent and conv state at the grid point those
        rows start at (engine/tail_replay.py); `grid_at` still counts from the first new token.
        `tail_from` (prefill): from that row of a linear-attention layer's piece (tail rows included) on, its
        conv inputs and gate projections become the slots' tail buffers."""
        B = tokens.shape[0]
        if decode and self.rowwise and B > 1:
            for i in range(B):
                self.forward(state, slots[i:i + 1], tokens[i:i + 1], kv_len, decode=True)
            return
        start = state.pos[slots].long()
        if decode and self.mtp is not None:  # the head's row of the token before this one: reads the seed first
            self.mtp.step(state, slots, tokens, start, kv_len)
        if decode and self.decode_rows is not None:
            if B > self.decode_rows:
                raise ValueError(f"a decode step holds at most {self.decode_rows} rows, got {B}")
            tokens = pad_rows(tokens, self.decode_rows)
            rope_start = pad_rows(start, self.decode_rows)
        else:
            rope_start = start
        rope = self.rope(rope_start[:, None] + torch.arange(tokens.shape[1], device=self.device))
        # the linear-attention layers' piece starts `replay` rows early, with the tail's rows
        lin_valid, lin_grid_at = valid, grid_at
        if replay is not None:
            lin_valid = replay + (valid if valid is not None else torch.full_like(slots, tokens.shape[1]))
            if isinstance(grid_at, torch.Tensor):  # a row that crosses none (0) keeps the state its layers start at
                lin_grid_at = grid_at + replay * (grid_at > 0)
            elif grid_at is not None:
                lin_grid_at = grid_at + replay

        def mix(layer: Layer, x: torch.Tensor) -> torch.Tensor:
            if layer.kind == FULL:
                return self.attend(layer, x, state, slots, start, kv_len, rope, decode)
            return self._gated_delta_net(layer, x, state, slots, decode, lin_valid, lin_grid_at, replay, tail_from)

        h = self.layer_stack(self.embed[tokens], B, mix)
        seed = state.last_hidden[slots]  # the hidden state before the piece (a copy: overwritten below)
        if grid_at is not None:  # the hidden state before the grid point: the logits a checkpoint there gives
            if isinstance(grid_at, int):
                before = h[:, grid_at - 1]
            else:  # a row whose grid point is where it starts (0) keeps its own checkpoint's hidden state
                kept = state.grid_hidden[slots]
                before = torch.cat([kept[:, None], h], dim=1)[torch.arange(B, device=self.device), grid_at]
            state.grid_hidden.index_copy_(0, slots, before)
        if self.mtp is not None and not decode:
            self.mtp.piece(state, slots, tokens, h, seed, start, kv_len)
        last = h[:, -1] if valid is None else h[torch.arange(h.shape[0], device=self.device), valid - 1]
        state.last_hidden.index_copy_(0, slots, last)
        if tail_from is not None and state.keeps_tail_seed:  # the seed where the kept tail ends
            state.tail_hidden.index_copy_(0, slots, last)
        state.pos.index_add_(0, slots, torch.full_like(slots, tokens.shape[1], dtype=torch.int32) if valid is None
                             else valid.to(torch.int32))

    @torch.inference_mode()
    def step_with_pieces(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, piece_slots: torch.Tensor,
                         pieces: torch.Tensor, kv_len: int) -> None:
        """A decode step of `slots` (tokens [B]) and prefill pieces [P, T] of `piece_slots` in one forward: what
        `forward(decode=True)` does to the first and `forward` to the second (whole pieces from each slot's
        position: no padding, grid point, replayed or kept tail), in one pass of the weights. Every GEMM, norm
        and MLP runs once over the B + P * T rows, which needs each row's bits to be the same at any row count:
        GEMM rows count-invariant and per-row kernels (decode_rows None, not rowwise; the engine checks the
        GEMMs). Attention, the conv and the gated delta rule run per part, decode's kernels on the step's rows
        and the prefill kernels on the pieces, so every row is bitwise what its own forward computes."""
        if self.rowwise or self.decode_rows is not None:
            raise ValueError("a decode step shares a forward with prefill pieces only where every row keeps its "
                             "bits at any row count (decode_rows None, not rowwise)")
        B, (P, T) = slots.shape[0], pieces.shape
        start, piece_start = state.pos[slots].long(), state.pos[piece_slots].long()
        if self.mtp is not None:  # the step's head rows read their seeds before the layers move last_hidden
            self.mtp.step(state, slots, tokens[:, None], start, kv_len)
        rope = self.rope(start[:, None])
        piece_rope = self.rope(piece_start[:, None] + torch.arange(T, device=self.device))

        def mix(layer: Layer, x: torch.Tensor) -> torch.Tensor:  # x [B + P * T, 1, H]: the step's rows first
            w = layer.w
            if layer.kind == FULL:
                q_gate, k, v = self._project(w, "attn_in", x)
                o = self._attention(layer, q_gate[:B], k[:B], v[:B], state, slots, start, kv_len, rope, True)
                o_p = self._attention(layer, *(t[B:].view(P, T, -1) for t in (q_gate, k, v)), state, piece_slots,
                                      piece_start, kv_len, piece_rope, False)
                return F.linear(torch.cat([o.reshape(B, 1, -1), o_p.reshape(P * T, 1, -1)]),
                                w["self_attn.o_proj.weight"])
            mixed, z, b, a = self._project(w, "gdn_in", x)
            y = self._gated_delta_step(layer, mixed[:B], z[:B], b[:B], a[:B], state, slots)
            y_p = self._gated_delta_piece(layer, *(t[B:].view(P, T, -1) for t in (mixed, z, b, a)), state,
                                          piece_slots, None)
            return F.linear(torch.cat([y, y_p.reshape(P * T, 1, -1)]), w["linear_attn.out_proj.weight"])

        ids = torch.cat([tokens, pieces.reshape(-1)])
        h = self.layer_stack(self.embed[ids][:, None], ids.shape[0], mix)[:, 0]
        h_p = h[B:].view(P, T, -1)
        if self.mtp is not None:
            self.mtp.piece(state, piece_slots, pieces, h_p, state.last_hidden[piece_slots], piece_start, kv_len)
        state.last_hidden.index_copy_(0, torch.cat([slots, piece_slots]), torch.cat([h[:B], h_p[:, -1]]))
        state.pos.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        state.pos.index_add_(0, piece_slots, torch.full_like(piece_slots, T, dtype=torch.int32))

    @torch.inference_mode()
    def verify(self, state: StateSet, rows: VerifyRows, kv_len: int, keep: KeptStates | None = None) -> torch.Tensor:
        """A speculative verify step in one forward: every row of `rows` (engine/verify_rows.py) is the decode
        row of its slot at its position, with decode's numerics, so its logits and the state it leaves are
        bitwise those of decode steps fed the same tokens one by one. Dense ops run on all rows (batch
        invariance: padded to decode_rows as decode pads, or each row alone on the CPU through row_linear);
        attention writes every row's KV at its own position first and then reads [0, its position] (a slot's
        rows may repeat its id: each writes a distinct row, and every read follows the launch that wrote);
        the conv and recurrent steps run wave by wave. `keep` gets each slot's state after every wave but its
        last (RollbackStates). Returns the logits [R (decode_rows when padded), vocab] of every row."""
        R = rows.rows
        width = self.decode_rows or R
        if R > width:
            raise ValueError(f"a verify step holds at most {width} rows, got {R}")
        lin = row_linear if self.rowwise else F.linear
        start = state.pos[rows.row_slots].long() + rows.offsets
        seed = state.last_hidden[rows.row_slots]  # a copy: the MTP head's seed of each slot's first row
        rope = self.rope(pad_rows(start, width)[:, None])

        def mix(layer: Layer, x: torch.Tensor) -> torch.Tensor:
            if layer.kind == FULL:
                return self.attend(layer, x, state, rows.row_slots, start, kv_len, rope, True, lin=lin)
            return self._gated_delta_waves(layer, x, state, rows, keep, lin)

        h = self.layer_stack(self.embed[pad_rows(rows.tokens, width)[:, None]], R, mix, lin)[:, 0]
        if self.mtp is not None:  # the seed of a slot's row t > 0 is the hidden state its row t - 1 just left
            seed = torch.where((rows.offsets == 0)[:, None], seed, h[rows.prev_rows])
            self.mtp.seeded_step(state, rows.row_slots, rows.tokens[:, None], start, seed, kv_len, lin)
        if keep is not None:
            for t, kept in enumerate(rows.keeps):
                if kept is not None:
                    keep.keep_rows(t, kept[1], h[kept[0]], start[kept[0]] + 1)
        state.last_hidden.index_copy_(0, rows.slots, h[rows.last_rows])
        state.pos.index_add_(0, rows.slots, rows.counts)
        return self.hidden_logits(h, lin)

    def layer_stack(self, h: torch.Tensor, real_rows: int, mix: Callable[[Layer, torch.Tensor], torch.Tensor],
                    lin: Callable = F.linear) -> torch.Tensor:
        """The layers on the embedded rows h [R, T, H]: each layer's norm, its mixer (`mix`: attention or the
        gated delta net, which own the state), its MLP; rows from real_rows on are padding. Returns the real
        rows' hidden states [real_rows, T, H] before the final norm. `lin`: the GEMM (F.linear, or row_linear
        where each row must be computed alone)."""
        eps = self.cfg.rms_norm_eps
        add_rms_norm = self.kernels.add_rms_norm
        delta = None  # the previous block's output, added to the residual stream by the next norm
        normed = None  # or (h, x): an MoE block added its output to h and ran this layer's input norm itself
        for i, layer in enumerate(self.layers):
            w = layer.w
            h, x = normed if normed is not None else add_rms_norm(h, delta, w["input_layernorm.weight"], eps)
            x = mix(layer, x)
            h, x = add_rms_norm(h, x, w["post_attention_layernorm.weight"], eps)
            if self.cfg.is_moe and i + 1 < len(self.layers):  # the expert stage adds and norms in its last launch
                next_norm = AddNorm(h, self.layers[i + 1].w["input_layernorm.weight"], eps)
                delta, normed = None, self.moe(w, x, real_rows, lin, next_norm)
            else:
                delta, normed = self.mlp(w, x, real_rows, lin), None
        return (h + delta)[:real_rows]

    def logits(self, state: StateSet, slots: torch.Tensor) -> torch.Tensor:
        """Next-token logits (fp32) from the slots' last hidden state: [decode_rows, vocab] with the real rows
        first when decode_rows is set, else [B, vocab]. Always the batch-invariant path, so the logits after an
        append and those of a decode step are computed alike."""
        if self.rowwise and slots.shape[0] > 1:
            return torch.cat([self.logits(state, slots[i:i + 1]) for i in range(slots.shape[0])])
        return self.hidden_logits(state.last_hidden[slots])

    def hidden_logits(self, h: torch.Tensor, lin: Callable = F.linear) -> torch.Tensor:
        """Logits (fp32) of hidden states h [B, H] (before the final norm) on decode's path: padded to
        decode_rows when set."""
        if self.decode_rows is not None:
            h = pad_rows(h, self.decode_rows)
        h = self.kernels.add_rms_norm(h, None, self.norm, self.cfg.rms_norm_eps)[1]
        return lin(h, self.lm_head).float()

    # ------------------------------------------------------------------ mixers
    def attend(self, layer, x, state, slots, start, kv_len, rope, decode: bool, kv=None, lin: Callable = F.linear):
        """A full-attention layer's mixer on x [R, T, H]: KV rows written at start[b] + t of the layer's cache
        (`kv`: (k, v) cache tensors [slots, rows, kv_heads, head_dim] instead, the MTP head's)."""
        R, T, _ = x.shape  # R rows: B real ones first, then (decode on CUDA) zero padding
        q_gate, k, v = self._project(layer.w, "attn_in", x, lin)
        o = self._attention(layer, q_gate, k, v, state, slots, start, kv_len, rope, decode, kv)
        return lin(pad_rows(o, R).reshape(R, T, -1), layer.w["self_attn.o_proj.weight"])

    def _attention(self, layer, q_gate, k, v, state, slots, start, kv_len, rope, decode: bool, kv=None):
        """Attention between a full-attention layer's projections ([R, T, .]) and its out projection: the real
        rows' q and k normed and rotated, their K and V written to the cache, their gated output [B, T, ...]."""
        cfg, w = self.cfg, layer.w
        R, T = q_gate.shape[:2]
        B = slots.shape[0]
        D = cfg.head_dim
        q, gate = q_gate.view(R, T, -1, 2 * D).chunk(2, dim=-1)
        cos, sin = rope
        kv_k, kv_v = kv if kv is not None else (state.kv_k[layer.state_index], state.kv_v[layer.state_index])
        # the real rows only: q, k through their norms and the rotary embedding, k and v into the cache
        q = self.kernels.attention_prep(q[:B], w["self_attn.q_norm.weight"], k.view(R, T, -1, D)[:B],
                                        w["self_attn.k_norm.weight"], v.view(R, T, -1, D)[:B], cos[:B], sin[:B],
                                        cfg.rotary_dim, cfg.rms_norm_eps, kv_k, kv_v, slots, start)
        attend = self.kernels.attention if decode else self.kernels.prefill_attention
        return attend(q, kv_k, kv_v, slots, start, kv_len, D**-0.5, gate[:B])  # gated: o * sigmoid(gate)

    def _gated_delta_net(self, layer, x, state, slots, decode: bool, valid, grid_at=None, replay=None,
                         tail_from=None):
        """`valid` and `grid_at` count in the layer's piece: from the first replayed tail row on. x [R, T, H]: B
        real rows first, then (decode on CUDA) zero padding."""
        mixed, z, b, a = self._project(layer.w, "gdn_in", x)
        if decode:
            y = self._gated_delta_step(layer, mixed, z, b, a, state, slots)
        else:
            y = self._gated_delta_piece(layer, mixed, z, b, a, state, slots, valid, grid_at, replay, tail_from)
        return F.linear(y, layer.w["linear_attn.out_proj.weight"])

    def _gated_delta_step(self, layer, mixed, z, b, a, state, slots) -> torch.Tensor:
        """A decode step of the gated delta net between its projections ([R, 1, .]) and its out projection: the
        conv, gates, q/k norms and the recurrent step on the real rows only; the gated norm's rows [R, 1, .]."""
        cfg, w = self.cfg, layer.w
        R, B = z.shape[0], slots.shape[0]
        Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        li = layer.state_index
        mixed = self.kernels.conv_step(mixed[:B, 0], state.conv[li], slots, w["conv"])
        o = self.kernels.gated_delta_step_fused(mixed, a[:B, 0], b[:B, 0], w["neg_A"], w["linear_attn.dt_bias"],
                                                state.ssm[li], slots, Hk, Dk, Dv)
        return self._gated_norm(w, pad_rows(o, R)[:, None], z.view(R, 1, Hv, Dv))

    def _gated_delta_piece(self, layer, mixed, z, b, a, state, slots, valid, grid_at=None, replay=None,
                           tail_from=None) -> torch.Tensor:
        """A prefill piece of the gated delta net between its projections ([B, T, .]) and its out projection
        (the chunked rule); the gated norm's rows [B, T, .]."""
        cfg, w = self.cfg, layer.w
        R, T = z.shape[:2]
        Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        li = layer.state_index
        conv_buf, ssm_buf = state.conv[li], state.ssm[li]
        if replay is not None or tail_from is not None:
            gates = torch.cat([b, a], dim=-1)
            if replay is not None:  # the tail's rows first: the piece this layer runs starts at the grid point
                mixed = with_tail(state.tail_in[li].index_select(0, slots), mixed, replay)
                gates = with_tail(state.tail_gates[li].index_select(0, slots), gates, replay)
            if tail_from is not None:
                keep_tail(state.tail_in[li], slots, mixed, tail_from)
                keep_tail(state.tail_gates[li], slots, gates, tail_from)
            b, a = gates.split(Hv, dim=-1)
        # a grid point inside the piece: the conv and recurrent state there become the slot's grid checkpoint,
        # kept by the same passes that run the piece
        conv_grid = None if grid_at is None else (state.conv_grid[li], grid_at)
        mixed = self.kernels.conv_prefill(mixed, conv_buf, slots, w["conv"], valid, conv_grid)
        # padding tokens (from valid[r] on) neither decay nor write the state
        qkvgb = self.kernels.gated_delta_prefill_prep(mixed, a, b, w["neg_A"], w["linear_attn.dt_bias"], valid,
                                                      Hk, Dk, Dv)
        ssm_grid = None if grid_at is None else (state.ssm_grid[li], grid_at)
        o = self.kernels.gated_delta_prefill(*qkvgb, ssm_buf, slots, ssm_grid)
        if replay is not None:
            o = new_rows(o, replay, T)
        return self._gated_norm(w, o, z.view(R, T, Hv, Dv))

    def _gated_delta_waves(self, layer: Layer, x: torch.Tensor, state: StateSet, rows: VerifyRows,
                           keep: KeptStates | None, lin: Callable) -> torch.Tensor:
        """The gated delta net of a verify forward (verify): projections on all rows, the conv and recurrent
        steps wave by wave as decode steps (on the CPU row by row, as its decode steps run), the slots' state
        after each wave kept where `rows` says."""
        cfg, w = self.cfg, layer.w
        width = x.shape[0]
        Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed, z, b, a = self._project(w, "gdn_in", x, lin)
        li = layer.state_index
        conv_buf, ssm_buf = state.conv[li], state.ssm[li]
        o = torch.zeros(width, Hv, Dv, dtype=torch.float32, device=x.device)
        for t, wave in enumerate(rows.waves):
            for part in (wave.split(1) if self.rowwise else (wave,)):
                slots = rows.row_slots[part]
                m = self.kernels.conv_step(mixed[part, 0], conv_buf, slots, w["conv"])
                o[part] = self.kernels.gated_delta_step_fused(m, a[part, 0], b[part, 0], w["neg_A"],
                                                              w["linear_attn.dt_bias"], ssm_buf, slots, Hk, Dk, Dv)
            kept = rows.keeps[t]
            if keep is not None and kept is not None:
                keep.keep_layer(li, t, kept[1], rows.row_slots[kept[0]])
        return self._gated_delta_out(w, o[:, None], z.view(width, 1, Hv, Dv), lin)

    def _gated_delta_out(self, w: dict[str, torch.Tensor], o: torch.Tensor, z: torch.Tensor,
                         lin: Callable = F.linear) -> torch.Tensor:
        """The gated delta net's output from the rule's o [R, T, Hv, Dv]: its gated norm, its out projection."""
        return lin(self._gated_norm(w, o, z), w["linear_attn.out_proj.weight"])

    def _gated_norm(self, w: dict[str, torch.Tensor], o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm of the rule's o [R, T, Hv, Dv] by z: [R, T, Hv * Dv], the out projection's input."""
        R, T = o.shape[:2]
        return self.kernels.gated_rms_norm(o, z, w["linear_attn.norm.weight"], self.cfg.rms_norm_eps).reshape(R, T, -1)

    def _project(self, w: dict[str, torch.Tensor], pack: str, x: torch.Tensor,
                 lin: Callable = F.linear) -> list[torch.Tensor]:
        """The projections of group `pack` of x: one GEMM over the packed weight when packed, else one each."""
        if pack in w:
            sizes = split_sizes(w, pack)
            return list(lin(x, w[pack])[..., :sum(sizes)].split(sizes, dim=-1))
        return [lin(x, w[n]) for n in PACKS[pack]]

    def mlp(self, w: dict[str, torch.Tensor], x: torch.Tensor, real_rows: int,
            lin: Callable = F.linear) -> torch.Tensor:
        """The dense MLP, or the MoE block of an MoE model (engine/moe.py); rows from real_rows on are the
        padding of a fixed-shape decode step (the MoE routes only the real ones)."""
        if self.cfg.is_moe:
            return self.moe(w, x, real_rows, lin)
        if "mlp_in" in w:
            y = self.kernels.silu_mul(lin(x, w["mlp_in"]))
        else:
            gate, up = self._project(w, "mlp_in", x, lin)
            y = F.silu(gate) * up
        return lin(y, w["mlp.down_proj.weight"])

    def moe(self, w: dict[str, torch.Tensor], x: torch.Tensor, real_rows: int, lin: Callable = F.linear,
            add_norm: AddNorm | None = None):
        """The MoE block (engine/moe.py: moe_mlp); with lin = row_linear each row alone, as a decode step of one
        row computes it (the reference router's GEMM over several rows gives a row other bits on the CPU)."""
        if lin is not row_linear:
            return moe_mlp(self.cfg, self.kernels, w, x, real_rows, add_norm)
        rows = []
        for r in range(x.shape[0]):
            norm = None if add_norm is None else add_norm._replace(h=add_norm.h[r:r + 1])
            rows.append(moe_mlp(self.cfg, self.kernels, w, x[r:r + 1], 1, norm))
        if add_norm is None:
            return torch.cat(rows)
        return torch.cat([h for h, _ in rows]), torch.cat([y for _, y in rows])
