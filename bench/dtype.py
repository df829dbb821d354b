"""bf16 against fp32: decode speed and how far greedy output drifts. `python -m bench.dtype`.

Drift: each prompt of a fixed set is answered greedily in both dtypes; we count the prompts whose
answers differ, where the first difference falls, and the output tokens that differ position by
position (after a first difference the continuations usually part ways for good).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import decode
from engine.llm import LLM
from engine.sampling import SamplingParams

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


def greedy_answers(model: str, dtype: str, max_tokens: int) -> list[list[int]]:
    llm = LLM(model, dtype=dtype)
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
    fp32 = greedy_answers(model, "float32", max_tokens)
    bf16 = greedy_answers(model, "bfloat16", max_tokens)
    result = {"drift": drift(fp32, bf16), "speed": {}}
    d = result["drift"]
    log(f"bf16 vs fp32 greedy, {d['prompts']} prompts x {max_tokens} tokens: {d['prompts_differing']} prompts "
        f"differ (first difference at {d['first_difference_at']}), {d['tokens_differing']}/{d['tokens']} tokens")
    for dtype in ("float32", "bfloat16"):
        result["speed"][dtype] = decode.run(model, batches=(1,), steps=16, dtype=dtype, log=log)["rows"][0]
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
