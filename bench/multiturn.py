"""Concurrent multi-turn chats through the HTTP gateway with streaming clients: `python -m bench.multiturn`.

4 chats share one 512-token system prompt; each turn adds a 128-token user message and asks for
32 output tokens; the next turn is sent as soon as the previous answer ends (closed loop, scripted
assistant replies so every run sends the same tokens). Reports TTFT, inter-token latency p50/p95,
request latency and output tok/s, and (in process) where the inter-token gaps come from: decode
steps that also carried a prefill chunk against pure decode steps.

`--api responses`: the same chats through the gateway twice, side by side, each client keeping its
conversation the way its API does: chat completions resend the whole history (with the model's own
answers) every turn; the Responses API sends only the new user message with `previous_response_id`
and the server brings the stored conversation. Reports TTFT, the cached share of prompt tokens and the
request bytes per turn of each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import driver
from bench.driver import pct
from bench.workloads import TextMaker, Workload, _chat
from engine.core import EngineCore
from engine.model.loader import resolve_model_path

CHATS, PREFIX_TOKENS, TURN_TOKENS, OUTPUT_TOKENS = 4, 512, 128, 32


def workload(tokenizer, turns: int = 4, seed: int = 12, think_s: float = 0.0, chats: int = CHATS,
             prefix_tokens: int = PREFIX_TOKENS) -> Workload:
    """`think_s`: the pause before each later turn (0: sent as soon as the previous answer ends)."""
    tm = TextMaker(tokenizer, seed)
    system = "You are a helpful assistant for a software company. " + tm.text(prefix_tokens - 12)
    reqs = []
    for c in range(chats):
        history = [{"role": "system", "content": system}]
        previous = None
        for turn in range(turns):
            history = history + [{"role": "user", "content": tm.text(TURN_TOKENS)}]
            rid = f"chat-{c}-turn-{turn}"
            reqs.append(_chat(tokenizer, rid, history, 0.0, OUTPUT_TOKENS, after=previous,
                              think_s=think_s if previous else 0.0))
            history = history + [{"role": "assistant", "content": tm.text(OUTPUT_TOKENS)}]
            previous = rid
    return Workload(f"multiturn{chats}", f"{chats} concurrent chats, shared {prefix_tokens}-token prefix, "
                                  f"{TURN_TOKENS}-token turns, {OUTPUT_TOKENS} output tokens", reqs)


def summarize(result: driver.RunResult) -> dict:
    row = result.summary()
    itl = [d for t in result.timings for d in t.itls]
    row["itl_p95_s"] = pct(itl, 95)
    row["e2e_p90_s"] = pct([t.e2e for t in result.timings], 90)
    return row


class StepLog:
    """Wraps EngineCore.step: each step's time, its decodes and its prefill tokens."""

    def __init__(self, core: EngineCore) -> None:
        self.steps: list[tuple[float, int, int]] = []  # (seconds, decodes, prefill tokens)
        original = core.step

        def step():
            start = time.perf_counter()
            outputs, stats = original()
            decodes = stats.num_generation_tokens - sum(1 for o in outputs if o.num_output_tokens == 1)
            self.steps.append((time.perf_counter() - start, decodes, stats.num_prompt_tokens))
            return outputs, stats

        core.step = step

    def breakdown(self) -> dict:
        """Decode steps alone vs decode steps that also ran a prefill chunk (which stall every decode)."""
        pure = [s for s, d, p in self.steps if d and not p]
        mixed = [s for s, d, p in self.steps if d and p]
        decoding = pure + mixed
        return {"decode_steps": len(decoding), "with_prefill": len(mixed),
                "pure_step_ms_p50": statistics.median(pure) * 1e3 if pure else None,
                "mixed_step_ms_p50": statistics.median(mixed) * 1e3 if mixed else None,
                "share_of_decode_time_in_mixed_steps": sum(mixed) / sum(decoding) if decoding else None,
                "mean_decodes_per_step": statistics.mean(d for _, d, _ in self.steps if d) if decoding else None}


