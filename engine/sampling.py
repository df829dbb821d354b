"""Sampling parameters of one request and the batched sampler."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.structured import StructuredOutput

# below this temperature sampling is greedy: dividing float32 logits by less overflows them to inf
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, not part of the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the top k
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # NaN passes every range check below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Picks one token per row of logits; each row has its own params and generator."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[SampledToken]:
        logits = logits.float()
        token_ids = self._pick(logits, params, generators)
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        out = []
        for row, (token_id, p) in enumerate(zip(token_ids, params)):
            sampled = SampledToken(token_id)
            if logprobs is not None and p.logprobs is not None:
                sampled.logprob = logprobs[row, token_id].item()
                if p.logprobs > 0:
                    values, ids = logprobs[row].topk(p.logprobs)
                    sampled.top_logprobs = list(zip(ids.tolist(), values.tolist()))
            out.append(sampled)
        return out

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> list[int]:
        greedy_ids = logits.argmax(dim=-1).tolist()
        picked = []
        for row, p in enumerate(params):
            if p.greedy:
                picked.append(greedy_ids[row])
                continue
            probs = _filtered_probs(logits[row] / p.temperature, p.top_k, p.top_p)
            picked.append(int(torch.multinomial(probs, 1, generator=generators[row]).item()))
        return picked


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest head whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 still keeps the most likely token
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
