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


class StepTimeTarget:
    """Prefill tokens per step for a step-time target: the calibrated model, corrected as steps run.

    Calibration times one decode; a real step carries several decodes and other load, so the model is
    scaled by how far real steps ran over (or under) what it predicted, smoothed over recent steps.
    """

    SMOOTHING = 0.3  # weight of the newest step in the correction

    def __init__(self, cost: StepCost, target_s: float, minimum: int) -> None:
        self.cost = cost
        self.target_s = target_s
        self.minimum = minimum
        self.scale = 1.0  # measured / predicted step time

    def prefill_budget(self, decode_context_tokens: int) -> int:
        return self.cost.prefill_budget(self.target_s / self.scale, decode_context_tokens, self.minimum)

    def observe(self, num_prefill_tokens: int, decode_context_tokens: int, seconds: float) -> None:
        predicted = self.cost.predict(num_prefill_tokens, decode_context_tokens)
        if predicted > 0:
            self.scale += self.SMOOTHING * (seconds / predicted - self.scale)


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
