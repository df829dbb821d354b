"""`python -m bench cluster`: 4 engine replicas on a local Ray Serve under three routers, one run.

Trace: several tenants, each with its own system prompt, and multi-turn chats on top (each turn's
prompt is the previous prompt + the answer + a new user message), more distinct prefix blocks
than one replica's pool holds. The same trace runs under round robin, Ray's default (power of two
choices) and the prefix-affinity router, and on one replica with 4x the pool as the reference.
Reports hit rate, computed prefill tokens against the oracle, TTFT p50/p99 and load spread.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.oracle import oracle_prefill_tokens

ROUTERS = {"round_robin": "cluster.router:RoundRobinRouter", "pow2": "cluster.router:PowerOfTwoRouter",
           "prefix": "cluster.router:PrefixAffinityRouter"}

RANDOM_MODELS = {"tiny": {}, "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                           num_attention_heads=8, num_key_value_heads=4, head_dim=32)}


@dataclass(slots=True)
class Chat:
    tenant: int
    system: list[int]
    user_turns: list[list[int]]


@dataclass(slots=True)
class RunResult:
    name: str
    replicas: int = 1  # as deployed: one that served nothing still counts in the load spread
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    per_replica: Counter = field(default_factory=Counter)
    prompts: list[list[int]] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def summary(self, block_size: int) -> dict:
        loads = sorted(self.per_replica.values(), reverse=True)
        loads += [0] * (self.replicas - len(loads))  # idle replicas: 96 requests on 1 of 4 is 4.0, not 1.0
        mean = sum(loads) / len(loads)
        ttfts = sorted(self.ttfts)
        return {"router": self.name, "hit_rate": self.cached_tokens / self.prompt_tokens,
                "computed_prefill_tokens": self.prompt_tokens - self.cached_tokens,
                "oracle_prefill_tokens": oracle_prefill_tokens(self.prompts, block_size),
                "ttft_p50_ms": 1000 * statistics.median(ttfts),
                "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
                "requests_per_replica": loads, "max_over_mean_load": max(loads) / mean,
                "decisions": self.decisions, "wall_s": self.wall_s}


def build_trace(tenants: int, chats_per_tenant: int, turns: int, system_tokens: int, user_tokens: int,
                vocab: int, seed: int = 0) -> list[Chat]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(20, vocab) for _ in range(n)]  # noqa: E731
    systems = [words(system_tokens) for _ in range(tenants)]
    chats = [Chat(t, systems[t], [words(user_tokens) for _ in range(turns)])
             for t in range(tenants) for _ in range(chats_per_tenant)]
    rng.shuffle(chats)
    return chats


async def run_trace(client, chats: list[Chat], concurrency: int, max_tokens: int, name: str) -> RunResult:
    from engine.sampling_params import SamplingParams

    result = RunResult(name, client.num_replicas)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    queue = list(enumerate(chats))

    async def user() -> None:
        while queue:
            index, chat = queue.pop(0)
            history = list(chat.system)
            for turn, message in enumerate(chat.user_turns):
                prompt = history + message
                request_id = f"{name}-{index}-{turn}"
                start, first, answer = time.perf_counter(), None, []
                async for out in client.generate(request_id, prompt, params, cache_salt=f"tenant-{chat.tenant}"):
                    if first is None:
                        first = time.perf_counter() - start
                        result.per_replica[client.served_by(request_id)] += 1
                    answer.extend(out.new_token_ids)
                    if out.finished:
                        if out.finish_reason == "error":
                            raise RuntimeError(out.error)
                        result.cached_tokens += out.num_cached_tokens
                result.prompt_tokens += len(prompt)
                result.ttfts.append(first)
                result.prompts.append(prompt)
                history = prompt + answer

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - start
    result.decisions = client.routing_decisions() if name == "prefix" else {}
    return result


def run_one(config, chats, name: str, router: str, replicas: int, args) -> RunResult:
    from ray import serve

    from cluster.client import ClusterEngine
    from cluster.replica import deployment

    app = f"bench-{name}"
    handle = serve.run(deployment(config, replicas, router, index=app, max_load_spread=args.max_load_spread,
                                  max_ongoing_requests=64), name=app, route_prefix=None)
    try:
        async def go() -> RunResult:
            client = await ClusterEngine.connect(handle, config, index=app, num_replicas=replicas)
            client.start()
            return await run_trace(client, chats, args.concurrency, args.max_tokens, name)
        return asyncio.run(go())
    finally:
        serve.delete(app)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__)
    parser.add_argument("--model", default="small",
                        help="'tiny' or 'small' (random-weight Llamas built here; small: prefill costs enough for "
                             "TTFT to show cache hits), 'default' (SmolLM2-135M), or a path")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--blocks-per-replica", type=int, default=64, help="KV pool of each replica (blocks)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--chats-per-tenant", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="chats in flight at once")
    parser.add_argument("--max-load-spread", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cluster.json"))
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from engine.config import EngineConfig

    model = args.model
    if model in RANDOM_MODELS:
        from bench.tiny_models import build_tiny_model  # seconds, offline
        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-cluster-")) / model,
                                     **RANDOM_MODELS[model]))
    config = EngineConfig(model=model, block_size=args.block_size, num_kv_blocks=args.blocks_per_replica,
                          max_num_seqs=8, threads=1, threads_batch=1, max_model_len=2048)
    vocab = 400 if args.model in RANDOM_MODELS else 40000
    chats = build_trace(args.tenants, args.chats_per_tenant, args.turns, args.system_tokens, args.user_tokens, vocab)
    ray.init(include_dashboard=False, namespace="prefixgate-bench", log_to_driver=False)
    serve.start(proxy_location="Disabled")
    results = []
    try:
        reference = config.replace(num_kv_blocks=args.blocks_per_replica * args.replicas)
        results.append(run_one(reference, chats, "one_replica_4x_pool", ROUTERS["prefix"], 1, args))
        for name, router in ROUTERS.items():
            results.append(run_one(config, chats, name, router, args.replicas, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    summaries = [r.summary(args.block_size) for r in results]
    report = {"model": args.model, "args": vars(args), "runs": summaries, "targets": targets(summaries)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(render(report))
    return 0


def targets(summaries: list[dict]) -> dict:
    by = {s["router"]: s for s in summaries}
    ours, ref, rr, p2 = by["prefix"], by["one_replica_4x_pool"], by["round_robin"], by["pow2"]
    return {
        "hit rate within 5% of one replica with 4x the pool": ours["hit_rate"] >= 0.95 * ref["hit_rate"],
        "hit rate at least 2x round robin's": ours["hit_rate"] >= 2 * rr["hit_rate"],
        "TTFT p50 below power of two's": ours["ttft_p50_ms"] < p2["ttft_p50_ms"],
        "no replica above 1.5x the mean load": ours["max_over_mean_load"] <= 1.5,
    }


def render(report: dict) -> str:
    lines = [f"{'router':<22}{'hit rate':>9}{'computed':>10}{'oracle':>8}{'TTFT p50':>10}{'p99':>9}"
             f"{'max/mean':>9}  requests per replica"]
    for s in report["runs"]:
        lines.append(f"{s['router']:<22}{s['hit_rate']:>9.3f}{s['computed_prefill_tokens']:>10}"
                     f"{s['oracle_prefill_tokens']:>8}{s['ttft_p50_ms']:>8.1f}ms{s['ttft_p99_ms']:>7.1f}ms"
                     f"{s['max_over_mean_load']:>9.2f}  {s['requests_per_replica']}")
    prefix = next(s for s in report["runs"] if s["router"] == "prefix")
    lines.append(f"prefix router decisions: {prefix['decisions']}")
    lines += [f"[{'met' if ok else 'MISSED'}] {name}" for name, ok in report["targets"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
