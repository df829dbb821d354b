"""`python -m bench cluster`: engine replicas on a local Ray Serve under four routers, side by side.

    python -m bench cluster --model small --replicas 4 --repeats 2      # random-weight Llama (8 layers)
    python -m bench cluster --model default --replicas 2 --repeats 2 \
        --first-user-tokens 384 --blocks-per-replica 192 --concurrency 8 --think-s 1  # SmolLM2-135M-Instruct

Trace (seeded): system prompts with Zipf popularity, the exponent solved so that the hottest one carries
`--hot-load` x one replica's share (1/N) of the chats; every `--public-every`-th prompt by rank, the
hottest included, is public: several tenants use it under one shared salt, the others are private to
one tenant (its own salt). Multi-turn chats on top (8 turns; each turn's prompt is the previous prompt +
the answer + a new user message), so most of a prompt is its chat's history: what a router that sends a
chat's turns to different replicas computes again, and what every replica must hold for every chat in
flight (more than its pool) when turns are spread; more distinct system-prompt blocks than one pool holds.
With `--first-user-tokens` a chat opens with a document of its own that its later turns ask about: each
history is then mostly that chat's own, so a router that spreads a chat's turns needs every chat in every
pool, and a pool smaller than that separates the routers (docs/scale-out.md). With `--think-s` each user
pauses before a next turn, as people read an answer before they reply.

Runs: round robin, Ray's default (power of two choices), Ray's PrefixCacheAffinityRouter and ours, and
the reference, one replica with the whole pool (N x blocks, N x max_num_seqs), whose hit rate is the
ceiling. Every run starts on fresh replicas; `--repeats R` runs each of them R times, in an order
rotated each round. Reports, as the mean over repeats and each repeat's value: hit rate, computed
prefill tokens against the oracle, TTFT p50/p99, and the load spread (max/mean over all N replicas, idle
ones included) of requests and of KV use (prompt tokens each replica computed into its KV cache).
Writes the JSON (every run's numbers) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.oracle import oracle_prefill_tokens
from cluster.prefix_index import DEFAULT_MEAN_LOAD_FACTOR

REFERENCE = "one_replica"  # one replica with the whole pool: the hit-rate ceiling
ROUTER_RUNS = ("round_robin", "pow2", "ray_prefix", "prefix")  # keys of cluster/__main__.py's ROUTERS
OURS = "prefix"
PUBLIC_SALT = "public"  # the salt tenants share for public prompts (the gateway's share_public_salt)
MAX_LOAD_SPREAD = 1.25  # target: max/mean of requests and of KV use over the replicas
SPECIAL_IDS = 20  # trace tokens start above the tokenizers' special ids

RANDOM_MODELS = {"tiny": {}, "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                           num_attention_heads=8, num_key_value_heads=4, head_dim=32)}


# ---- the trace

@dataclass(slots=True)
class Chat:
    tenant: int
    prefix: int  # the system prompt's popularity rank (0: the hottest)
    salt: str
    system: list[int]
    user_turns: list[list[int]]
    think_s: list[float]  # the user's pause before each turn (reading the last answer); 0 before the first


def zipf_exponent(num_prefixes: int, hot_share: float) -> float:
    """The exponent s for which rank 1 of weights k^-s (k = 1..num_prefixes) carries `hot_share`."""
    if not 1 / num_prefixes < hot_share < 1:
        raise ValueError(f"a hot share of {hot_share:.3f} is impossible over {num_prefixes} prefixes")
    low, high = 0.0, 16.0
    for _ in range(60):  # the top share grows with s: bisect
        s = (low + high) / 2
        if 1 / sum(k ** -s for k in range(1, num_prefixes + 1)) < hot_share:
            low = s
        else:
            high = s
    return (low + high) / 2


def zipf_counts(num_items: int, num_prefixes: int, s: float) -> list[int]:
    """Items per prefix rank in Zipf proportions, rounded by largest remainder (they sum to num_items), so
    the trace's hot share is the asked one whatever the seed."""
    weights = [k ** -s for k in range(1, num_prefixes + 1)]
    exact = [num_items * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(num_prefixes), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[:num_items - sum(counts)]:
        counts[k] += 1
    return counts


def is_public(rank: int, public_every: int) -> bool:
    return public_every > 0 and rank % public_every == 0


def build_trace(*, chats: int, prefixes: int, tenants: int, public_every: int, hot_share: float, turns: int,
                system_tokens: int, user_tokens: int, vocab_size: int, seed: int = 0,
                first_user_tokens: int | None = None, think_s: float = 0.0) -> list[Chat]:
    """Chats in arrival order. A public prompt's chats come from tenants drawn at random (one salt for
    all); a private prompt belongs to tenant rank % tenants. A chat's first message has `first_user_tokens`
    (a pasted document, say; default `user_tokens`), its later ones `user_tokens`. Before each later turn
    its user pauses for an exponential time of mean `think_s` (0: sends it the moment the answer ends)."""
    first_user_tokens = user_tokens if first_user_tokens is None else first_user_tokens
    rng = random.Random(seed)
    pauses = random.Random(f"{seed}/think")  # its own stream: a trace with pauses has the same tokens
    pause = lambda turn: pauses.expovariate(1 / think_s) if turn and think_s else 0.0  # noqa: E731
    words = lambda n: [rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(n)]  # noqa: E731
    systems = [words(system_tokens) for _ in range(prefixes)]
    counts = zipf_counts(chats, prefixes, zipf_exponent(prefixes, hot_share))
    trace = []
    for rank, count in enumerate(counts):
        for _ in range(count):
            public = is_public(rank, public_every)
            tenant = rng.randrange(tenants) if public else rank % tenants
            trace.append(Chat(tenant, rank, PUBLIC_SALT if public else f"tenant-{tenant}", systems[rank],
                              [words(first_user_tokens if turn == 0 else user_tokens) for turn in range(turns)],
                              [pause(turn) for turn in range(turns)]))
    rng.shuffle(trace)
    return trace


def describe_trace(trace: list[Chat], block_size: int) -> dict:
    """What the trace is made of: popularity, sharing, and how many system-prompt blocks it holds."""
    per_prefix = Counter(c.prefix for c in trace)
    public = sorted({c.prefix for c in trace if c.salt == PUBLIC_SALT})
    system_blocks = sum(len(c.system) // block_size for c in {c.prefix: c for c in trace}.values())
    return {"chats": len(trace), "requests": sum(len(c.user_turns) for c in trace),
            "prefixes": len(per_prefix), "tenants": len({c.tenant for c in trace}),
            "chats_per_prefix": [per_prefix[k] for k in sorted(per_prefix)],
            "hot_share": max(per_prefix.values()) / len(trace),
            "public_prefixes": public,
            "tenants_per_public_prefix": [len({c.tenant for c in trace if c.prefix == k}) for k in public],
            "system_prompt_blocks": system_blocks,
            "mean_think_s": statistics.fmean([s for c in trace for s in c.think_s[1:]] or [0.0])}


# ---- one run

@dataclass(slots=True)
class RunResult:
    name: str
    replicas: int = 1  # as deployed: one that served nothing still counts in the load spread
    repeat: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    per_replica: Counter = field(default_factory=Counter)  # replica -> requests it served
    kv_per_replica: dict = field(default_factory=dict)  # replica -> prompt tokens it computed into its KV cache
    prompts: list[list[int]] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    deploy_s: float = 0.0
    wall_s: float = 0.0
    other_cores: float = 0.0  # CPU cores busy outside the bench during the trace (a shared machine)

    def summary(self, block_size: int) -> dict:
        requests, request_spread = load_spread(self.per_replica, self.replicas)
        kv, kv_spread = load_spread(self.kv_per_replica, self.replicas)
        ttfts = sorted(self.ttfts)
        return {"router": self.name, "repeat": self.repeat, "replicas": self.replicas,
                "hit_rate": self.cached_tokens / self.prompt_tokens,
                "computed_prefill_tokens": self.prompt_tokens - self.cached_tokens,
                "oracle_prefill_tokens": oracle_prefill_tokens(self.prompts, block_size),
                "ttft_p50_ms": 1000 * statistics.median(ttfts),
                "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
                "requests_per_replica": requests, "request_spread": request_spread,
                "kv_tokens_per_replica": kv, "kv_spread": kv_spread,
                "decisions": self.decisions, "deploy_s": self.deploy_s, "wall_s": self.wall_s,
                "other_cores": self.other_cores}


def load_spread(per_replica: dict, replicas: int) -> tuple[list[int], float]:
    """Each replica's load, highest first, and max/mean over all `replicas` of them: one that did nothing
    counts as 0 (96 requests on 1 of 4 replicas is 4.0, not 1.0)."""
    loads = sorted(per_replica.values(), reverse=True)
    loads += [0] * (replicas - len(loads))
    mean = sum(loads) / len(loads)
    return loads, max(loads) / mean if mean else 1.0


async def run_trace(client, trace: list[Chat], concurrency: int, max_tokens: int, result: RunResult) -> None:
    """Closed loop: `concurrency` users each take the next chat and send its turns one after another, each
    after the trace's pause."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    queue = list(enumerate(trace))

    async def user() -> None:
        while queue:
            index, chat = queue.pop(0)
            history = list(chat.system)
            for turn, message in enumerate(chat.user_turns):
                if chat.think_s[turn]:
                    await asyncio.sleep(chat.think_s[turn])
                prompt = history + message
                request_id = f"{result.name}-{result.repeat}-{index}-{turn}"
                start, first, answer = time.perf_counter(), None, []
                async for out in client.generate(request_id, prompt, params, cache_salt=chat.salt):
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

    start, cpu = time.perf_counter(), cpu_seconds()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - start
    result.other_cores = cores_used_elsewhere(cpu, cpu_seconds(), result.wall_s)
    # every request's last output carried its replica's snapshot, taken after the request was admitted
    result.kv_per_replica = {r: s.prefix_cache.queries - s.prefix_cache.hits
                             for r, s in client.replica_snapshots().items()}
    if result.name == OURS:
        result.decisions = client.routing_decisions()


def cpu_seconds() -> tuple[float, dict[int, float]]:
    """CPU seconds the machine has spent, and each process of this tree (Ray, the replicas) has."""
    import psutil

    machine = psutil.cpu_times()
    tree = {}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
            tree[process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return machine.user + machine.nice + machine.system, tree


def cores_used_elsewhere(before: tuple[float, dict[int, float]], after: tuple[float, dict[int, float]],
                         wall_s: float) -> float:
    """Cores busy outside this process tree between two `cpu_seconds()`: other work on a shared machine."""
    ours = sum(cpu - before[1].get(pid, 0.0) for pid, cpu in after[1].items())
    return max(0.0, (after[0] - before[0] - ours) / wall_s)


def run_one(config, trace: list[Chat], name: str, repeat: int, args) -> RunResult:
    """One run on fresh replicas (empty caches), deployed for it and deleted after."""
    from ray import serve

    from cluster import kv_event_log
    from cluster.__main__ import ROUTERS
    from cluster.client import ClusterEngine
    from cluster.replica import deployment

    replicas = 1 if name == REFERENCE else args.replicas
    if name == REFERENCE:
        config = config.replace(num_kv_blocks=config.num_kv_blocks * args.replicas,
                                max_num_seqs=config.max_num_seqs * args.replicas)
    app = f"bench-{name}-{repeat}"  # its own router index, KV event log and Ray's prefix tree per run
    router = ROUTERS["round_robin" if name == REFERENCE else name]
    result = RunResult(name, replicas, repeat)
    start = time.perf_counter()
    handle = serve.run(deployment(config, replicas, router, index=app, mean_load_factor=args.mean_load_factor,
                                  max_ongoing_requests=max(config.max_num_seqs * 4, 8)),
                       name=app, route_prefix=None)
    try:
        async def go() -> None:
            client = await ClusterEngine.connect(handle, config, index=app, num_replicas=replicas)
            client.start()
            result.deploy_s = time.perf_counter() - start
            try:
                await run_trace(client, trace, args.concurrency, args.max_tokens, result)
            finally:
                await client.shutdown()
        asyncio.run(go())
    finally:
        serve.delete(app)
        kv_event_log.remove(app)
    return result


def run_order(names: tuple[str, ...], round_index: int) -> list[str]:
    """Round r runs the list rotated by r, so that no run always goes first (on a cold machine) or last."""
    shift = round_index % len(names)
    return list(names[shift:] + names[:shift])


# ---- summaries and targets

METRICS = ("hit_rate", "computed_prefill_tokens", "oracle_prefill_tokens", "ttft_p50_ms", "ttft_p99_ms",
           "request_spread", "kv_spread", "wall_s")


def aggregate(summaries: list[dict]) -> dict[str, dict[str, dict]]:
    """Per run name and metric: the mean over repeats and each repeat's value (in repeat order)."""
    out: dict[str, dict[str, dict]] = {}
    for name in dict.fromkeys(s["router"] for s in summaries):
        runs = sorted((s for s in summaries if s["router"] == name), key=lambda s: s["repeat"])
        out[name] = {m: {"mean": statistics.fmean(s[m] for s in runs), "repeats": [s[m] for s in runs]}
                     for m in METRICS}
    return out


def targets(means: dict[str, dict[str, dict]]) -> list[dict]:
    """Issue 29's targets for our router, from the means over repeats (those whose baseline ran)."""
    ours = {m: v["mean"] for m, v in means[OURS].items()}
    ran = lambda name, metric: (means[name][metric]["mean"] if name in means else None)  # noqa: E731
    ref, rr, ray = ran(REFERENCE, "hit_rate"), ran("round_robin", "hit_rate"), ran("ray_prefix", "hit_rate")
    p2 = ran("pow2", "ttft_p50_ms")
    rows = [("hit rate within 5% of one replica with the whole pool", ours["hit_rate"], ref,
             lambda: ours["hit_rate"] >= 0.95 * ref),
            ("hit rate at least 2x round robin's", ours["hit_rate"], rr, lambda: ours["hit_rate"] >= 2 * rr),
            ("hit rate at least Ray's prefix router's", ours["hit_rate"], ray, lambda: ours["hit_rate"] >= ray),
            (f"requests max/mean over all replicas <= {MAX_LOAD_SPREAD}", ours["request_spread"], MAX_LOAD_SPREAD,
             lambda: ours["request_spread"] <= MAX_LOAD_SPREAD),
            (f"KV use max/mean over all replicas <= {MAX_LOAD_SPREAD}", ours["kv_spread"], MAX_LOAD_SPREAD,
             lambda: ours["kv_spread"] <= MAX_LOAD_SPREAD),
            ("TTFT p50 below power of two's (ms)", ours["ttft_p50_ms"], p2, lambda: ours["ttft_p50_ms"] < p2)]
    return [{"target": t, "ours": o, "against": a, "met": met()} for t, o, a, met in rows if a is not None]


# ---- output

def render(report: dict) -> str:
    t, a = report["trace"], report["args"]
    lines = [f"trace: {t['chats']} chats ({t['requests']} requests) over {t['prefixes']} system prompts, Zipf "
             f"s={report['zipf_s']:.2f}, hottest {t['hot_share']:.1%} of chats (one replica's share "
             f"{1 / a['replicas']:.1%}); public prompts {t['public_prefixes']} used by "
             f"{t['tenants_per_public_prefix']} tenants; {t['system_prompt_blocks']} system-prompt blocks, "
             f"{a['blocks_per_replica']} per replica pool",
             f"{a['turns']}-turn chats: system prompt {a['system_tokens']}, first message "
             f"{a['first_user_tokens'] or a['user_tokens']}, later ones {a['user_tokens']}, answers {a['max_tokens']} "
             f"tokens; {a['concurrency']} chats in flight, pausing {t['mean_think_s']:.2f} s on average "
             "before a next turn",
             "mean over repeats [each repeat]; KV use = prompt tokens each replica computed into its KV cache",
             f"{'run':<12}{'hit rate':>22}{'computed':>9}{'oracle':>8}{'TTFT p50 ms':>22}{'p99 ms':>8}"
             f"{'requests max/mean':>24}{'KV max/mean':>22}"]
    for name, m in report["routers"].items():
        lines.append(f"{name:<12}{_cell(m['hit_rate'], '.3f'):>22}{m['computed_prefill_tokens']['mean']:>9.0f}"
                     f"{m['oracle_prefill_tokens']['mean']:>8.0f}{_cell(m['ttft_p50_ms'], '.0f'):>22}"
                     f"{m['ttft_p99_ms']['mean']:>8.0f}{_cell(m['request_spread'], '.2f'):>24}"
                     f"{_cell(m['kv_spread'], '.2f'):>22}")
    for s in report["runs"]:
        lines.append(f"  round {s['repeat']} #{s['order']} {s['router']:<12} requests {s['requests_per_replica']}"
                     f" KV tokens {s['kv_tokens_per_replica']} deploy {s['deploy_s']:.0f} s trace {s['wall_s']:.0f} s"
                     f" (other work: {s['other_cores']:.2f} cores)"
                     + (f" {s['decisions']}" if s["decisions"] else ""))
    lines += [f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['ours']:.3f} vs {t['against']:.3f}"
              for t in report["targets"]]
    return "\n".join(lines)


def _cell(metric: dict, fmt: str) -> str:
    return f"{metric['mean']:{fmt}} [{', '.join(f'{v:{fmt}}' for v in metric['repeats'])}]"


def plot(report: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["routers"])
    panels = [("hit_rate", "hit rate (prompt tokens)"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("request_spread", "requests: max/mean over replicas"), ("kv_spread", "KV use: max/mean over replicas")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (metric, title) in zip(axes, panels):
        means = [report["routers"][n][metric]["mean"] for n in names]
        ax.bar(names, means, color=["#888888" if n == REFERENCE else "#d08040" if n == OURS else "#4878a8"
                                    for n in names])
        for i, n in enumerate(names):  # each repeat as a dot over its mean
            values = report["routers"][n][metric]["repeats"]
            ax.plot([i] * len(values), values, "k.", markersize=5)
        if metric.endswith("spread"):
            ax.axhline(MAX_LOAD_SPREAD, color="red", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"bench cluster: {report['model']}, {report['args']['replicas']} replicas, "
                 f"{report['args']['repeats']} repeats (bars: mean, dots: repeats)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small",
                        help="'tiny' or 'small' (random-weight Llamas built here; small: prefill costs enough for "
                             "TTFT to show cache hits), 'default' (SmolLM2-135M-Instruct), or a path")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each router, in a rotated order each round")
    parser.add_argument("--blocks-per-replica", type=int, default=96,
                        help="KV pool of each replica (blocks): the chats in flight fit in N pools when each replica "
                             "keeps its own, not when every replica holds every chat")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="per replica (the reference gets N x this)")
    parser.add_argument("--chats", type=int, default=None,
                        help="default: 96, or 48 with the default model (its prefill costs ~20x the small one's)")
    parser.add_argument("--prefixes", type=int, default=24, help="distinct system prompts")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--public-every", type=int, default=4,
                        help="system prompts of rank 0, k, 2k... are public (shared by tenants; 0: none)")
    parser.add_argument("--hot-load", type=float, default=1.25,
                        help="the hottest system prompt's chats, in replicas' shares (1/N of all chats)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--first-user-tokens", type=int, default=None,
                        help="a chat's first message (default: --user-tokens); longer, it is a document the chat's "
                             "later turns ask about, and most of each history is that chat's own")
    parser.add_argument("--max-tokens", type=int, default=16, help="the answer of each turn")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="mean pause (exponential, seeded) before a chat's next turn, as its user reads the "
                             "answer; 0: the next turn goes the moment the answer ends, when the replica that served "
                             "it has just freed a slot, which a load-only router then picks again")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="chats in flight (default: 2N + 1; without --think-s, a multiple of N makes a closed "
                             "loop of equal requests send each chat's turns to one replica under round robin by "
                             "accident)")
    parser.add_argument("--mean-load-factor", type=float, default=DEFAULT_MEAN_LOAD_FACTOR,
                        help="our router's load bound: at most this x the mean load per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", default=",".join((REFERENCE, *ROUTER_RUNS)),
                        help="the runs, comma-separated (ours always; targets whose baseline did not run are left out)")
    parser.add_argument("--out", default=None, help="the JSON (default: docs/results/cluster-MODEL-DATE.json); "
                                                    "the PNG goes beside it")
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or 2 * args.replicas + 1
    args.routers = tuple(dict.fromkeys([*args.routers.split(","), OURS]))
    if unknown := set(args.routers) - {REFERENCE, *ROUTER_RUNS}:
        parser.error(f"unknown routers {sorted(unknown)}")
    args.chats = args.chats or (96 if args.model in RANDOM_MODELS else 48)
    if args.out is None:
        root = Path(__file__).resolve().parent.parent
        args.out = str(root / "docs" / "results" / f"cluster-{Path(args.model).name}-{datetime.date.today()}.json")
    return args


