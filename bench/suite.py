"""The whole benchmark in one run: every workload x variant side by side, then the micro-benchmarks."""
from __future__ import annotations

import gc
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import driver, micro, workloads
from bench.workloads import FULL, QUICK, Scale, Workload
from engine.config import HashAlgo
from engine.model.loader import resolve_model_path

SHARED_PREFIX = 960  # tokens of the 1,000-token decode contexts that every prompt shares (bench.decode)
ALL_WORKLOADS = ("chatbot", "multiturn", "rag", "nosharing", "bursty", "prefix_mix", "mixed")


@dataclass(slots=True)
class Options:
    model: str = "default"
    workloads: tuple[str, ...] = ALL_WORKLOADS
    quick: bool = False
    peers: bool = False
    http: bool = True
    log: bool = True
    engine_overrides: dict = field(default_factory=dict)  # e.g. a small num_kv_blocks for tiny test models
    scale: Scale | None = None  # None: QUICK or FULL
    out: Path | None = None  # where partial results go as the run goes on


@dataclass(slots=True)
class Plan:
    """Which variants run on which workload; `hf_subset`: requests transformers gets (None: all)."""

    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    hf_subset: dict[str, int | None] = field(default_factory=dict)
    repeats: dict[str, int] = field(default_factory=dict)  # engine variants run interleaved N times, best kept


def plan_for(quick: bool) -> Plan:
    if quick:  # transformers (the slow side) on a few requests only; no cache-off run of mixed
        return Plan({"chatbot": ("cache-on", "cache-off", "hf-b1"), "multiturn": ("cache-on", "cache-off"),
                     "rag": ("cache-on", "cache-off"), "nosharing": ("cache-on", "cache-off", "hf-b1"),
                     "bursty": ("cache-on", "cache-off"), "prefix_mix": ("fcfs", "lpm"),
                     "mixed": ("cache-on", "hf-b1")},
                    {"chatbot": 3, "nosharing": 3}, {"nosharing": 2})
    return Plan({"chatbot": ("cache-on", "cache-off", "hf-b1"), "multiturn": ("cache-on", "cache-off"),
                 "rag": ("cache-on", "cache-off", "hf-b1"), "nosharing": ("cache-on", "cache-off", "hf-b1", "hf-b8"),
                 "bursty": ("cache-on", "cache-off"), "prefix_mix": ("fcfs", "lpm"),
                 "mixed": ("cache-on", "cache-off", "hf-b1", "hf-b8")},
                {"chatbot": 16, "rag": 8}, {"nosharing": 3})


class Suite:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.scale: Scale = opts.scale or (QUICK if opts.quick else FULL)
        self.plan = plan_for(opts.quick)
        self.model_path = str(resolve_model_path(opts.model))
        probe = driver.EngineCore(driver.EngineConfig(model=self.model_path, num_kv_blocks=16))
        self.tokenizer = probe.tokenizer
        self.max_model_len = probe.max_model_len
        driver.warm_up(probe)  # first forwards pay for allocations and page faults: not in any row
        del probe
        self.rows: list[dict] = []
        self.extra: dict = {}

    def log(self, message: str) -> None:
        if self.opts.log:
            print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)

    # ---- workloads x variants

    def run_workloads(self) -> None:
        for name in self.opts.workloads:
            workload = workloads.build(name, self.tokenizer, self.scale)
            variants = self.plan.variants[name]
            n = self.plan.hf_subset.get(name)
            if n and n < len(workload.requests):
                # transformers is too slow for every request: it and our engine both run the same subset,
                # as their own workload, so no plot sets a shorter queue beside a longer one
                self.run_same_requests(workload, n, [v for v in variants if v.startswith("hf-")])
                variants = tuple(v for v in variants if not v.startswith("hf-"))
            repeats = self.plan.repeats.get(name, 1)
            best: dict[str, dict] = {}
            # the engine variants take turns, so a burst of load from elsewhere hits both alike
            for round_ in range(repeats):
                for variant in variants:
                    if variant.startswith("hf-") and round_ > 0:
                        continue
                    self.log(f"{name} / {variant}: {len(workload.requests)} requests, "
                             f"{workload.num_prompt_tokens} prompt tokens" + (f" (run {round_ + 1}/{repeats})"
                                                                              if repeats > 1 else ""))
                    row = self.run_variant(workload, variant)
                    gc.collect()
                    if variant not in best or row.get("output_tok_s", 0) > best[variant].get("output_tok_s", 0):
                        best[variant] = row
            for variant in variants:
                row = best[variant]
                if repeats > 1 and not variant.startswith("hf-") and row.get("status") == "ok":
                    row["note"] = f"best of {repeats} interleaved runs"
                self.rows.append(row)
            self.checkpoint()

    def run_same_requests(self, workload: Workload, n: int, hf_variants: list[str]) -> None:
        sub = workloads.subset(workload, n)
        sub = Workload(f"{workload.name}@{n}", f"{workload.description}; {n} of {len(workload.requests)} requests",
                       sub.requests, workload.engine_overrides)
        for variant in ("cache-on", *hf_variants):
            self.log(f"{sub.name} / {variant}: {len(sub.requests)} requests (the same for every variant)")
            self.rows.append(self.run_variant(sub, variant))
            gc.collect()

    def checkpoint(self) -> None:
        """Rows so far to results.json, so an interrupted full run still leaves its figures."""
        if self.opts.out is not None:
            from bench.report import write_json
            write_json({"environment": self.environment(), "rows": self.rows, "extra": self.extra,
                        "partial": True}, self.opts.out)

    def run_variant(self, workload: Workload, variant: str) -> dict:
        start = time.perf_counter()
        try:
            if variant.startswith("hf-"):
                result = driver.run_transformers(self.model_path, workload, variant, batch_size=int(variant[4:]))
            else:
                core = driver.make_core(self.model_path, workload, self.opts.engine_overrides,
                                        **_engine_knobs(variant))
                result = driver.run_engine(core, workload, variant)
                del core
            row = result.summary()
        except Exception as exc:  # one broken variant must not lose the rest of the run
            traceback.print_exc()
            row = {"workload": workload.name, "variant": variant, "status": f"failed: {exc!r}"}
        row["wall_s"] = time.perf_counter() - start
        row["description"] = workload.description
        return row

    # ---- the brief's chatbot bar

    def chatbot_bar(self) -> None:
        """SmolLM2 chatbot: cold request, warm request, 8 concurrent users (cold and warm cache)."""
        chat = workloads.chatbot(self.tokenizer, Scale(chatbot_users=18, max_tokens=16))
        reqs = chat.requests
        for r in reqs:
            r.arrival_s = 0.0
        core = driver.make_core(self.model_path, chat, self.opts.engine_overrides)
        cold = driver.run_engine(core, Workload("bar", "", reqs[:1]), "cold").timings[0]
        warm = driver.run_engine(core, Workload("bar", "", reqs[1:2]), "warm").timings[0]
        warm8 = None if self.opts.quick else driver.run_engine(core, Workload("bar", "", reqs[2:10]), "warm8").summary()
        del core
        core = driver.make_core(self.model_path, chat, self.opts.engine_overrides)
        cold8 = driver.run_engine(core, Workload("bar", "", reqs[10:18]), "cold8").summary()
        del core
        self.extra["chatbot_bar"] = {
            "prompt_tokens": len(reqs[0].prompt_token_ids),
            "cold_ttft_s": cold.ttft, "cold_e2e_s": cold.e2e, "warm_ttft_s": warm.ttft, "warm_e2e_s": warm.e2e,
            "concurrent8_cold_ttft_p90_s": cold8["ttft_p90_s"], "concurrent8_warm_ttft_p90_s": warm8["ttft_p90_s"] if warm8 else None,
            "peer": {"warm_s": 0.17, "cold_s": 2.8, "concurrent8_ttft_p90_s": 10.0},
        }

    # ---- decode speed (issue 12)

    def decode(self) -> None:
        from bench import decode
        batches, steps = ((1, 8), 12) if self.opts.quick else ((1, 4, 8, 16), 24)
        self.extra["decode"] = decode.run(self.model_path, batches, steps=steps, log=self.log)
        # the product's case: a shared system prompt (960 of the 1,000 tokens), which cascade attention reads once
        self.extra["decode_shared"] = decode.run(self.model_path, (1, 8), steps=steps, log=self.log,
                                                 shared_prefix=SHARED_PREFIX)

    def multiturn_http(self) -> None:
        from bench import multiturn
        self.extra["multiturn4"] = multiturn.run(self.model_path, turns=2 if self.opts.quick else 4,
                                                 http=self.opts.http, log=self.log)

    # ---- micro-benchmarks

    def micro(self) -> None:
        self.extra["hash_lookup"] = [micro.hash_lookup_us_per_block(a) for a in (HashAlgo.SHA256, HashAlgo.XXHASH)]
        self.extra["lpm_step"] = [micro.lpm_step_ms(n) for n in (256, 1024)]
        gflops = micro.matmul_gflops()

        def factory():
            return driver.EngineCore(driver.EngineConfig(model=self.model_path, enable_prefix_caching=False,
                                                         num_kv_blocks=256))

        lengths = [n for n in (512, 2048) if n < self.max_model_len]
        self.extra["prefill_efficiency"] = micro.prefill_efficiency(factory, lengths, gflops)

    def optional_http(self) -> None:
        if self.opts.peers:
            self.run_peers()
        if not self.opts.http:
            self.extra["http"] = {"status": "not run (--no-http)"}
            return
        from bench import http
        names = [n for n in ("chatbot",) + (() if self.opts.quick else ("mixed",)) if n in self.opts.workloads]
        for name in names:
            workload = workloads.build(name, self.tokenizer, self.scale)
            self.log(f"{name} / http-cache-on: {len(workload.requests)} requests through the gateway")
            start = time.perf_counter()
            try:
                core = driver.make_core(self.model_path, workload, self.opts.engine_overrides)
                row = http.run_gateway(core, workload).summary()
                del core
            except Exception as exc:  # the gateway is someone else's moving part: report, go on
                traceback.print_exc()
                row = {"workload": name, "variant": "http-cache-on", "status": f"not run: {exc!r}"}
            row["wall_s"] = time.perf_counter() - start
            self.rows.append(row)
        self.log("gateway alone: instant engine stub, 64 clients")
        try:
            self.extra["gateway_stub"] = http.gateway_overhead(self.model_path, seconds=3 if self.opts.quick else 10)
        except Exception as exc:
            traceback.print_exc()
            self.extra["gateway_stub"] = {"status": f"not run: {exc!r}"}

    def run_peers(self) -> None:
        why = _peer_status()
        if why is None and "chatbot" not in self.opts.workloads:
            why = "not run: the peer runs the chatbot workload, which was not selected"
        if why is not None:
            self.extra["peers"] = {"status": why}
            self.log(f"peers: {why}")
            return
        from bench import http
        workload = workloads.build("chatbot", self.tokenizer, self.scale)
        self.log(f"chatbot / peer-tf-serve: {len(workload.requests)} requests")
        try:
            row = http.run_peer(self.model_path, workload).summary()
            self.extra["peers"] = {"status": "ok"}
        except Exception as exc:
            traceback.print_exc()
            row = {"workload": "chatbot", "variant": "peer-tf-serve", "status": f"not run: {exc!r}"}
            self.extra["peers"] = {"status": row["status"]}
        self.rows.append(row)

    def environment(self) -> dict:
        return {"model": self.model_path, "quick": self.opts.quick, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
                "load_avg_1m_at_end": os.getloadavg()[0], "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(), "python": platform.python_version(),
                "scale": {k: getattr(self.scale, k) for k in self.scale.__slots__}}


def _engine_knobs(variant: str) -> dict:
    if variant in ("fcfs", "lpm"):
        return {"scheduling_policy": variant}
    return {"enable_prefix_caching": variant != "cache-off"}


def _peer_status() -> str | None:
    """None when `transformers serve` can run here, else why not."""
    import importlib.util

    from bench.http import transformers_cli
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if transformers_cli() is None:
        return "not installed: no `transformers` CLI next to this Python or on PATH"
    if missing:
        return (f"not installed: `transformers serve` needs {' and '.join(missing)} "
                "(pip install 'transformers[serving]'); peer rows not run")
    return None