def run(model: str = "default", turns: int = 4, http: bool = True, log=print,
        max_step_ms: float | None = None) -> dict:
    model_path = str(resolve_model_path(model))
    config = driver.EngineConfig(model=model_path, max_step_ms=max_step_ms)
    core = EngineCore(config)
    work = workload(core.tokenizer, turns)
    driver.warm_up(core)
    steps = StepLog(core)
    in_process = summarize(driver.run_engine(core, work, "engine"))
    in_process["steps"] = steps.breakdown()
    log(_line("in process", in_process))
    out = {"workload": work.description, "in_process": in_process}
    if http:
        from bench import http as bench_http
        core = EngineCore(config)
        driver.warm_up(core)
        steps = StepLog(core)
        row = summarize(bench_http.run_gateway(core, work, "http-streaming"))
        row["steps"] = steps.breakdown()
        log(_line("HTTP gateway", row))
        out["http"] = row
    return out


def run_apis(model: str = "default", turns: int = 4, log=print) -> dict:
    """Chat completions (resending the history) against the Responses API (previous_response_id)."""
    from bench import http as bench_http
    model_path = str(resolve_model_path(model))
    config = driver.EngineConfig(model=model_path)
    chats = None
    out = {"workload": f"{CHATS} chats x {turns} turns, shared {PREFIX_TOKENS}-token system prompt, "
                       f"{TURN_TOKENS}-token user turns, {OUTPUT_TOKENS} output tokens", "apis": {}}
    for api in ("chat", "responses"):  # a fresh engine each: both start from an empty cache
        core = EngineCore(config)
        chats = chats or conversations(workload(core.tokenizer, turns))
        driver.warm_up(core)
        row = bench_http.run_conversations(core, chats, api, OUTPUT_TOKENS)
        log(f"multiturn4 --api {api}: TTFT p50 {row['ttft_p50_s']:.3f} s, later turns' prompt tokens cached "
            f"{row['cached_share_later_turns']:.1%}, request bytes by turn "
            f"{', '.join(f'{b:,.0f}' for b in row['request_bytes_by_turn'])}, {row['output_tok_s']:.1f} output tok/s")
        out["apis"][api] = row
    chat, responses = out["apis"]["chat"], out["apis"]["responses"]
    out["responses_over_chat"] = {"ttft_p50": responses["ttft_p50_s"] / chat["ttft_p50_s"],
                                  "cached_share": responses["cached_share_later_turns"] /
                                  chat["cached_share_later_turns"]}
    log("responses / chat: TTFT p50 {ttft_p50:.3f}x, cached share {cached_share:.3f}x".format(
        **out["responses_over_chat"]))
    return out


def conversations(work: Workload) -> list[tuple[str, list[str]]]:
    """Each chat's system prompt and its user messages, from the scripted workload."""
    chats: dict[str, tuple[str, list[str]]] = {}
    for r in work.requests:
        chat = r.request_id.rsplit("-turn-", 1)[0]
        system, users = chats.setdefault(chat, (r.messages[0]["content"], []))
        users.append(r.messages[-1]["content"])
    return list(chats.values())


def _line(label: str, row: dict) -> str:
    s = row["steps"]
    return (f"multiturn4 {label}: TTFT p50 {row['ttft_p50_s']:.3f} s, ITL p50 {row['itl_p50_s'] * 1e3:.0f} ms / "
            f"p95 {row['itl_p95_s'] * 1e3:.0f} ms, request latency p50 {row['e2e_p50_s']:.2f} s, "
            f"{row['output_tok_s']:.1f} output tok/s; decode steps {s['decode_steps']} "
            f"({s['with_prefill']} with a prefill chunk), step p50 pure {s['pure_step_ms_p50'] or 0:.0f} ms vs "
            f"with prefill {s['mixed_step_ms_p50'] or 0:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--max-step-ms", type=float, default=None,
                        help="the engine's step-time target (what it costs in TTFT, what it buys in ITL p95)")
    parser.add_argument("--api", choices=("chat", "responses"), default="chat",
                        help="responses: chat completions resending the history against the Responses API "
                             "with previous_response_id, side by side")
    args = parser.parse_args(argv)
    if args.api == "responses":
        result = run_apis(args.model, args.turns)
    else:
        result = run(args.model, args.turns, not args.no_http, max_step_ms=args.max_step_ms)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