def code_version() -> dict:
    """The commit measured, and the files that differed from it (others edit the tree while benches run)."""
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout  # noqa: E731
    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": [line[3:] for line in git("status", "--short", "--untracked-files=no").splitlines()]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import ray
    from ray import serve

    from engine.config import EngineConfig
    from engine.model.compile import compile_kernels
    from engine.model.loader import resolve_model_path
    from engine.model.model_config import load_config

    model = args.model
    if model in RANDOM_MODELS:
        from bench.tiny_models import build_tiny_model  # seconds, offline
        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-cluster-")) / model,
                                     **RANDOM_MODELS[model]))
    config = EngineConfig(model=model, block_size=args.block_size, num_kv_blocks=args.blocks_per_replica,
                          max_num_seqs=args.max_num_seqs, threads=1, threads_batch=1, max_model_len=2048)
    vocab_size = load_config(resolve_model_path(config.model, config.model_cache_dir)).vocab_size
    compile_kernels(config.model)  # into numba's cache on disk, so that no run's replicas wait for the compiler
    hot_share = args.hot_load / args.replicas
    trace = build_trace(chats=args.chats, prefixes=args.prefixes, tenants=args.tenants,
                        public_every=args.public_every, hot_share=hot_share, turns=args.turns,
                        system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                        first_user_tokens=args.first_user_tokens, think_s=args.think_s,
                        vocab_size=vocab_size, seed=args.seed)
    names = args.routers
    summaries = []
    ray.init(include_dashboard=False, namespace="prefixgate-bench", log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        for repeat in range(args.repeats):
            for order, name in enumerate(run_order(names, repeat)):
                print(f"round {repeat}: {name}", file=sys.stderr, flush=True)
                summary = run_one(config, trace, name, repeat, args).summary(args.block_size)
                summaries.append(summary | {"order": order})
    finally:
        serve.shutdown()
        ray.shutdown()
    routers = aggregate(summaries)
    report = {"model": args.model, "vocab_size": vocab_size, "args": vars(args), "code": code_version(),
              "zipf_s": zipf_exponent(args.prefixes, hot_share), "trace": describe_trace(trace, args.block_size),
              "kv_use": "prompt tokens each replica computed into its KV cache (prefix cache queried - hit tokens)",
              "routers": {n: routers[n] for n in names}, "runs": summaries, "targets": targets(routers),
              "wall_s": time.perf_counter() - started}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"results: {out}; plot: {plot(report, out.with_suffix('.png'))}; wall time {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
