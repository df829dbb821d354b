"""A per-token cost model of one engine step, calibrated at start-up, for a step-time target.

A step costs a fixed part (reading every weight once: the decode floor) plus a part per prefill
token (compute) plus a part per token of context that decodes read. Calibration times three
forwards on the real model and solves for the three terms; `prefill_budget` then says how many
prefill tokens fit beside the step's decodes within a target step time.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_s: float  # a step with one decode of a short context: weights streamed once
    per_prefill_token_s: float
    per_context_token_s: float  # K/V one decode reads per token of its context

    def predict(self, num_prefill_tokens: int, decode_context_tokens: int) -> float:
        return (self.fixed_s + num_prefill_tokens * self.per_prefill_token_s
                + decode_context_tokens * self.per_context_token_s)

    def prefill_budget(self, target_s: float, decode_context_tokens: int, minimum: int = 1) -> int:
        """Prefill tokens that fit in a step of `target_s` next to decodes reading that much context;
        at least `minimum`, so a prefill always makes progress even when the target cannot be met."""
        left = target_s - self.predict(0, decode_context_tokens)
        return max(minimum, int(left / self.per_prefill_token_s)) if self.per_prefill_token_s > 0 else minimum


def calibrate(forward: Callable[[int, int], None], prefill_tokens: int = 256, context_tokens: int = 1024,
              repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> StepCost:
    """`forward(num_prefill_tokens, decode_context_tokens)` runs one step's worth of model work.
    Best of `repeats` per point (the least disturbed by other load)."""
    def timed(p: int, c: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            forward(p, c)
            best = min(best, clock() - start)
        return best

    base = timed(0, 1)
    with_prefill = timed(prefill_tokens, 1)
    with_context = timed(0, context_tokens)
    return StepCost(fixed_s=base,
                    per_prefill_token_s=max(0.0, with_prefill - base) / prefill_tokens,
                    per_context_token_s=max(0.0, with_context - base) / (context_tokens - 1))
