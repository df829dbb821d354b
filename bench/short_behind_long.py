"""A short prompt that arrives behind a long prefill: `python -m bench.short_behind_long`.

Each round sends a long prompt (a held-out text's first `--long-tokens` tokens) to the engine, runs one step (its
first prefill chunk), then adds a short question and steps until both have their first token; a round of the long
prompt alone comes first. Printed per round: the question's TTFT from its arrival, and the long prompt's TTFT
alone and with the question beside it, so what the question gains and what the long prompt pays compare in one
run (engine/scheduler.py: a shorter prefill shares the step with a longer one ahead of it). Greedy, caching off,
in process.
"""
from __future__ import annotations

import argparse
import json
import time

from engine import LLM, SamplingParams
from engine.request import Request

QUESTION = "What is the capital of France?"


def _first_tokens(llm: LLM, long_ids: list[int], short_ids: list[int] | None, name: str) -> dict:
    """Steps until every request has its first token; seconds and steps from each one's arrival."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    long_request = Request(f"{name}-long", long_ids, params)
    started = time.perf_counter()
    llm.core.add_request(long_request)
    llm.core.step()
    requests = {"long": (long_request, started, 1)}
    if short_ids is not None:
        requests["short"] = (Request(f"{name}-short", short_ids, params), time.perf_counter(), 0)
        llm.core.add_request(requests["short"][0])
    ttft = {}
    while llm.core.has_unfinished():
        llm.core.step()
        requests = {k: (r, t, n + 1) for k, (r, t, n) in requests.items()}
        for key, (request, arrived, steps) in requests.items():
            if key not in ttft and request.output_token_ids:
                ttft[key] = {"seconds": round(time.perf_counter() - arrived, 3), "steps": steps}
    return ttft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.short_behind_long", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    llm = LLM(args.model, enable_prefix_caching=False)
    with open(args.text) as f:
        long_ids = llm.tokenizer.encode(f.read())[:args.long_tokens]
    short_ids = llm.tokenizer.encode(QUESTION)
    rounds = []
    for i in range(args.rounds):
        alone = _first_tokens(llm, long_ids, None, f"alone{i}")["long"]
        both = _first_tokens(llm, long_ids, short_ids, f"both{i}")
        rounds.append({"long_alone": alone, "long_with_question": both["long"], "question": both["short"]})
    print(f"{len(long_ids)}-token prompt, then a {len(short_ids)}-token question one step later (TTFT, steps):")
    print(f"{'round':>5}  {'question':>16}  {'long, with it':>16}  {'long, alone':>16}")
    for i, r in enumerate(rounds):
        cells = [f"{r[k]['seconds']:.2f} s ({r[k]['steps']})" for k in ("question", "long_with_question", "long_alone")]
        print(f"{i:>5}  " + "  ".join(f"{c:>16}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"long_tokens": len(long_ids), "question_tokens": len(short_ids), "rounds": rounds}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
