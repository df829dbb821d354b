"""Cache tiers, side by side in one run: `python -m bench tiers [--quick] [--model PATH] [--out DIR]`.

1. scan: rounds of one request with a hot ~1,000-token system prompt (and a short unique question), then a
   burst of unique long prompts, into a pool that holds the hot prefix plus about two long prompts: lru vs slru.
2. disk: prefixes cycling through a pool too small for them, without and with the disk tier.
3. restart: TTFT of a prompt cold, warm (RAM hit), and first thing after a restart (disk tier).
4. policies: prompt tokens hit by lru and slru on every `bench` workload, simulated (the KV cache
   manager without a model: requests one at a time in arrival order) at several pool sizes.

Requests run one at a time (closed loop), so TTFT is the request's own prefill, not queueing.
Timings on a shared machine are noisy: every figure is a median (p99 where named) of several requests.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import driver  # noqa: F401  (loads the weights once per process for every engine below)
from bench import workloads
from bench.oracle import oracle_prefill_tokens
from bench.suite import ALL_WORKLOADS
from engine.config import EngineConfig, EvictionPolicy
from engine.core import EngineCore
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Scale:
    hot_tokens: int = 1000
    long_tokens: int = 1000
    question_tokens: int = 24
    scan_rounds: int = 12  # one hot request, then a burst
    burst: int = 3
    scan_pool_blocks: int = 200  # hot prefix (63) + about two long prompts in flight
    disk_prefixes: int = 4
    disk_rounds: int = 3
    disk_pool_blocks: int = 128  # two of the four prefixes
    restart_trials: int = 3
    policy_workloads: tuple[str, ...] = ALL_WORKLOADS
    policy_pools: tuple[int, ...] = (64, 128, 256, 512)  # blocks (raised to fit the longest prompt)


FULL = Scale()
QUICK = Scale(scan_rounds=6, disk_rounds=2, restart_trials=2)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Runner:
    """One engine, one request at a time: returns TTFT and cached tokens of each prompt."""

    def __init__(self, model: str, **overrides) -> None:
        self.core = EngineCore(EngineConfig(model=model, max_num_batched_tokens=2048, **overrides))
        self._ids = 0
        self.computed = 0

    def __call__(self, prompt: list[int]) -> tuple[float, int]:
        self._ids += 1
        request = Request(f"t{self._ids}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        self.core.add_request(request)
        while self.core.has_unfinished():
            _, stats = self.core.step()
            self.computed += stats.num_prompt_tokens
        return time.perf_counter() - start, request.num_cached_tokens


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def scan(model: str, vocab: int, s: Scale) -> dict:
    hot = tokens(s.hot_tokens, 1, vocab)
    hot_hittable = (s.hot_tokens // BLOCK) * BLOCK
    results = {}
    for policy in ("lru", "slru"):
        run = Runner(model, num_kv_blocks=s.scan_pool_blocks, eviction_policy=policy)
        ttfts, cached, seed = [], [], 1000
        run(hot + tokens(s.question_tokens, 0, vocab))  # the cold first request: not counted
        for _ in range(s.scan_rounds):
            seed += 1
            ttft, hit = run(hot + tokens(s.question_tokens, seed, vocab))
            ttfts.append(ttft)
            cached.append(min(hit, hot_hittable))
            for _ in range(s.burst):
                seed += 1
                run(tokens(s.long_tokens, seed, vocab))
        results[policy] = {"hot_hit_rate": sum(cached) / (hot_hittable * len(cached)),
                           "hot_ttft_p50_s": p(ttfts, 0.5), "hot_ttft_p99_s": p(ttfts, 0.99),
                           "hot_requests": len(ttfts), "evictions": run.core.kv.pool.num_evictions,
                           "prefill_computed": run.computed}
    return results


def disk(model: str, vocab: int, s: Scale) -> dict:
    prefixes = [tokens(s.hot_tokens, 50 + i, vocab) for i in range(s.disk_prefixes)]
    prompts = [prefixes[i] + tokens(s.question_tokens, 500 + r * 10 + i, vocab)
               for r in range(s.disk_rounds) for i in range(s.disk_prefixes)]
    results = {"oracle_prefill": oracle_prefill_tokens(prompts, BLOCK)}
    for variant in ("ram only", "ram + disk"):
        with tempfile.TemporaryDirectory() as disk_dir:
            extra = {"kv_disk_dir": disk_dir} if variant == "ram + disk" else {}
            run = Runner(model, num_kv_blocks=s.disk_pool_blocks, **extra)
            first = [run(q)[0] for q in prompts[:s.disk_prefixes]]
            repeats = [run(q) for q in prompts[s.disk_prefixes:]]
            stats = run.core.prefix_cache_stats()
            run.core.close()
        results[variant] = {"prefill_computed": run.computed, "first_ttft_p50_s": p(first, 0.5),
                            "repeat_ttft_p50_s": p([t for t, _ in repeats], 0.5),
                            "repeat_ttft_p99_s": p([t for t, _ in repeats], 0.99),
                            "repeat_cached_tokens": sum(c for _, c in repeats), "disk_hit_tokens": stats.disk_hits}
    results["disk_ttft_vs_recompute"] = (results["ram + disk"]["repeat_ttft_p50_s"]
                                         / results["ram only"]["repeat_ttft_p50_s"])
    return results


def restart(model: str, vocab: int, s: Scale) -> dict:
    cold, warm, after = [], [], []
    for trial in range(s.restart_trials):
        prefix = tokens(s.hot_tokens, 900 + trial, vocab)
        with tempfile.TemporaryDirectory() as disk_dir:
            run = Runner(model, num_kv_blocks=s.disk_pool_blocks, kv_disk_dir=disk_dir)
            cold.append(run(prefix + tokens(s.question_tokens, 1, vocab))[0])
            warm.append(run(prefix + tokens(s.question_tokens, 2, vocab))[0])
            run.core.close()
            restarted = Runner(model, num_kv_blocks=s.disk_pool_blocks, kv_disk_dir=disk_dir)
            ttft, cached = restarted(prefix + tokens(s.question_tokens, 3, vocab))
            assert cached == (s.hot_tokens // BLOCK) * BLOCK, "the first request after a restart missed"
            after.append(ttft)
            restarted.core.close()
    results = {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
               "restart_ttft_s": statistics.median(after), "trials": s.restart_trials}
    results["restart_vs_warm"] = results["restart_ttft_s"] / results["warm_ttft_s"]
    return results


def simulated_hits(prompts: list[list[int]], num_blocks: int, policy: EvictionPolicy) -> int:
    kv = KVCacheManager(num_blocks, BLOCK, eviction_policy=policy)
    for i, prompt in enumerate(prompts):
        request = Request(f"s{i}", prompt, SamplingParams(max_tokens=1))
        prefix = kv.find_cached_prefix(request)
        assert kv.allocate(request, len(prompt) - prefix.num_tokens, prefix)
        kv.record_lookup(request, prefix)
        request.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(request)
        kv.free(request)
    return kv.num_hit_tokens


def policies(tokenizer, s: Scale) -> dict:
    """Hit tokens per workload and pool size; slru relative to lru."""
    results = {}
    for name in s.policy_workloads:
        w = workloads.build(name, tokenizer, workloads.FULL)
        prompts = [r.prompt_token_ids for r in sorted(w.requests, key=lambda r: r.arrival_s)]
        longest = -(-max(map(len, prompts)) // BLOCK) + 1
        for blocks in sorted({max(b, longest) for b in s.policy_pools}):
            lru, slru = (simulated_hits(prompts, blocks, p) for p in (EvictionPolicy.LRU, EvictionPolicy.SLRU))
            results[f"{name}/{blocks}"] = {"lru": lru, "slru": slru, "slru_vs_lru": slru / lru if lru else 1.0}
    return results


def targets(r: dict) -> dict:
    lru, slru = r["scan"]["lru"]["hot_hit_rate"], r["scan"]["slru"]["hot_hit_rate"]
    slru_never_loses = min(x["slru_vs_lru"] for x in r["policies"].values()) >= 0.98
    default = EngineConfig().eviction_policy
    return {"slru keeps >= 90% of the hot prefix's hits": slru >= 0.9,
            "lru loses most of them (< 50%)": lru < 0.5,
            "disk-hit TTFT <= 25% of recomputing": r["disk"]["disk_ttft_vs_recompute"] <= 0.25,
            "first request after a restart within 1.5x a warm one": r["restart"]["restart_vs_warm"] <= 1.5,
            f"default eviction policy {default.value}, by the issue's rule: slru if it never loses more than 2% "
            "of lru's hits (simulated, every workload and pool)": slru_never_loses == (default is EvictionPolicy.SLRU)}


def run(model: str = "default", scale: Scale = FULL, log=print) -> dict:
    probe = Runner(model, num_kv_blocks=64)
    vocab = probe.core.vocab_size
    probe(tokens(256, 0, vocab))  # first forwards pay for allocations: not in any figure
    tokenizer = probe.core.tokenizer
    del probe
    log(f"[tiers {time.strftime('%H:%M:%S')}] policies (simulated)")
    results = {"policies": policies(tokenizer, scale)}
    for name, fn in (("scan", scan), ("disk", disk), ("restart", restart)):
        log(f"[tiers {time.strftime('%H:%M:%S')}] {name}")
        results[name] = fn(model, vocab, scale)
    results["targets"] = targets(results)
    return results


def render(r: dict) -> str:
    sc, dk, rs = r["scan"], r["disk"], r["restart"]
    lines = ["scan (hot prefix between bursts of unique long prompts)",
             "  policy  hot hit rate  hot TTFT p50  hot TTFT p99  evictions"]
    for policy in ("lru", "slru"):
        x = sc[policy]
        lines.append(f"  {policy:6}  {x['hot_hit_rate']:11.1%}  {x['hot_ttft_p50_s']:11.3f}s  "
                     f"{x['hot_ttft_p99_s']:11.3f}s  {x['evictions']:9d}")
    lines += [f"disk (pool too small for the working set; oracle prefill {dk['oracle_prefill']} tokens)",
              "  variant      prefill computed  repeat TTFT p50  repeat TTFT p99  disk-hit tokens"]
    for variant in ("ram only", "ram + disk"):
        x = dk[variant]
        lines.append(f"  {variant:11}  {x['prefill_computed']:16d}  {x['repeat_ttft_p50_s']:14.3f}s  "
                     f"{x['repeat_ttft_p99_s']:14.3f}s  {x['disk_hit_tokens']:15d}")
    lines.append(f"  disk-hit TTFT / recompute TTFT: {dk['disk_ttft_vs_recompute']:.1%}")
    lines.append("policies (simulated prompt tokens hit; workload/pool blocks: lru, slru, slru/lru)")
    lines += [f"  {k:20} {x['lru']:8d} {x['slru']:8d} {x['slru_vs_lru']:7.1%}" for k, x in r["policies"].items()]
    lines += [f"restart (median of {rs['trials']}): cold {rs['cold_ttft_s']:.3f}s, warm {rs['warm_ttft_s']:.3f}s, "
              f"first after restart {rs['restart_ttft_s']:.3f}s ({rs['restart_vs_warm']:.2f}x warm)", "targets"]
    lines += [f"  [{'met' if ok else 'MISSED'}] {name}" for name, ok in r["targets"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "tiers", __doc__.splitlines()[0], lambda model, quick: run(model, QUICK if quick else FULL),
               render)


def cli(argv: list[str] | None, name: str, description: str, run_fn, render_fn) -> int:
    """`python -m bench NAME [--quick] [--model PATH] [--out DIR]`: runs, writes NAME.json, prints the table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench {name}", description=description)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    results = run_fn(args.model, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(render_fn(results))
    print(f"results in {out / f'{name}.json'}; a shared machine: timings are medians and still noisy")
    return 0
