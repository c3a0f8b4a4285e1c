"""Next-token sampling: greedy, or temperature / top-k / top-p from a seeded generator (reproducible)."""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """temperature 0 means greedy (argmax); otherwise sample from the filtered softmax with `seed`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits [vocab] (fp32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
