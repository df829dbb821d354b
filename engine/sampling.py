"""The batched sampler: one token per row of logits, each row with its own params and generator."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.logits_processors import TokenHistory, process_logits
from engine.sampling_params import SampledToken, SamplingParams


class Sampler:
    """Picks one token per row of logits; each row has its own params and generator."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)  # masked before a request's min_tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], history: Sequence[TokenHistory] | None = None,
                 greedy_ids: np.ndarray | None = None) -> list[SampledToken]:
        """`history` (the requests, in row order) is needed when a row has penalties, min_tokens or a grammar.
        greedy_ids: each row's argmax of `logits` as the step found it (the compiled CPU step), used where no
        processor changed the logits."""
        logits = logits.float()
        processed = logits if history is None else process_logits(logits, params, history, self.eos_token_ids)
        token_ids = self._pick(processed, params, generators, greedy_ids if processed is logits else None)
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

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
              greedy_ids: np.ndarray | None) -> list[int]:
        if greedy_ids is None:
            # numpy's argmax on CPU: measured several times faster than torch's (docs/speed.md#the-decode-step)
            greedy_ids = (np.argmax(logits.numpy(), axis=1) if logits.device.type == "cpu"
                          else logits.argmax(dim=-1))
        greedy_ids = greedy_ids.tolist()
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
