"""Batched logits processing before sampling: allowed tokens, logit bias, penalties, min_tokens and grammar masks.

Each processor touches only the rows whose params ask for it, with one batched tensor op per
processor; a batch where no row asks for anything costs one pass over the params and no tensor work.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.grammar import StructuredMatcher, allocate_bitmask, apply_bitmask
from engine.sampling_params import SamplingParams, stop_ids


class TokenHistory(Protocol):
    """What the processors read of a request (engine.request.Request has it)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: StructuredMatcher | None


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory],
                   eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Returns the logits to sample from (`logits` itself, untouched, when no row needs processing)."""
    if not any(p.needs_logits_processing for p in params):
        return logits
    logits = logits.clone()
    _allowed_tokens(logits, params)
    _logit_bias(logits, params)
    _min_tokens(logits, params, history, eos_token_ids)
    _presence_frequency(logits, params, history)
    _repetition(logits, params, history)
    _grammar(logits, history)
    return logits


def _allowed_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """vLLM's allowed_token_ids: every other token's logit is -inf."""
    rows, cols = [], []
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            rows += [row] * len(p.allowed_token_ids)
            cols += p.allowed_token_ids
    if not rows:
        return
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[_ids(rows, logits), _ids(cols, logits)] = True
    masked = _ids(sorted(set(rows)), logits)
    logits[masked] = logits[masked].masked_fill(~allowed[masked], float("-inf"))


def _logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(row)
            cols.append(token_id)
            values.append(bias)
    if rows:
        logits.index_put_((_ids(rows, logits), _ids(cols, logits)),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _min_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory],
                eos_token_ids: frozenset[int]) -> None:
    """Before min_tokens outputs, EOS and the stop token ids cannot be sampled (a grammar decides its own end)."""
    rows, cols = [], []
    for row, (p, h) in enumerate(zip(params, history)):
        if len(h.output_token_ids) < p.min_tokens and h.matcher is None:
            stops = stop_ids(p, eos_token_ids)
            rows += [row] * len(stops)
            cols += sorted(stops)
    if rows:
        logits[_ids(rows, logits), _ids(cols, logits)] = float("-inf")


def _presence_frequency(logits: torch.Tensor, params: Sequence[SamplingParams],
                        history: Sequence[TokenHistory]) -> None:
    """OpenAI: logit -= frequency * count + presence * (count > 0), counting the generated tokens only."""
    rows = [r for r, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return
    counts = _token_counts(logits, [history[r].output_token_ids for r in rows])
    frequency = _column([params[r].frequency_penalty for r in rows], logits)
    presence = _column([params[r].presence_penalty for r in rows], logits)
    index = _ids(rows, logits)
    logits[index] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def _repetition(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory]) -> None:
    """HF/vLLM: a token seen in the prompt or output has its logit divided by the penalty if positive,
    multiplied by it if negative."""
    rows = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    seen = _token_counts(logits, [history[r].prompt_token_ids + history[r].output_token_ids for r in rows]) > 0
    penalty = _column([params[r].repetition_penalty for r in rows], logits)
    index = _ids(rows, logits)
    chosen = logits[index]
    penalized = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    logits[index] = torch.where(seen, penalized, chosen)


def _grammar(logits: torch.Tensor, history: Sequence[TokenHistory]) -> None:
    rows = [r for r, h in enumerate(history) if h.matcher is not None]
    if not rows:
        return
    bitmask = allocate_bitmask(len(rows), logits.shape[-1])
    for i, row in enumerate(rows):
        history[row].matcher.fill_bitmask(bitmask, i)
    apply_bitmask(logits, rows, bitmask)


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts."""
    counts = torch.zeros(len(token_lists), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    width = max((len(t) for t in token_lists), default=0)
    if width == 0:
        return counts
    padded = torch.zeros(len(token_lists), width, dtype=torch.long)
    weight = torch.zeros(len(token_lists), width, dtype=logits.dtype)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        weight[i, :len(tokens)] = 1
    return counts.scatter_add_(1, padded.to(logits.device), weight.to(logits.device))


def _ids(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]
