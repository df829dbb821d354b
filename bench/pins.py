"""Pinned prefixes, side by side in one run: `python -m bench pins [--quick] [--model PATH] [--out DIR]`.

1. survive: rounds of one request with a hot ~1,000-token system prompt (and a short unique question), then a
   burst of one-off documents, each asked about twice (so each looks as reusable as the system prompt to the
   eviction policy), into a pool that holds the system prompt and about two documents. With and without a
   `cache_control` pin on the system prompt, under each eviction policy: its hit rate and TTFT.
2. cost: a workload that never pins (`bench` chatbot, every request at once), run alternately as shipped and
   with the engine's pin hooks taken out (expiry check, hit renewal, pinning at the end of a prefill): output
   tok/s and hit rate; and, since a 1% difference is below these machines' run-to-run noise, the time the
   pin bookkeeping adds to each step (expiry check and the pin stats every step reports), timed directly
   against the mean step time of those runs.

Requests of `survive` run one at a time (closed loop), so TTFT is the request's own prefill, not queueing.
Timings on a shared machine are noisy: figures are medians (p99 where named).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

from bench import driver, workloads
from bench.tiers import BLOCK, Runner, cli, p, tokens
from engine.messages import CacheBreakpoint, CacheDirectives
from engine.request import Request
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Scale:
    hot_tokens: int = 1000
    doc_tokens: int = 1000
    question_tokens: int = 24
    rounds: int = 10  # one hot request, then a burst
    burst: int = 3  # documents per burst, each asked twice
    pool_blocks: int = 200  # the system prompt (62 blocks) and about two documents
    cost_repeats: int = 5  # alternating runs of each variant


FULL = Scale()
QUICK = Scale(rounds=5, cost_repeats=2)


class PinRunner(Runner):
    """A Runner whose requests may carry cache directives."""

    def ask(self, prompt: list[int], cache: CacheDirectives | None) -> tuple[float, int]:
        self._ids += 1
        request = Request(f"p{self._ids}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                          tenant="app", cache=cache)
        start = time.perf_counter()
        self.core.add_request(request)
        while self.core.has_unfinished():
            _, stats = self.core.step()
            self.computed += stats.num_prompt_tokens
        return time.perf_counter() - start, request.num_cached_tokens


def survive(model: str, vocab: int, s: Scale) -> dict:
    hot = tokens(s.hot_tokens, 1, vocab)
    hittable = s.hot_tokens // BLOCK * BLOCK
    pin = CacheDirectives((CacheBreakpoint(s.hot_tokens, 300.0),))
    results = {}
    for policy in ("slru", "lru"):
        for pinned in (False, True):
            run = PinRunner(model, num_kv_blocks=s.pool_blocks, eviction_policy=policy)
            cache = pin if pinned else None
            run.ask(hot + tokens(s.question_tokens, 0, vocab), cache)  # the cold first request: not counted
            ttfts, cached, seed = [], [], 1000
            for _ in range(s.rounds):
                seed += 1
                ttft, hit = run.ask(hot + tokens(s.question_tokens, seed, vocab), cache)
                ttfts.append(ttft)
                cached.append(min(hit, hittable))
                for _ in range(s.burst):
                    seed += 1
                    doc = tokens(s.doc_tokens, seed, vocab)
                    for question in (1, 2):
                        run.ask(doc + tokens(s.question_tokens, seed * 10 + question, vocab), None)
            results[f"{policy}, {'pinned' if pinned else 'not pinned'}"] = {
                "hot_hit_rate": sum(cached) / (hittable * len(cached)), "hot_ttft_p50_s": p(ttfts, 0.5),
                "hot_ttft_p99_s": p(ttfts, 0.99), "hot_requests": len(ttfts),
                "evictions": run.core.kv.pool.num_evictions, "prefill_computed": run.computed,
                "pinned_blocks": run.core.kv.pins.num_blocks}
    return results


def _without_pin_hooks(core) -> None:
    """The engine as it was before pins: no expiry check per step, no renewal on a hit, no pinning."""
    core.kv.pins.expire = lambda: 0
    core.kv.pins.renew_hits = lambda tenant, block_hashes: None
    core.kv.pin_prompt = lambda request: None


def cost(model: str, tokenizer, s: Scale, quick: bool) -> dict:
    # every request at once: output tok/s is the engine's, not the arrival rate's
    workload = workloads.build("chatbot", tokenizer,
                               dataclasses.replace(workloads.QUICK if quick else workloads.FULL, time_scale=0))
    runs: dict[str, list[dict]] = {"as shipped": [], "without pin hooks": []}
    step_s = []
    first = driver.make_core(model, workload, {"max_num_batched_tokens": 512})
    driver.run_engine(first, workload, "first run")  # kernels compiled for these shapes: not in any figure
    for repeat in range(s.cost_repeats):
        for variant in list(runs)[::1 if repeat % 2 == 0 else -1]:  # ABBA: neither always runs first
            core = driver.make_core(model, workload, {"max_num_batched_tokens": 512})
            if variant == "without pin hooks":
                _without_pin_hooks(core)
            driver.warm_up(core)
            steps = core.num_steps
            summary = driver.run_engine(core, workload, variant).summary()
            runs[variant].append(summary)
            if variant == "as shipped":
                step_s.append(summary["duration_s"] / (core.num_steps - steps))
                bookkeeping_s = _bookkeeping_per_step(core)
    out = {variant: {"output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                     "hit_rate": statistics.median(r["hit_rate"] for r in rs),
                     "output_tok_s_runs": [r["output_tok_s"] for r in rs]} for variant, rs in runs.items()}
    base, shipped = out["without pin hooks"], out["as shipped"]
    out["tok_s_ratio"] = shipped["output_tok_s"] / base["output_tok_s"]
    out["hit_rate_ratio"] = shipped["hit_rate"] / base["hit_rate"] if base["hit_rate"] else 1.0
    out["workload"] = workload.name
    out["bookkeeping_per_step_s"] = bookkeeping_s
    out["mean_step_s"] = statistics.median(step_s)
    out["bookkeeping_share"] = bookkeeping_s / out["mean_step_s"]
    return out


def _bookkeeping_per_step(core, n: int = 100_000) -> float:
    """What pins add to every step of a workload without pins: the expiry check and the pin figures of the
    step's stats."""
    pins = core.kv.pins
    start = time.perf_counter()
    for _ in range(n):
        pins.expire()
        pins.tenants_blocks(), dict(pins.released), pins.take_tenant_expiries(), pins.take_tenant_refusals()
    return (time.perf_counter() - start) / n


