"""Next-token sampling for a whole decode batch at once, on the device.

Batch invariance: a row's token depends only on its own logits, its SamplingParams and its position in its
own random stream. The stream is counter based: the uniform a session draws for the token at sequence index
i is a hash of (seed, i), computed on the host in exact integer arithmetic. So a session samples the same
token alone or among 63 others, before or after a snapshot / restore, and generate(N) equals generate(k)
then generate(N - k). Rows are sampled by inverse CDF over the filtered distribution; the filters and the
CDF run over the whole [rows, vocab] block in one go (one host -> device transfer of the per-row parameters,
one device -> host transfer of the chosen tokens per step).

Logprobs are those of the raw model distribution (log_softmax of the logits, before temperature, top-k,
top-p and a constraint's token mask), as vLLM reports them by default: a constrained session's logprobs and
top_logprobs are the model's own, so a top alternative may be a token its grammar did not allow.

A constrained row (SamplingParams.constraint, engine/grammar.py) draws from its logits with every token
its grammar forbids at -inf: greedy takes the best allowed token, sampling draws among the allowed ones.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import GREEDY, SamplingParams

_MASK64 = (1 << 64) - 1


def resolve_seed(params: SamplingParams) -> int:
    """The seed a generate call uses for a session: the given one, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_uniform(seed: int, index: int) -> float:
    """Uniform in [0, 1) for token `index` of the stream `seed` (53 random bits)."""
    return (_splitmix64(_splitmix64(seed) ^ index) >> 11) / float(1 << 53)


@dataclass(frozen=True)
class RowDraw:
    """What one row needs to draw its token: its parameters, its seed and its token index."""
    params: SamplingParams
    seed: int
    index: int


@dataclass(frozen=True)
class Draws:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per row: (token, logprob) best first; empty unless asked


def sample_rows(logits: torch.Tensor, rows: Sequence[RowDraw], allowed: torch.Tensor | None = None) -> Draws:
    """Tokens for the first len(rows) rows of logits [R, vocab] (fp32; R >= len(rows), the extra rows are
    padding that keeps every op at one shape). `allowed`: a boolean [R, vocab] block, False where a row's
    constraint forbids a token (None: no row is constrained). One device -> host transfer."""
    n, R = len(rows), logits.shape[0]
    if n > R:
        raise InvalidRequestError(f"{n} rows to sample but only {R} rows of logits")
    greedy = all(r.params.greedy for r in rows)
    logprobs_all = torch.log_softmax(logits, dim=-1)  # the raw model's, before the mask
    scores = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    if greedy:
        tokens = torch.argmax(scores, dim=-1)
    else:
        tokens = _draw(scores, rows, R)
    chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
    out = torch.stack([tokens.double(), chosen.double()])[:, :n].cpu()
    top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    k = max(r.params.logprobs for r in rows)
    if k:
        values, ids = torch.topk(logprobs_all[:n], k, dim=-1)
        values, ids = values.cpu().tolist(), ids.cpu().tolist()
        top = [list(zip(ids[i], values[i]))[:rows[i].params.logprobs] for i in range(n)]
    return Draws(tokens=[int(t) for t in out[0].tolist()], logprobs=out[1].tolist(), top_logprobs=top)


def _draw(logits: torch.Tensor, rows: Sequence[RowDraw], R: int) -> torch.Tensor:
    V = logits.shape[1]
    pad = [RowDraw(GREEDY, 0, 0)] * (R - len(rows))
    rows = list(rows) + pad
    table = torch.tensor(
        [[1.0 if r.params.greedy else r.params.temperature for r in rows],
         [float(r.params.top_k if 0 < r.params.top_k < V else V) for r in rows],
         [r.params.top_p for r in rows],
         [stream_uniform(r.seed, r.index) for r in rows],
         [1.0 if r.params.greedy else 0.0 for r in rows]],
        dtype=torch.float64,
    ).to(logits.device, non_blocking=True)
    temp, top_k, top_p, u, is_greedy = table[0].float(), table[1].long(), table[2].float(), table[3], table[4].bool()
    scores = logits / temp[:, None]
    if any(0 < r.params.top_k < V or r.params.top_p < 1.0 for r in rows):  # decided on the host: no sync
        sorted_scores, _ = torch.sort(scores, dim=-1, descending=True)  # exact: a permutation
        kth = sorted_scores.gather(1, (top_k - 1)[:, None])
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        keep = before < top_p[:, None]
        keep[:, 0] = True  # a top_p below fp32's range (1e-300) rounds to 0
        floor_p = sorted_scores.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
        scores = scores.masked_fill(scores < torch.maximum(kth, floor_p), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = u[:, None] * cdf[:, -1:]
    drawn = (cdf <= target).sum(dim=-1)
    # rounding can leave target at the total: fall back to the last token with any mass
    last = V - 1 - torch.argmax(torch.flip(probs > 0, dims=[-1]).int(), dim=-1)
    drawn = torch.minimum(drawn, last)
    return torch.where(is_greedy, torch.argmax(logits, dim=-1), drawn)
