"""The batched sampler: one token per row of logits, each row with its own params and generator."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from engine.logits_processors import TokenHistory, process_logits
from engine.sampling_params import SampledToken, SamplingParams


TOP_P_FIRST_CANDIDATES = 64  # the largest tokens top-p looks among first (then 4x as many, until the mass is there)


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
        if greedy_ids is None and any(p.greedy for p in params):
            # numpy's argmax on CPU: measured several times faster than torch's (docs/speed.md#the-decode-step)
            greedy_ids = (np.argmax(logits.numpy(), axis=1) if logits.device.type == "cpu"
                          else logits.argmax(dim=-1))
        greedy_ids = greedy_ids.tolist() if greedy_ids is not None else []
        picked = []
        for row, p in enumerate(params):
            if p.greedy:
                picked.append(greedy_ids[row])
                continue
            probs = _filtered_probs(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
            picked.append(_draw(probs, generators[row]))
        return picked


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from probs (zero outside the tokens the filters kept) by the inverse of their cumulative sum at
    one uniform number: torch.multinomial draws an exponential for every probability it is given (0.72 ms for
    49,152 tokens). ValueError where the probabilities are not finite (that row fails alone)."""
    kept = probs.nonzero().squeeze(1)
    cumulative = probs[kept].cumsum(0)
    total = float(cumulative[-1]) if len(kept) else 0.0
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"cannot sample: the probabilities sum to {total}")
    u = torch.rand(1, generator=generator, device=probs.device) * total
    # token i owns [cumulative[i - 1], cumulative[i]); u * total may round up to total itself
    at = torch.searchsorted(cumulative, u, right=True).clamp_(max=len(kept) - 1)
    return int(kept[at].item())


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    if top_k > 0 and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = _top_p(probs, top_p)
    if min_p > 0.0:  # vLLM: relative to the top token's probability, after temperature
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs with all but the smallest head of tokens whose mass reaches top_p set to 0 (the first token always
    stays). The head is found among the largest 64, 256, ... tokens (topk, sorted), as far as it takes: sorting
    all of SmolLM2's 49,152 took 2.8 ms a token, most of a sampled token's cost."""
    count = len(probs)
    k = min(TOP_P_FIRST_CANDIDATES, count)
    while True:
        values, ids = probs.topk(k)
        mass = values.cumsum(0)
        if mass[-1] >= top_p or k == count:  # the head ends among these: every later token comes after top_p
            break
        k = min(4 * k, count)
    drop = mass - values >= top_p
    drop[0] = False  # a top_p that rounds to 0 in float32 still keeps the most likely token
    kept = ids[~drop]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out
