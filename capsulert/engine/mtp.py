"""The multi-token-prediction (MTP) head of Qwen3.5 (dense and MoE), and its rows of every forward.

Architecture (Qwen3-Next / Qwen3.5 MTP; transformers has no MTP module: read from vLLM's
Qwen3.5 and Qwen3-Next MTP models (qwen3_5_mtp, qwen3_next_mtp) and LightLLM's qwen3next_mtp, which agree
on it). For the hidden state h_i of position i (the main model's, after its final norm: what its LM head
reads) and the next token x_{i+1}:

    e = pre_fc_norm_embedding(embed(x_{i+1}))        the model's embedding, shared
    g = pre_fc_norm_hidden(h_i)
    y = fc([e | g])                                  [2h] -> [h]
    y = decoder layer (full attention at position i, its own KV cache; MoE MLP on an MoE model)
    m_i = norm(y)                                    lm_head(m_i): the head's guess of x_{i+2}

Every norm is the model's zero-centred (1 + w) RMSNorm. Chained drafting (the method's K = 3) feeds m_i back
as the next step's hidden state with its greedy token, at position i + 1.

State (engine/state.py). The head's entry for position i needs x_{i+1}, so it is written when that token is
run: a prefill piece of tokens [a, b) writes the entries of positions a - 1 .. b - 2 (a slot's first piece
has no entry before its first token), from the hidden state before the piece (the seed: `last_hidden`) and
the piece's own hidden states; a decode step of token x_P writes the entry of P - 1 from the seed before the
step. The cache keeps the entry of position i in row i + 1 (`mtp_k`, `mtp_v`: the row of the token it embeds),
so rows [0, G) hold what tokens[:G] determine and are cut into prefix blocks with the model's KV; the head's
kernels see the cache from row 1 on. The head's rows use the model's kernels and its row discipline (the
same GEMM rows, tiled prefill attention by absolute position, per-row decode on the CPU, padded decode rows
on CUDA), so a prefill row gets the same bits in any piece and a decode row in any batch.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from capsulert.config.model import FULL
from capsulert.engine.loader import MTP_PREFIX
from capsulert.engine.model import HybridModel, Layer, layer_gemm_weights, pad_rows
from capsulert.engine.packing import pack_layer
from capsulert.engine.state import StateSet
from capsulert.errors import InvalidRequestError

# the longest chain one mtp_draft call runs (the method uses 3): its scratch rows stay inside the KV's slack
MAX_DRAFT_TOKENS = 16


class MtpHead:
    """The head's weights and its rows of a forward, on the model it belongs to (HybridModel.attach_mtp)."""

    def __init__(self, model: HybridModel, weights: dict[str, torch.Tensor]):
        self.model = model
        p = MTP_PREFIX
        self.fc = weights[p + "fc.weight"]
        self.norm_embedding = weights[p + "pre_fc_norm_embedding.weight"]
        self.norm_hidden = weights[p + "pre_fc_norm_hidden.weight"]
        self.norm = weights[p + "norm.weight"]
        prefix = p + "layers.0."
        w = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        if model.kernels.packed_projections:
            pack_layer(weights, prefix, w)
        self.layer = Layer(model.cfg.num_hidden_layers, FULL, 0, w)

    def gemm_weights(self) -> list[torch.Tensor]:
        return [self.fc] + layer_gemm_weights(self.layer)

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The main model's hidden states through its final norm: what its LM head reads, and the head takes."""
        return self.model.kernels.add_rms_norm(hidden, None, self.model.norm, self.model.cfg.rms_norm_eps)[1]

    def rows(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
             start: torch.Tensor, kv_len: int, decode: bool, lin: Callable = F.linear) -> torch.Tensor:
        """The head on tokens [R, T] and normed hidden states [R, T, H] at positions start[b] + t (start [R]),
        its KV written at those rows of its cache (seen from row 1 on); R >= B = len(slots) rows, the rest
        padding. Returns m [R, T, H] (after the head's norm)."""
        m, eps, add_rms_norm = self.model, self.model.cfg.rms_norm_eps, self.model.kernels.add_rms_norm
        w = self.layer.w
        e = add_rms_norm(m.embed[tokens], None, self.norm_embedding, eps)[1]
        g = add_rms_norm(hidden, None, self.norm_hidden, eps)[1]
        h, x = add_rms_norm(lin(torch.cat([e, g], dim=-1), self.fc), None, w["input_layernorm.weight"], eps)
        rope = m.rope(start[:, None] + torch.arange(tokens.shape[1], device=tokens.device))
        kv = (state.mtp_k[0][:, 1:], state.mtp_v[0][:, 1:])
        B = slots.shape[0]
        x = m.attend(self.layer, x, state, slots, start[:B], kv_len, rope, decode, kv, lin)
        h, x = add_rms_norm(h, x, w["post_attention_layernorm.weight"], eps)
        return add_rms_norm(h, m.mlp(w, x, B, lin), self.norm, eps)[1]

    # ------------------------------------------------------------------ the model's forward calls these
    def piece(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor, seed: torch.Tensor,
              start: torch.Tensor, kv_len: int) -> None:
        """A prefill piece's rows: tokens [B, T] at start [B] with the main model's hidden states h [B, T, H]
        (pre-norm) and the seed [B, H] before the piece. Row t is the entry of position start + t - 1 (token
        t, hidden t - 1); a slot's first piece (start 0) has none before its first token, so its rows start
        one later (its last row is padding). Rows past a piece's real tokens write cache rows past the slot's
        length, which nothing reads."""
        B, T, H = h.shape
        first = (start == 0).long()
        at = torch.arange(T, device=h.device)[None, :] + first[:, None]  # [B, T] into [seed | h]
        hidden = torch.cat([seed[:, None], h], dim=1).gather(1, at[..., None].expand(B, T, H))
        toks = torch.cat([tokens, tokens[:, -1:]], dim=1).gather(1, at)
        self.rows(state, slots, toks, self._normed(hidden), start - 1 + first, kv_len, decode=False)

    def step(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
             kv_len: int) -> torch.Tensor:
        """A decode step's rows: the entry of position start - 1 from the seed (last_hidden) and the token
        tokens [B, 1] being fed; on CUDA the dense ops on the model's decode_rows rows. Returns m [R, 1, H]."""
        return self.seeded_step(state, slots, tokens, start, state.last_hidden[slots], kv_len)

    def seeded_step(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
                    seed: torch.Tensor, kv_len: int, lin: Callable = F.linear) -> torch.Tensor:
        """`step` from the given seeds [B, H] (a verify forward's rows: a slot's row t > 0 is seeded by the
        hidden state of its row t - 1, what decode would have stored in last_hidden)."""
        R = self.model.decode_rows or slots.shape[0]
        hidden = self._normed(pad_rows(seed, R))[:, None]
        # a captured graph's scratch slot may stand at 0: its padding row reads position 0, never -1
        return self.rows(state, slots, pad_rows(tokens, R), hidden, pad_rows((start - 1).clamp(min=0), R), kv_len,
                         decode=True, lin=lin)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def draft(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, k: int, kv_len: int) -> torch.Tensor:
        """k greedy guesses [B, k] past `tokens` [B] (each slot's next token, not yet fed): `chain`'s tokens."""
        return self.chain(state, slots, tokens, k, kv_len)[0]

    @torch.inference_mode()
    def chain(self, state: StateSet, slots: torch.Tensor, tokens: torch.Tensor, k: int,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head run k times chained past `tokens` [B]: step j feeds the previous step's output and greedy
        token at position P - 1 + j (P: the slot's length). Returns the greedy tokens [B, k] and their logits
        [B, k, vocab] (fp32). Writes only the head's cache rows P .. P + k - 1, past what the slot holds.
        Batch-invariant as a decode step is (per row on the CPU, padded rows on CUDA)."""
        m = self.model
        B = slots.shape[0]
        if m.rowwise and B > 1:
            rows = [self.chain(state, slots[i:i + 1], tokens[i:i + 1], k, kv_len) for i in range(B)]
            return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        R = m.decode_rows or B
        start = state.pos[slots].long() - 1
        hidden = self._normed(pad_rows(state.last_hidden[slots], R))
        tok = tokens.long()
        drafts, logits = [], []
        for j in range(k):
            y = self.rows(state, slots, pad_rows(tok[:, None], R), hidden[:, None], pad_rows(start + j, R), kv_len,
                          decode=True)[:, 0]
            logits.append(F.linear(y, m.lm_head).float()[:B])
            tok = logits[-1].argmax(-1)
            drafts.append(tok)
            hidden = y
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)

def check_draft(k: int, lengths: list[int]) -> None:
    """InvalidRequestError unless 1 <= k <= MAX_DRAFT_TOKENS and every slot holds tokens (its seed)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequestError(f"mtp_draft takes 1 <= k <= {MAX_DRAFT_TOKENS} draft tokens, got {k!r:.40}")
    if any(n < 1 for n in lengths):
        raise InvalidRequestError("mtp_draft needs slots that hold tokens: an empty slot has no hidden state to "
                                  "draft from; append a prompt first")
