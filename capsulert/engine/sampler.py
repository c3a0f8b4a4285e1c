"""Next-token sampling for a whole decode batch at once, on the device.

Batch invariance: a row's token depends only on its own logits, its SamplingParams and its position in its
own random stream. The stream is counter based: the uniform a session draws for the token at sequence index
i is a hash of (seed, i), computed on the host in exact integer arithmetic. So a session samples the same
token alone or among 63 others, before or after a snapshot / restore, and generate(N) equals generate(k)
then generate(N - k). Rows are sampled by inverse CDF over the filtered distribution; the filters and the
CDF run over the whole [rows, vocab] block in one go. A SamplingPlan holds what a set of rows keeps from step
to step (their parameters on the device, each seed hashed once), so a step sends only the rows' uniforms to
the device; the tokens come back in one transfer, the logprobs and any top logprobs in another, queued after
the tokens' so that the next decode step can be launched before they are computed.

Logprobs are those of the raw model distribution (log_softmax of the logits, before temperature, top-k,
top-p and a constraint's token mask), as vLLM reports them by default: a constrained session's logprobs and
top_logprobs are the model's own, so a top alternative may be a token its grammar did not allow.

A constrained row (SamplingParams.constraint, engine/grammar.py) draws from its logits with every token
its grammar forbids at -inf: greedy takes the best allowed token, sampling draws among the allowed ones.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import GREEDY, SamplingParams

_MASK64 = (1 << 64) - 1
_TWO53 = float(1 << 53)


def resolve_seed(params: SamplingParams) -> int:
    """The seed a generate call uses for a session: the given one, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _uniform(mixed_seed: int, index: int) -> float:
    return (_splitmix64(mixed_seed ^ index) >> 11) / _TWO53


def stream_uniform(seed: int, index: int) -> float:
    """Uniform in [0, 1) for token `index` of the stream `seed` (53 random bits)."""
    return _uniform(_splitmix64(seed), index)


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
    constraint forbids a token (None: no row is constrained)."""
    plan = SamplingPlan([r.params for r in rows], [r.seed for r in rows], logits.shape[0], logits.shape[1],
                        logits.device)
    return plan.draw(logits, [r.index for r in rows], allowed)


class SamplingPlan:
    """The rows of a decode group that steps together: their parameters as device tensors, made once, and
    each seed's first hash, so a step computes and sends only the rows' uniforms. `rows`: the block's row
    count R (the padding rows draw greedily with seed 0 at index 0); `seeds`: one per row, as resolve_seed
    gave it."""

    def __init__(self, params: Sequence[SamplingParams], seeds: Sequence[int], rows: int, vocab: int,
                 device: torch.device):
        n = len(params)
        if n > rows:
            raise InvalidRequestError(f"{n} rows to sample but only {rows} rows of logits")
        self.logprobs = [p.logprobs for p in params]  # top logprobs each row asked for
        self.top = max(self.logprobs, default=0)
        self.greedy = all(p.greedy for p in params)
        if self.greedy:
            return
        self._mixed = [_splitmix64(s) for s in seeds]
        self._pad_u = [stream_uniform(0, 0)] * (rows - n)
        padded = list(params) + [GREEDY] * (rows - n)
        table = torch.tensor(
            [[1.0 if p.greedy else p.temperature for p in padded],
             [float(p.top_k if 0 < p.top_k < vocab else vocab) for p in padded],
             [p.top_p for p in padded],
             [1.0 if p.greedy else 0.0 for p in padded]],
            dtype=torch.float64,
        ).to(device, non_blocking=True)
        self._temp = table[0].float()[:, None]
        self._kth = (table[1].long() - 1)[:, None]
        self._top_p = table[2].float()[:, None]
        self._is_greedy = table[3].bool()
        self._filtered = any(0 < p.top_k < vocab or p.top_p < 1.0 for p in padded)  # decided here: no sync
        self._any_greedy = any(p.greedy for p in params)

    def draw(self, logits: torch.Tensor, indices: Sequence[int], allowed: torch.Tensor | None = None) -> Draws:
        """Tokens for the first len(indices) rows of logits [rows, vocab] (fp32), row i at token index
        indices[i] of its stream; `allowed` as in sample_rows."""
        tokens, rest = self.start(logits, indices, allowed)
        logprobs, top = rest()
        return Draws(tokens=tokens, logprobs=logprobs, top_logprobs=top)

    def start(self, logits: torch.Tensor, indices: Sequence[int], allowed: torch.Tensor | None = None
              ) -> tuple[list[int], Callable[[], tuple[list[float], list[list[tuple[int, float]]]]]]:
        """draw in two halves: the tokens, and a call that returns their logprobs and top logprobs. The
        logprobs are not needed to launch the next step: on a GPU they are queued behind the tokens' transfer
        and come back in one of their own, so they are computed while the caller launches it."""
        n = len(indices)
        scores = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
        tokens = torch.argmax(scores, dim=-1) if self.greedy else self._draw(scores, indices)
        tokens_out = _Transfer(tokens[:n])
        logprobs_all = torch.log_softmax(logits, dim=-1)  # the raw model's, before the mask
        rows = logprobs_all.gather(1, tokens[:, None])[:n]
        k, want = self.top, self.logprobs
        if k:  # one transfer: doubles hold the ids and the fp32 values exactly
            values, ids = torch.topk(logprobs_all[:n], k, dim=-1)
            rows = torch.cat([rows.double(), values.double(), ids.double()], dim=1)
        rows_out = _Transfer(rows)

        def rest() -> tuple[list[float], list[list[tuple[int, float]]]]:
            got = rows_out.wait().tolist()
            top = [[(int(row[1 + k + j]), row[1 + j]) for j in range(w)] for row, w in zip(got, want)]
            return [row[0] for row in got], top
        return tokens_out.wait().tolist(), rest

    def _draw(self, logits: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        V = logits.shape[1]
        u = torch.tensor([_uniform(m, i) for m, i in zip(self._mixed, indices)] + self._pad_u,
                         dtype=torch.float64).to(logits.device, non_blocking=True)
        scores = logits / self._temp
        if self._filtered:
            sorted_scores, _ = torch.sort(scores, dim=-1, descending=True)  # exact: a permutation
            kth = sorted_scores.gather(1, self._kth)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            # keep the smallest prefix whose mass reaches top_p (the top token always stays)
            keep = before < self._top_p
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
        if not self._any_greedy:  # only the padding rows draw greedily, and their tokens are never read
            return drawn
        return torch.where(self._is_greedy, torch.argmax(logits, dim=-1), drawn)


class _Transfer:
    """A device -> host copy. On a GPU it is queued without waiting (into pinned memory) and awaited through
    an event, so what is queued after it runs while the host waits for it and goes on."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = t.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
