"""bf16 against fp32: decode speed and how far greedy output drifts. `python -m bench.dtype`.

Two bf16 variants against the fp32 model: the whole model in bf16 (`--dtype bfloat16`), and fp32
weights with K/V stored in bf16 (`--kv-cache-dtype bfloat16`). Drift: each prompt of a fixed set is
answered greedily in each; we count the prompts whose answers differ, where the first difference
falls, and the output tokens that differ position by position (after a first difference the
continuations usually part ways for good). Speed: decode steps at batch 1 and 8.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import decode
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]


VARIANTS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
            "float32, bf16 K/V": {"dtype": "float32", "kv_cache_dtype": "bfloat16"}}


def greedy_answers(model: str, max_tokens: int, **engine) -> list[list[int]]:
    llm = LLM(model, **engine)
    tokenizer = llm.core.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def drift(reference: list[list[int]], other: list[list[int]]) -> dict:
    if [len(a) for a in reference] != [len(b) for b in other]:
        raise RuntimeError("a run ended early (an engine error?): the answers cannot be compared")
    first = []
    for a, b in zip(reference, other):
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first.append(diverge)
    differing = sum(x != y for a, b in zip(reference, other) for x, y in zip(a, b))
    total = sum(len(a) for a in reference)
    return {"prompts": len(reference), "prompts_differing": sum(f is not None for f in first),
            "first_difference_at": first, "tokens_differing": differing, "tokens": total,
            "tokens_differing_fraction": differing / total}


def run(model: str = "default", max_tokens: int = 32, log=print) -> dict:
    fp32 = greedy_answers(model, max_tokens, **VARIANTS["float32"])
    result = {"drift": {}, "speed": {}}
    for name, engine in VARIANTS.items():
        if name != "float32":
            d = result["drift"][name] = drift(fp32, greedy_answers(model, max_tokens, **engine))
            log(f"{name} vs float32 greedy, {d['prompts']} prompts x {max_tokens} tokens: {d['prompts_differing']} "
                f"prompts differ (first difference at {d['first_difference_at']}), "
                f"{d['tokens_differing']}/{d['tokens']} tokens")
        result["speed"][name] = decode.run(model, batches=(1, 8), steps=16, log=log, **engine)["rows"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dtype", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args.model, args.max_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