def targets(r: dict) -> dict:
    sv, c = r["survive"], r["cost"]
    return {"a pinned system prompt keeps every hit through the bursts (both policies)":
            min(sv["slru, pinned"]["hot_hit_rate"], sv["lru, pinned"]["hot_hit_rate"]) == 1.0,
            "the bursts evict it unpinned (hit rate < 50% under lru)": sv["lru, not pinned"]["hot_hit_rate"] < 0.5,
            "workloads that never pin: hit rate unchanged": c["hit_rate_ratio"] == 1.0,
            "workloads that never pin: pin bookkeeping < 1% of a step": c["bookkeeping_share"] < 0.01}


def run(model: str = "default", scale: Scale = FULL, quick: bool = False, log=print) -> dict:
    probe = PinRunner(model, num_kv_blocks=64)
    vocab, tokenizer = probe.core.vocab_size, probe.core.tokenizer
    probe(tokens(256, 0, vocab))  # first forwards pay for allocations: not in any figure
    del probe
    log(f"[pins {time.strftime('%H:%M:%S')}] survive")
    results = {"survive": survive(model, vocab, scale)}
    log(f"[pins {time.strftime('%H:%M:%S')}] cost")
    results["cost"] = cost(model, tokenizer, scale, quick)
    results["targets"] = targets(results)
    return results


def render(r: dict) -> str:
    lines = ["survive (a ~1,000-token system prompt between bursts of documents asked about twice)",
             "  variant             hot hit rate  hot TTFT p50  hot TTFT p99  evictions  prefill computed"]
    for name, x in r["survive"].items():
        lines.append(f"  {name:18}  {x['hot_hit_rate']:11.1%}  {x['hot_ttft_p50_s']:11.3f}s  "
                     f"{x['hot_ttft_p99_s']:11.3f}s  {x['evictions']:9d}  {x['prefill_computed']:16d}")
    c = r["cost"]
    lines += [f"cost on a workload that never pins ({c['workload']}, median of alternating runs)",
              "  variant             output tok/s  hit rate"]
    for variant in ("as shipped", "without pin hooks"):
        x = c[variant]
        lines.append(f"  {variant:18}  {x['output_tok_s']:12.1f}  {x['hit_rate']:8.1%}")
    spread = [f"{x:.1f}" for x in c["as shipped"]["output_tok_s_runs"] + c["without pin hooks"]["output_tok_s_runs"]]
    lines += [f"  as shipped / without: {c['tok_s_ratio']:.3f}x tok/s (single runs: {', '.join(spread)}), "
              f"{c['hit_rate_ratio']:.3f}x hit rate",
              f"  pin bookkeeping per step: {c['bookkeeping_per_step_s'] * 1e6:.2f} us of a {c['mean_step_s'] * 1e3:.1f} ms "
              f"step ({c['bookkeeping_share']:.4%})", "targets"]
    lines += [f"  [{'met' if ok else 'MISSED'}] {name}" for name, ok in r["targets"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "pins", __doc__.splitlines()[0],
               lambda model, quick: run(model, QUICK if quick else FULL, quick), render)
