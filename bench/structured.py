"""Decode step time with and without schema-constrained requests in a batch of 8.

`python -m bench --structured [--model PATH]`: 8 running requests decode side by side; the batch
holds 0, 1 or 8 requests constrained by a JSON schema. Rounds alternate between the cases (the
machine is shared, so neighbours' load spreads over all of them) and the medians are reported:
the whole step, and the sampler's part (logits processing, grammar masks, sampling); then the
grammar's own cost for 8 constrained rows (bitmask fill and apply) without the model.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.grammar import allocate_bitmask, apply_bitmask
from engine.structured import StructuredOutput

BATCH = 8
# never complete within the measured steps: a long array of strings
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 500}},
          "required": ["notes"]}
PROMPT = "Write down everything you know about the capital of France, as JSON notes."


class _TimedSampler:
    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.seconds = 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.sampler(*args)
        self.seconds += time.perf_counter() - start
        return out


def _round(core: EngineCore, num_constrained: int, steps: int, tag: str) -> list[tuple[float, float]]:
    """(step seconds, sampler seconds) of `steps` decode steps of a batch of 8."""
    prompt = core.tokenizer.encode(PROMPT)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for i in range(BATCH):
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                                structured=structured if i < num_constrained else None)
        core.add_request(Request(f"{tag}-{i}", prompt, params))
    while any(r.is_prefilling or not r.output_token_ids for r in core.requests.values()):
        core.step()  # prefill (cached after the first round) and the first token
    timed = _TimedSampler(core.sampler)
    core.sampler = timed
    samples = []
    try:
        for _ in range(steps):
            timed.seconds = 0.0
            start = time.perf_counter()
            outputs, _ = core.step()
            samples.append((time.perf_counter() - start, timed.seconds))
            assert len(outputs) == BATCH and not any(o.finished for o in outputs), "a request ended early"
    finally:
        core.sampler = timed.sampler
    for request_id in list(core.requests):
        core.abort(request_id)
    return samples


def mask_cost(core: EngineCore, steps: int) -> dict:
    """The grammar's own share of a step for 8 constrained rows: fill the bitmasks, apply them (medians)."""
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    matchers = [core.grammars.matcher(structured) for _ in range(BATCH)]
    generator = torch.Generator().manual_seed(0)
    fills, applies = [], []
    for _ in range(steps):
        logits = torch.randn(BATCH, core.vocab_size, generator=generator)
        start = time.perf_counter()
        bitmask = allocate_bitmask(BATCH, core.vocab_size)
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        filled = time.perf_counter()
        apply_bitmask(logits, list(range(BATCH)), bitmask)
        fills.append(filled - start)
        applies.append(time.perf_counter() - filled)
        for matcher, token_id in zip(matchers, logits.argmax(dim=-1).tolist()):
            matcher.accept(token_id)
    return {"fill_ms": statistics.median(fills) * 1e3, "apply_ms": statistics.median(applies) * 1e3}


def run(model: str = "default", rounds: int = 6, steps: int = 24, cases: tuple[int, ...] = (0, 1, BATCH)) -> dict:
    core = EngineCore(EngineConfig(model=model, max_num_seqs=BATCH))
    core.grammars.matcher(StructuredOutput("json_schema", json.dumps(SCHEMA)))  # compile once, outside the timing
    _round(core, BATCH, 4, "warmup")
    samples: dict[int, list[tuple[float, float]]] = {c: [] for c in cases}
    for r in range(rounds):
        for c in cases:
            samples[c] += _round(core, c, steps, f"r{r}-c{c}")
    result = {"model": str(core.model_path.name), "batch": BATCH, "vocab_size": core.vocab_size,
              "steps_per_case": rounds * steps, "cases": {}, "mask": mask_cost(core, rounds * steps)}
    for c, rows in samples.items():
        result["cases"][c] = {"step_ms": statistics.median(s for s, _ in rows) * 1e3,
                              "sampler_ms": statistics.median(t for _, t in rows) * 1e3}
    return result


def render(result: dict) -> str:
    base = result["cases"][0]
    lines = [f"decode step, batch of {result['batch']}, {result['model']} (vocab {result['vocab_size']}), "
             f"median of {result['steps_per_case']} steps per case",
             f"{'constrained':>11} {'step ms':>9} {'vs none':>8} {'sampler ms':>11}"]
    for c, row in result["cases"].items():
        lines.append(f"{c:>11} {row['step_ms']:>9.2f} {row['step_ms'] / base['step_ms']:>7.3f}x "
                     f"{row['sampler_ms']:>11.3f}")
    mask = result["mask"]
    lines.append(f"grammar alone, {result['batch']} constrained rows per step: fill bitmasks {mask['fill_ms']:.3f} ms, "
                 f"apply {mask['apply_ms']:.3f} ms (medians)")
    return "\n".join(lines)


def main(model: str = "default") -> int:
    print(render(run(model)))
    return 0
