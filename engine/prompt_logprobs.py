"""Prompt logprobs (vLLM's prompt_logprobs; completions' echo with logprobs): each prompt token's logprob given the
tokens before it, from the logits of the prompt positions a prefill chunk ran."""
from __future__ import annotations

import torch

from engine.sampling_params import SampledToken

# rows turned into logprobs at once: the chunk's logits are there already, but log_softmax, the comparison for
# the ranks and topk each make a copy (a 512-token chunk of a 150,000-token vocabulary: 300 MB of float32 each)
ROWS_PER_SLICE = 64


def score(logits: torch.Tensor, targets: list[int], k: int) -> list[SampledToken]:
    """logits [rows, vocab], row i the model's prediction of targets[i]: each target's logprob and rank, and the top
    k tokens (with their logprobs) of its row."""
    scored = []
    for start in range(0, len(targets), ROWS_PER_SLICE):
        logprobs = torch.log_softmax(logits[start:start + ROWS_PER_SLICE].float(), dim=-1)
        ids = torch.tensor(targets[start:start + ROWS_PER_SLICE], device=logprobs.device)
        chosen = logprobs.gather(1, ids[:, None])
        ranks = (logprobs > chosen).sum(dim=1) + 1
        top = [None] * len(ids)
        if k:
            values, top_ids = logprobs.topk(k, dim=1)
            top = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        scored += [SampledToken(t, lp, top_k, rank) for t, lp, top_k, rank
                   in zip(ids.tolist(), chosen[:, 0].tolist(), top, ranks.tolist())]
    return scored
