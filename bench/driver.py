"""Runs one workload on one variant and measures it.

The engine is driven in-process (EngineCore.step on this thread): requests are added at their
arrival times between steps, so TTFT includes the wait for a step already under way, as it
would behind a server. `transformers` runs as a one-worker FIFO server on a virtual clock: the
compute is real and timed, the idle gaps between arrivals are skipped instead of slept.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch

import engine.core
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.loader import load_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from bench.oracle import oracle_prefill_tokens
from bench.workloads import BenchRequest, Workload

# Every variant builds a fresh EngineCore (an empty cache); the weights are read-only, so the
# bench loads them once per process instead of once per run.
_models: dict = {}


def _load_model_once(path, config, dtype, device, pack: bool = True, weights: str = "none",
                     integer_activations: bool = False):
    key = (str(path), dtype, str(device), pack, weights, integer_activations)
    if key not in _models:
        _models[key] = load_model(path, config, dtype, device, pack=pack, weights=weights,
                                  integer_activations=integer_activations)
    return _models[key]


engine.core.load_model = _load_model_once


@dataclass(slots=True)
class RequestTiming:
    request_id: str
    ttft: float
    queue_time: float
    e2e: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    itls: list[float] = field(default_factory=list)
    error: bool = False


@dataclass(slots=True)
class RunResult:
    workload: str
    variant: str
    timings: list[RequestTiming]
    duration_s: float
    prefill_computed: int  # prompt tokens actually run through the model
    oracle: int
    hit_tokens: int = 0
    queried_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    peak_rss_mb: float = 0.0
    note: str = ""

    def summary(self) -> dict:
        t = self.timings
        ttft = [x.ttft for x in t]
        itl = [d for x in t for d in x.itls]
        out = sum(x.num_output_tokens for x in t)
        prompt = sum(x.num_prompt_tokens for x in t)
        return {
            "workload": self.workload, "variant": self.variant, "status": "ok", "note": self.note,
            "requests": len(t), "errors": sum(x.error for x in t),
            "prompt_tokens": prompt, "prefill_computed": self.prefill_computed, "oracle": self.oracle,
            "computed_over_oracle": self.prefill_computed / self.oracle if self.oracle else None,
            "hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            "cached_tokens": sum(x.num_cached_tokens for x in t),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "e2e_p50_s": pct([x.e2e for x in t], 50),
            "max_queue_s": max((x.queue_time for x in t), default=None),
            "output_tokens": out, "duration_s": self.duration_s,
            "output_tok_s": out / self.duration_s if self.duration_s else None,
            "total_tok_s": (prompt + out) / self.duration_s if self.duration_s else None,
            "evictions": self.evictions, "preemptions": self.preemptions, "peak_rss_mb": self.peak_rss_mb,
            "ttft_by_request_s": {x.request_id: round(x.ttft, 4) for x in t},
        }


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def greedy(max_tokens: int) -> SamplingParams:
    # ignore_eos: every variant generates exactly max_tokens, so token rates compare like for like
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def make_core(model: str, workload: Workload, base: dict | None = None, **variant) -> EngineCore:
    """A fresh engine (empty cache): base settings < the workload's own (a small KV pool) < the variant's."""
    return EngineCore(EngineConfig(model=model, **{**(base or {}), **workload.engine_overrides, **variant}))


class _Arrivals:
    """Requests not yet sent: a heap by arrival time; closed-loop followers wait for their leader."""

    def __init__(self, requests: list[BenchRequest], t0: float) -> None:
        self.followers: dict[str, list[BenchRequest]] = {}
        self.heap: list = []
        self.seq = itertools.count()
        for r in requests:
            if r.after is None:
                self.push(t0 + r.arrival_s, r)
            else:
                self.followers.setdefault(r.after, []).append(r)

    def push(self, at: float, r: BenchRequest) -> None:
        heapq.heappush(self.heap, (at, next(self.seq), r))

    def finished(self, request_id: str, now: float) -> None:
        for r in self.followers.pop(request_id, []):
            self.push(now + r.think_s, r)

    def due(self, now: float) -> list[tuple[float, BenchRequest]]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            at, _, r = heapq.heappop(self.heap)
            out.append((at, r))
        return out

    def next_at(self) -> float | None:
        return self.heap[0][0] if self.heap else None


def warm_up(core: EngineCore) -> None:
    prompt = [(7 * i) % (core.vocab_size - 1) + 1 for i in range(200)]
    core.add_request(Request("warm-up", prompt, greedy(4)))
    while core.has_unfinished():
        core.step()


def run_engine(core: EngineCore, workload: Workload, variant: str) -> RunResult:
    t0 = time.monotonic()
    arrivals = _Arrivals(workload.requests, t0)
    timings: list[RequestTiming] = []
    prefill = 0
    peak = rss_mb()
    sent: list[list[int]] = []
    while arrivals.heap or core.has_unfinished():
        for at, r in arrivals.due(time.monotonic()):
            core.add_request(Request(r.request_id, r.prompt_token_ids, greedy(r.max_tokens), arrival_time=at))
            sent.append(r.prompt_token_ids)
        if not core.has_unfinished():
            time.sleep(max(0.0, arrivals.next_at() - time.monotonic()))
            continue
        _, stats = core.step()
        prefill += stats.num_prompt_tokens
        now = time.monotonic()
        for f in stats.finished:
            timings.append(RequestTiming(f.request_id, f.ttft, f.queue_time, f.e2e_latency, f.num_prompt_tokens,
                                         f.num_cached_tokens, f.num_output_tokens, f.inter_token_latencies,
                                         f.finish_reason == "error"))
            arrivals.finished(f.request_id, now)
        if stats.scheduler.num_steps % 8 == 0:
            peak = max(peak, rss_mb())
    duration = time.monotonic() - t0
    pc = core.prefix_cache_stats()
    return RunResult(workload.name, variant, timings, duration, prefill,
                     oracle_prefill_tokens(sent, core.config.block_size), pc.hits, pc.queries,
                     pc.evictions_capacity, core.scheduler.num_preemptions, max(peak, rss_mb()))


# ---- plain transformers

class _TokenClock:
    """A stopping criterion that never stops: it notes when each new token came out."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@functools.cache
def load_hf(path: str):
    from transformers.utils import logging as hf_logging

    from bench.hf_baseline import hf_model
    hf_logging.disable_progress_bar()
    model = hf_model(path)
    _hf_generate(model, [list(range(1, 200))], 4, 0)  # warm-up, like the engine's
    return model


def _hf_generate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[float, list[float]]:
    """Greedy generate on a left-padded batch; returns (start, token times)."""
    from transformers import StoppingCriteriaList
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]))
    return start, clock.times


def run_transformers(model_path: str, workload: Workload, variant: str, batch_size: int = 1,
                     block_size: int = 16) -> RunResult:
    """A static-batching FIFO server: when idle it takes up to batch_size arrived requests (length-sorted
    when more are waiting, the best case for padding) and runs one `generate` over them."""
    model = load_hf(model_path)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    arrivals = _Arrivals(workload.requests, 0.0)
    clock, timings, peak, sent = 0.0, [], rss_mb(), []
    while arrivals.heap:
        clock = max(clock, arrivals.next_at())
        ready = sorted(arrivals.due(clock), key=lambda x: (x[0], x[1].request_id))
        batch, rest = ready[:batch_size], ready[batch_size:]
        if len(ready) > batch_size:
            ready.sort(key=lambda x: len(x[1].prompt_token_ids))
            batch, rest = ready[:batch_size], ready[batch_size:]
        for at, r in rest:
            arrivals.push(at, r)
        start, times = _hf_generate(model, [r.prompt_token_ids for _, r in batch], batch[0][1].max_tokens, pad_id)
        finish = clock + times[-1] - start
        for at, r in batch:
            first = clock + times[0] - start
            timings.append(RequestTiming(r.request_id, first - at, clock - at, finish - at, len(r.prompt_token_ids),
                                         0, len(times), list(np.diff(times))))
            sent.append(r.prompt_token_ids)
            arrivals.finished(r.request_id, finish)
        clock = finish
        peak = max(peak, rss_mb())
    first_arrival = min(r.arrival_s for r in workload.requests)
    prefill = sum(len(p) for p in sent)
    return RunResult(workload.name, variant, timings, clock - first_arrival, prefill,
                     oracle_prefill_tokens(sent, block_size), 0, prefill, peak_rss_mb=peak)
