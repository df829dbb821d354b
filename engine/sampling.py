"""Sampling parameters of one request and the batched sampler."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.logits_processors import TokenHistory, process_logits
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
    presence_penalty: float = 0.0  # OpenAI: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and generated tokens; 1 disables
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured: StructuredOutput | None = None  # a grammar every output token must follow

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
        self._check_processing_fields()

    def _check_processing_fields(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.01 <= self.repetition_penalty <= 10:  # dividing by less overflows a logit to inf
            raise ValueError("repetition_penalty must be in [0.01, 10]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token_id!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1.0 or self.structured is not None)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Picks one token per row of logits; each row has its own params and generator."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)  # masked before a request's min_tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 history: Sequence[TokenHistory] | None = None) -> list[SampledToken]:
        """`history` (the requests, in row order) is needed when a row has penalties, min_tokens or a grammar."""
        logits = logits.float()
        processed = logits if history is None else process_logits(logits, params, history, self.eos_token_ids)
        token_ids = self._pick(processed, params, generators)
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
        # numpy's argmax on CPU: torch's took 170-200 us for 8 rows of a 49,152-token vocabulary, numpy's 20
        greedy_ids = (np.argmax(logits.numpy(), axis=1) if logits.device.type == "cpu"
                      else logits.argmax(dim=-1)).tolist()
        picked = []
        for row, p in enumerate(params):
            if p.greedy:
                picked.append(greedy_ids[row])
                continue
            probs = _filtered_probs(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
            picked.append(int(torch.multinomial(probs, 1, generator=generators[row]).item()))
        return picked


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
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
    if min_p > 0.0:  # vLLM: relative to the top token's probability, after temperature
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs
