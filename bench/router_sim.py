"""`python -m bench router-sim`: the cluster router and its prefix index at 64 and 256 replicas, simulated.

No Ray and no model: a recorded trace of multi-turn chats (bench/traces/) is replayed against simulated
replicas, each the engine's own `BlockPool` (engine/kv, LRU) over the trace's block hashes, serving up to
`max_num_seqs` requests at once, for a time set by the prefill tokens it computes and its decode steps.
Each of G gateways owns a real `PrefixIndex` (cluster/prefix_index.py) and routes its share of the
requests with the real `choose` + `reserve`; the replicas push their KV events to one ordered log every
push interval (the lag), and every gateway applies the whole log to its own index (cluster/kv_event_log.py).
Baselines: round robin, and one pool of the same total size serving everything. docs/router-simulation.md.
"""
from __future__ import annotations

import argparse
import enum
import gzip
import heapq
import itertools
import json
import math
import os
import pickle
import platform
import random
import statistics
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.prefix_index import DEFAULT_MEAN_LOAD_FACTOR, PrefixIndex
from engine.config import EvictionPolicy, HashAlgo
from engine.kv.block_pool import BlockPool, KVCacheBlock
from engine.kv.hashing import hash_full_blocks

TRACE = Path(__file__).parent / "traces" / "multiturn-256.json.gz"
OUT = Path(__file__).parent / "results" / "router-sim.json"  # kept runs are copied to docs/results/ with their date
BLOCK_SIZE = 16
PUBLIC_SALT = "public"  # the common salt of the prompts every tenant may use
WARMUP_S = 300.0  # chats start this long before the replayed window, so it opens in steady state


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """One replica; its costs are this repo's engine's with SmolLM2-135M on 2 CPU cores
    (docs/router-simulation.md#what-is-modelled)."""

    num_blocks: int = 2048  # 32k tokens: SmolLM2-135M's bf16 K/V in 0.7 GB
    max_num_seqs: int = 8
    prefill_s_per_token: float = 1.6e-3
    decode_step_s: float = 0.040

    def service_s(self, computed_tokens: int, output_tokens: int) -> float:
        return computed_tokens * self.prefill_s_per_token + output_tokens * self.decode_step_s


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What `--record` draws: the fleet it loads, the tenants and their prompts, the chats."""

    replicas: int = 256  # arrivals keep this many replicas `utilization` busy; fewer replay a slice
    requests: int = 48_000
    utilization: float = 0.75
    tenants: int = 3000
    tenant_zipf: float = 1.1
    prompt_tokens: int = 500  # median of a tenant's own prompts (lognormal)
    public_prompts: int = 16
    public_prompt_tokens: tuple[int, int] = (800, 3000)  # uniform
    public_share: float = 0.2  # chats on a public prompt other than the hot one (Zipf over them)
    hot_share: float = 0.1  # chats on the hot prefix (public prompt 0)
    mean_turns: float = 4.0
    user_tokens: int = 60  # medians (lognormal, at most 6x)
    answer_tokens: int = 150
    think_s: float = 30.0  # mean pause between an answer and the next turn
    max_context: int = 8192  # a chat ends before a turn would pass this many tokens


# ---- the trace: recorded once (--record), replayed by every run


def record_trace(shape: TraceShape, replica: ReplicaShape, seed: int) -> dict:
    """A compact description: prompt lengths (owner tenant, or -1: public), and per chat its tenant, prompt
    and turns (arrival ms, user tokens, answer tokens); token ids follow from the seed (ChatHashes).
    Arrivals are open loop, each turn an estimate of the previous one's service plus a pause after it."""
    rng = random.Random(seed)
    prompts = _draw_prompts(rng, shape)
    own: dict[int, list[int]] = {}
    for p, (tenant, _) in enumerate(prompts):
        own.setdefault(tenant, []).append(p)
    tenant_weights = list(itertools.accumulate(1 / k ** shape.tenant_zipf for k in range(1, shape.tenants + 1)))
    public_weights = list(itertools.accumulate(1 / k for k in range(1, shape.public_prompts)))

    def draw() -> tuple[int, int, list[tuple[int, int]]]:
        tenant = rng.choices(range(shape.tenants), cum_weights=tenant_weights)[0]
        u = rng.random()
        if u < shape.hot_share:
            prompt = 0
        elif u < shape.hot_share + shape.public_share:
            prompt = 1 + rng.choices(range(shape.public_prompts - 1), cum_weights=public_weights)[0]
        else:
            prompt = rng.choice(own[tenant])
        return tenant, prompt, _draw_turns(rng, shape, prompts[prompt][1])

    sample = [draw() for _ in range(2000)]
    turn_s = statistics.fmean(s for _, p, turns in sample for s in _service_estimates(replica, prompts[p], turns))
    request_rate = shape.utilization * shape.replicas * replica.max_num_seqs / turn_s
    chat_rate = request_rate / statistics.fmean(len(turns) for _, _, turns in sample)
    end_s, start, chats = shape.requests / request_rate, -WARMUP_S, []
    for tenant, prompt, turns in itertools.chain(sample, iter(draw, None)):
        start += rng.expovariate(chat_rate)
        if start >= end_s:
            break
        at, arrivals = start, []
        for service in _service_estimates(replica, prompts[prompt], turns):
            arrivals.append(round(1000 * at))
            at += service + rng.expovariate(1 / shape.think_s)
        if any(0 <= t < 1000 * end_s for t in arrivals):
            chats.append([tenant, prompt, [[t, user, answer] for t, (user, answer) in zip(arrivals, turns)]])
    return {"version": 1, "seed": seed, "shape": asdict(shape), "replica": asdict(replica),
            "request_rate": request_rate, "end_ms": round(1000 * end_s), "prompts": prompts, "chats": chats}


def _draw_prompts(rng: random.Random, shape: TraceShape) -> list[list[int]]:
    """[owner, tokens]: the public prompts (owner -1; the first is the hot prefix), then one or two per tenant."""
    prompts = [[-1, rng.randint(*shape.public_prompt_tokens)] for _ in range(shape.public_prompts)]
    for tenant in range(shape.tenants):
        prompts += [[tenant, _lognormal(rng, shape.prompt_tokens, 0.6)] for _ in range(1 + (rng.random() < 0.5))]
    return prompts


def _lognormal(rng: random.Random, median: int, sigma: float) -> int:
    return int(min(6 * median, max(median / 8, rng.lognormvariate(math.log(median), sigma))))


def _draw_turns(rng: random.Random, shape: TraceShape, context: int) -> list[tuple[int, int]]:
    turns: list[tuple[int, int]] = []
    while not turns or (len(turns) < 16 and rng.random() > 1 / shape.mean_turns):
        user, answer = _lognormal(rng, shape.user_tokens, 0.8), _lognormal(rng, shape.answer_tokens, 0.6)
        if turns and context + user + answer > shape.max_context:
            break
        context += user + answer
        turns.append((user, answer))
    return turns


def _service_estimates(replica: ReplicaShape, prompt: list[int], turns: list) -> list[float]:
    """Each turn computes its message and the previous answer; the first also a tenant's own prompt."""
    owner, prompt_tokens = prompt
    previous, estimates = (prompt_tokens if owner >= 0 else 0), []
    for user, answer in turns:
        estimates.append(replica.service_s(previous + user, answer))
        previous = answer
    return estimates


def write_trace(trace: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as f:  # the same trace, the same bytes
        f.write(json.dumps(trace, separators=(",", ":")).encode())


def read_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


class ChatHashes:
    """Each chat's block hashes (its whole conversation, every answer included), from the trace's token ids:
    the engine's own hash_full_blocks with the tenant's salt (or the public one). Memoized across runs."""

    def __init__(self, trace: dict, algo: HashAlgo = HashAlgo.SHA256) -> None:
        self._trace, self._algo = trace, algo
        self._chats: dict[int, list[bytes]] = {}
        self._prompts: dict[int, tuple[list[int], list[bytes]]] = {}

    def __call__(self, chat: int) -> list[bytes]:
        if chat not in self._chats:
            _, prompt, turns = self._trace["chats"][chat]
            tokens, prompt_hashes = self._prompt(prompt)
            tokens = list(tokens)
            for turn, (_, user, answer) in enumerate(turns):
                tokens += self._tokens(f"c{chat}/{2 * turn}", user) + self._tokens(f"c{chat}/{2 * turn + 1}", answer)
            k = len(prompt_hashes)  # the conversation continues the prompt's chain (the salt is in block 0)
            self._chats[chat] = prompt_hashes + hash_full_blocks(
                tokens, BLOCK_SIZE, start_block=k, parent=prompt_hashes[-1] if k else b"",
                cache_salt=self._salt(prompt), algo=self._algo)
        return self._chats[chat]

    def _prompt(self, prompt: int) -> tuple[list[int], list[bytes]]:
        if prompt not in self._prompts:
            tokens = self._tokens(f"p{prompt}", self._trace["prompts"][prompt][1])
            self._prompts[prompt] = tokens, hash_full_blocks(tokens, BLOCK_SIZE, cache_salt=self._salt(prompt),
                                                             algo=self._algo)
        return self._prompts[prompt]

    def _salt(self, prompt: int) -> str:
        owner = self._trace["prompts"][prompt][0]
        return PUBLIC_SALT if owner < 0 else f"tenant-{owner}"

    def _tokens(self, segment: str, n: int) -> list[int]:
        return array("H", random.Random(f"{self._trace['seed']}/{segment}").randbytes(2 * n)).tolist()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    chat_hashes: list[bytes]
    prompt_tokens: int
    output_tokens: int


def workload(trace: dict, replicas: int, requests: int, hashes: ChatHashes) -> list[TraceRequest]:
    """The requests `replicas` replicas get: every chat i with i % trace replicas < replicas (the same load
    per replica), its turns in the recorded window, the first `requests` * replicas / trace replicas of them."""
    fleet = trace["shape"]["replicas"]
    if replicas > fleet:
        raise ValueError(f"the trace loads at most {fleet} replicas; record one for more (--record)")
    turns = []
    for chat, (_, prompt, chat_turns) in enumerate(trace["chats"]):
        if chat % fleet >= replicas:
            continue
        context = trace["prompts"][prompt][1]
        for arrival_ms, user, answer in chat_turns:
            if 0 <= arrival_ms < trace["end_ms"]:
                turns.append((arrival_ms, chat, context + user, answer))
            context += user + answer
    turns.sort()
    return [TraceRequest(ms / 1000, hashes(chat), prompt, answer)
            for ms, chat, prompt, answer in turns[:requests * replicas // fleet]]


def oracle_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Cached prompt tokens / prompt tokens of an infinite cache (each block computed once)."""
    seen: set[bytes] = set()
    cached = prompt = 0
    for r in requests:
        hit, max_hit = 0, (r.prompt_tokens - 1) // BLOCK_SIZE
        while hit < max_hit and r.chat_hashes[hit] in seen:
            hit += 1
        cached, prompt = cached + hit * BLOCK_SIZE, prompt + r.prompt_tokens
        seen.update(r.chat_hashes[:(r.prompt_tokens + r.output_tokens - 1) // BLOCK_SIZE])
    return cached / prompt


# ---- a replica: the engine's own BlockPool over the trace's block hashes, its slots and queue

# the trace's blocks are known by their chained SHA-256 hashes alone, so no token ids guard a hit here
NO_TOKENS: tuple[int, ...] = ()


def new_pool(num_blocks: int, emit_events: bool) -> BlockPool:
    """A replica's KV pool: engine/kv's BlockPool with LRU eviction, "stored" / "removed" events if asked."""
    pool = BlockPool(num_blocks, eviction_policy=EvictionPolicy.LRU)
    if emit_events:
        pool.kv_events = []
    return pool


def cached_blocks(pool: BlockPool, block_hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
    """The longest run of leading blocks `pool` holds, at most `max_blocks`."""
    blocks = []
    for block_hash in block_hashes[:max_blocks]:
        block = pool.get_cached_block(block_hash, NO_TOKENS)
        if block is None:
            break
        blocks.append(block)
    return blocks


def fits(pool: BlockPool, hits: Sequence[KVCacheBlock], num_new: int) -> bool:
    """Whether `num_new` fresh blocks are free once the hits are taken (a hit on a free block leaves the queue)."""
    return pool.num_free_blocks - sum(1 for block in hits if block.ref_cnt == 0) >= num_new


@dataclass(slots=True)
class Request:
    trace: TraceRequest
    gateway: int
    replica: SimReplica | None = None
    hit_blocks: int = 0
    blocks: list[KVCacheBlock] = field(default_factory=list)  # its block table, in block order

    @property
    def block_hashes(self) -> list[bytes]:
        return self.trace.chat_hashes[:self.trace.prompt_tokens // BLOCK_SIZE]


@dataclass(slots=True)
class SimReplica:
    name: str
    pool: BlockPool
    max_num_seqs: int
    push_phase_s: float = 0.0  # its push loop started at this offset
    queue: list[Request] = field(default_factory=list)
    computing: Counter[bytes] = field(default_factory=Counter)  # prompt blocks its running prefills are computing
    running: int = 0
    pending: list[tuple[str, bytes]] = field(default_factory=list)  # events since its last push
    requests: int = 0
    busy_s: float = 0.0  # service time of the requests it ran


# ---- the KV event log and the gateways following it


class EventLog:
    """One app's log (cluster/kv_event_log.py): the replicas' pushes in order; each gateway reads on from its
    own cursor. Sizes are pickle's (protocol 5) of a push's arguments and of a pull's answer, one pull a push."""

    def __init__(self) -> None:
        self._pushes: list[tuple[str, list[tuple[str, bytes]]]] = []
        self._first = 0  # log position of _pushes[0]
        self.events = self.num_pushes = self.bytes_in = self.bytes_out = 0

    @property
    def end(self) -> int:
        return self._first + len(self._pushes)

    def push(self, replica: str, events: list[tuple[str, bytes]]) -> None:
        self._pushes.append((replica, events))
        self.events += len(events)
        self.num_pushes += 1
        self.bytes_in += len(pickle.dumps((replica, events), protocol=5))
        self.bytes_out += len(pickle.dumps([(replica, kind, h) for kind, h in events], protocol=5))

    def since(self, cursor: int) -> list[tuple[str, list[tuple[str, bytes]]]]:
        return self._pushes[cursor - self._first:]

    def trim(self, cursor: int) -> None:
        """Drops what every gateway has read."""
        del self._pushes[:cursor - self._first]
        self._first = cursor


class Gateway:
    def __init__(self, replicas: list[str], clock: Callable[[], float]) -> None:
        self.index = PrefixIndex(clock=clock)
        self.index.set_replicas(replicas)
        self.cursor = 0
        self.applied = 0
        self.apply_ns = 0
        self.route_ns: list[int] = []  # choose + reserve, wall clock
        self.route_cpu_ns: list[int] = []  # the same on this thread's CPU clock: without preemptions
        self.turn = itertools.count()  # round robin's

    def follow(self, log: EventLog) -> None:
        pushes = log.since(self.cursor)
        start = time.perf_counter_ns()
        for replica, events in pushes:
            self.index.apply_events(replica, events)
        self.apply_ns += time.perf_counter_ns() - start
        self.applied += sum(len(events) for _, events in pushes)
        self.cursor = log.end

    def index_bytes(self) -> tuple[int, int]:
        """(held, recent): the index's sets and dicts plus each hash as its own bytes object (in a gateway each
        is unpickled from the log, or hashed from a prompt). Reads the index's private tables: a size only."""
        held, recent = self.index._held, self.index._recent
        return (sys.getsizeof(held) + sum(sys.getsizeof(s) + sum(map(sys.getsizeof, s)) for s in held.values()),
                sys.getsizeof(recent) + sum(sys.getsizeof(d) + sum(map(sys.getsizeof, d)) for d in recent.values()))


# ---- the simulation


class Policy(str, enum.Enum):
    PREFIX = "prefix"  # PrefixIndex.choose + reserve, per gateway
    ROUND_ROBIN = "round_robin"
    ONE_POOL = "one_pool"  # one replica with every replica's blocks and slots: the hit rate to aim at


@dataclass(frozen=True, slots=True)
class RunConfig:
    policy: Policy
    replicas: int
    gateways: int = 1
    lag_s: float = 0.05  # the replicas' push interval (0: every event reaches the log at once)
    seed: int = 0
    mean_load_factor: float = DEFAULT_MEAN_LOAD_FACTOR

    @property
    def name(self) -> str:
        if self.policy is Policy.PREFIX:
            return f"prefix G={self.gateways} lag={1000 * self.lag_s:g}ms"
        return self.policy.value


ARRIVE, PUSH, PREFILL_DONE, FINISH = range(4)


class Simulation:
    def __init__(self, requests: Sequence[TraceRequest], config: RunConfig, shape: ReplicaShape) -> None:
        self.config, self.shape, self.now = config, shape, 0.0
        rng = random.Random(config.seed)
        prefix = config.policy is Policy.PREFIX
        if config.policy is Policy.ONE_POOL:
            self.replicas = [SimReplica("pool", new_pool(shape.num_blocks * config.replicas, False),
                                        shape.max_num_seqs * config.replicas)]
        else:
            self.replicas = [SimReplica(f"replica-{i:03d}", new_pool(shape.num_blocks, prefix), shape.max_num_seqs,
                                        rng.uniform(0, config.lag_s)) for i in range(config.replicas)]
        self.by_name = {r.name: r for r in self.replicas}
        self.names = list(self.by_name)
        self.loads = dict.fromkeys(self.names, 0)  # requests queued or running: the fresh queue lengths
        self.gateways = [Gateway(self.names, lambda: self.now) for _ in range(config.gateways)]
        self.log = EventLog()
        self._heap: list = []
        self._seq = itertools.count()
        for r in requests:
            self._at(r.arrival_s, ARRIVE, Request(r, rng.randrange(config.gateways)))
        self.routes: list[str] = []  # the replica of each request, in arrival order
        self.prompt_tokens = self.cached_tokens = 0
        self.ttfts: list[float] = []

    def _at(self, t: float, kind: int, item) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, item))

    def run(self) -> dict:
        start, handlers = time.perf_counter(), (self._arrive, self._push, self._prefill_done, self._finish)
        last_arrival = 0.0
        while self._heap:
            self.now, _, kind, item = heapq.heappop(self._heap)
            handlers[kind](item)
            if kind == ARRIVE:
                last_arrival = self.now
                if len(self.routes) % 4096 == 0:
                    self.log.trim(min(g.cursor for g in self.gateways))
        for gateway in self.gateways:
            gateway.follow(self.log)
        return self._summary(last_arrival, time.perf_counter() - start)

    def _arrive(self, request: Request) -> None:
        replica = self._route(request)
        request.replica = replica
        self.routes.append(replica.name)
        self.loads[replica.name] += 1
        replica.queue.append(request)
        self._admit(replica)

    def _route(self, request: Request) -> SimReplica:
        gateway = self.gateways[request.gateway]
        if self.config.policy is Policy.ONE_POOL:
            return self.replicas[0]
        if self.config.policy is Policy.ROUND_ROBIN:
            return self.replicas[next(gateway.turn) % len(self.replicas)]
        gateway.follow(self.log)
        block_hashes = request.block_hashes
        start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        decision = gateway.index.choose(block_hashes, self.names, self.config.mean_load_factor, loads=self.loads)
        gateway.index.reserve(decision.replica, block_hashes)
        gateway.route_ns.append(time.perf_counter_ns() - start)
        gateway.route_cpu_ns.append(time.thread_time_ns() - cpu_start)
        gateway.index.count(decision.reason)
        return self.by_name[decision.replica]

    def _admit(self, replica: SimReplica) -> None:
        """engine/scheduler.py's admission, FCFS: in arrival order while a slot and the blocks are free; one whose
        next block a running prefill is computing waits to hit it, and later ones may pass it."""
        queue, replica.queue = replica.queue, []
        for i, request in enumerate(queue):
            block_hashes = request.block_hashes
            # NOTE: the last prompt token is always computed: its logits give the first output token
            max_hit = (request.trace.prompt_tokens - 1) // BLOCK_SIZE
            hits = cached_blocks(replica.pool, block_hashes, max_hit)
            if len(hits) < max_hit and block_hashes[len(hits)] in replica.computing:
                replica.queue.append(request)
                continue
            if replica.running == replica.max_num_seqs or not self._start(replica, request, hits):
                replica.queue += queue[i:]
                break
        self._take_events(replica)

    def _start(self, replica: SimReplica, request: Request, hits: list[KVCacheBlock]) -> bool:
        """Runs `request` on its cached blocks `hits` and fresh ones for the rest, if they fit."""
        prompt, output = request.trace.prompt_tokens, request.trace.output_tokens
        hit, pool = len(hits), replica.pool
        num_new = -(-(prompt + output) // BLOCK_SIZE) - hit
        if not fits(pool, hits, num_new):
            assert replica.running, "a request larger than a replica's whole pool"
            return False
        replica.running += 1
        pool.touch(hits)
        request.hit_blocks, request.blocks = hit, hits + pool.allocate(num_new)
        replica.computing.update(request.block_hashes[hit:])
        prefill_s = self.shape.service_s(prompt - hit * BLOCK_SIZE, 0)
        service_s = prefill_s + self.shape.service_s(0, output)
        replica.requests += 1
        replica.busy_s += service_s
        self.prompt_tokens += prompt
        self.cached_tokens += hit * BLOCK_SIZE
        self.ttfts.append(self.now - request.trace.arrival_s + prefill_s)
        self._at(self.now + prefill_s, PREFILL_DONE, request)
        self._at(self.now + service_s, FINISH, request)
        return True

    def _prefill_done(self, request: Request) -> None:
        computed, computing = request.block_hashes[request.hit_blocks:], request.replica.computing
        for h in computed:
            if computing[h] == 1:
                del computing[h]
            else:
                computing[h] -= 1
        self._store(request, request.hit_blocks, request.trace.prompt_tokens // BLOCK_SIZE)
        self._admit(request.replica)  # requests waiting for this prefix hit it now

    def _finish(self, request: Request) -> None:
        t, replica = request.trace, request.replica
        # the answer's full blocks are cached too (all but the last token were computed)
        self._store(request, t.prompt_tokens // BLOCK_SIZE, (t.prompt_tokens + t.output_tokens - 1) // BLOCK_SIZE)
        # NOTE: tail first, so the prefix outlives the suffix
        replica.pool.free(reversed(request.blocks))
        replica.running -= 1
        self.loads[replica.name] -= 1
        if self.config.policy is Policy.PREFIX:
            self.gateways[request.gateway].index.release(replica.name)
        self._admit(replica)

    def _store(self, request: Request, first: int, end: int) -> None:
        """Caches the computed blocks `first` to `end` of the request's table under their hashes."""
        pool, chat_hashes = request.replica.pool, request.trace.chat_hashes
        for i in range(first, end):
            pool.cache_block(request.blocks[i], chat_hashes[i], NO_TOKENS)
        self._take_events(request.replica)

    def _take_events(self, replica: SimReplica) -> None:
        events = replica.pool.take_kv_events()
        if events:
            self._publish(replica, events)

    def _publish(self, replica: SimReplica, events: list[tuple[str, bytes]]) -> None:
        """Into the log at once (lag 0), or with the replica's next push."""
        lag = self.config.lag_s
        if lag == 0:
            self.log.push(replica.name, events)
            return
        if not replica.pending:
            ticks = math.floor((self.now - replica.push_phase_s) / lag) + 1
            self._at(replica.push_phase_s + ticks * lag, PUSH, replica)
        replica.pending += events

    def _push(self, replica: SimReplica) -> None:
        self.log.push(replica.name, replica.pending)
        replica.pending = []

    def _summary(self, last_arrival_s: float, wall_s: float) -> dict:
        c, replicas = self.config, self.replicas
        requests, busy = [r.requests for r in replicas], [r.busy_s for r in replicas]
        slots = sum(r.max_num_seqs for r in replicas)
        summary = {
            "run": c.name, "policy": c.policy.value, "replicas": c.replicas, "gateways": c.gateways,
            "requests": len(self.routes), "hit_rate": self.cached_tokens / self.prompt_tokens,
            "max_over_mean_requests": max(requests) / statistics.fmean(requests),
            "max_over_mean_busy": max(busy) / statistics.fmean(busy),
            "offered_load": sum(r.busy_s for r in replicas) / (slots * last_arrival_s),
            "ttft_p50_s": _quantile(self.ttfts, 0.5), "ttft_p99_s": _quantile(self.ttfts, 0.99),
            "evictions": sum(r.pool.evictions["capacity"] for r in replicas), "sim_s": self.now, "wall_s": wall_s,
        }
        if c.policy is Policy.PREFIX:
            summary.update(self._index_summary(last_arrival_s))
        return summary

    def _index_summary(self, span_s: float) -> dict:
        route_us = [ns / 1000 for g in self.gateways for ns in g.route_ns]
        route_cpu_us = [ns / 1000 for g in self.gateways for ns in g.route_cpu_ns]
        held_bytes, recent_bytes = max(g.index_bytes() for g in self.gateways)
        held = max(sum(len(g.index.held(r)) for r in self.names) for g in self.gateways)
        decisions = Counter()
        for g in self.gateways:
            decisions.update({reason.value: n for reason, n in g.index.decisions.items()})
        log = self.log
        return {
            "lag_ms": 1000 * self.config.lag_s,
            "route_us_p50": _quantile(route_us, 0.5), "route_us_p99": _quantile(route_us, 0.99),
            "route_cpu_us_p50": _quantile(route_cpu_us, 0.5), "route_cpu_us_p99": _quantile(route_cpu_us, 0.99),
            "index_mb_per_gateway": (held_bytes + recent_bytes) / 2**20, "held_blocks_per_gateway": held,
            "held_bytes_per_block": held_bytes / max(1, held), "recent_mb_per_gateway": recent_bytes / 2**20,
            "events_per_s": log.events / span_s, "events_per_request": log.events / len(self.routes),
            "pushes_per_s": log.num_pushes / span_s, "log_in_kb_per_s": log.bytes_in / span_s / 1000,
            # every gateway pulls the whole log
            "log_out_kb_per_s": self.config.gateways * log.bytes_out / span_s / 1000,
            "apply_us_per_event": sum(g.apply_ns for g in self.gateways) / 1000
            / max(1, sum(g.applied for g in self.gateways)),
            "decisions": dict(decisions),
        }


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the runs, the table, the command


def run_all(trace: dict, replica_counts: Sequence[int], gateway_counts: Sequence[int], lags_s: Sequence[float],
            requests: int, seed: int, log: Callable[[str], None] = print) -> dict:
    shape = ReplicaShape(**trace["replica"])
    hashes = ChatHashes(trace)
    runs = []
    for replicas in replica_counts:
        reqs = workload(trace, replicas, requests, hashes)
        oracle = oracle_hit_rate(reqs)
        configs = [RunConfig(Policy.ONE_POOL, replicas, seed=seed), RunConfig(Policy.ROUND_ROBIN, replicas, seed=seed)]
        configs += [RunConfig(Policy.PREFIX, replicas, g, lag, seed) for g in gateway_counts for lag in lags_s]
        pool = None
        for config in configs:
            log(f"R={replicas} {config.name}: {len(reqs)} requests")
            summary = Simulation(reqs, config, shape).run()
            pool = pool or summary
            summary.update(oracle_hit_rate=oracle, hit_rate_vs_pool=summary["hit_rate"] / pool["hit_rate"])
            runs.append(summary)
    return {"trace": {k: trace[k] for k in ("seed", "shape", "request_rate", "end_ms")},
            "replica": asdict(shape), "block_size": BLOCK_SIZE, "hash_algo": HashAlgo.SHA256.value, "runs": runs}


COLUMNS = (  # header, key, format; the index columns are blank for the baselines
    ("reqs", "requests", "d"), ("hit", "hit_rate", ".3f"), ("/pool", "hit_rate_vs_pool", ".3f"),
    ("route p50 us", "route_us_p50", ".0f"), ("p99", "route_us_p99", ".0f"), ("cpu p99", "route_cpu_us_p99", ".0f"),
    ("index MB", "index_mb_per_gateway", ".1f"), ("events/s", "events_per_s", ".0f"),
    ("in KB/s", "log_in_kb_per_s", ".0f"), ("out KB/s", "log_out_kb_per_s", ".0f"),
    ("max/mean req", "max_over_mean_requests", ".2f"), ("busy", "max_over_mean_busy", ".2f"),
    ("load", "offered_load", ".2f"), ("TTFT p50 s", "ttft_p50_s", ".2f"),
)


def render(results: dict) -> str:
    widths = [max(len(h), 6) + 2 for h, _, _ in COLUMNS]
    lines = [f"{'R':>4}  {'run':<22}" + "".join(f"{h:>{w}}" for (h, _, _), w in zip(COLUMNS, widths))]
    for s in results["runs"]:
        cells = (format(s[key], fmt) if key in s else "-" for _, key, fmt in COLUMNS)
        lines.append(f"{s['replicas']:>4}  {s['run']:<22}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append("hit: cached prompt tokens / prompt tokens, /pool: over one pool of the same total size; route: "
                 "choose + reserve; index: one gateway's; out: all gateways' pulls; max/mean over all replicas; "
                 "load: service time / slot time")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]
    parser = argparse.ArgumentParser(prog="python -m bench router-sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=ints, default=[64, 256], help="comma-separated replica counts")
    parser.add_argument("--gateways", type=ints, default=[1, 4], help="comma-separated gateway counts")
    parser.add_argument("--lag-ms", type=ints, default=[0, 50, 500], help="the replicas' push intervals")
    parser.add_argument("--requests", type=int, default=24_000,
                        help="requests per run at the trace's 256 replicas (fewer replicas: that share of them)")
    parser.add_argument("--seed", type=int, default=0, help="gateway choice per request; with --record, the trace")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--record", action="store_true", help="draw the trace anew (--seed) and write it to --trace")
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.record:
        trace = record_trace(TraceShape(), ReplicaShape(), args.seed)
        write_trace(trace, args.trace)
        print(f"{len(trace['chats'])} chats in {args.trace} ({args.trace.stat().st_size / 1e6:.2f} MB)")
        return 0
    start, load_average = time.perf_counter(), os.getloadavg()
    results = run_all(read_trace(args.trace), args.replicas, args.gateways, [ms / 1000 for ms in args.lag_ms],
                      args.requests, args.seed)
    results["environment"] = {"python": platform.python_version(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "load_average_at_start": load_average,
                              "wall_s": time.perf_counter() - start,
                              "command": " ".join(["python -m bench router-sim", *argv])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
    print(f"wall time {results['environment']['wall_s']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
