"""The step loop: schedule, run one forward pass, sample, register full blocks, emit deltas."""
from __future__ import annotations

import logging
import time
from functools import partial

import torch

from engine import heap, prompt_logprobs
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv.disk_tier import DiskTier, model_fingerprint, open_disk_tier
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_io import KVBlockIO
from engine.messages import CacheCommand, CacheErased, PinList
from engine.model import cpu_kernels, huge_pages
from engine.model.gguf_loader import generation_config
from engine.model.llama import LlamaForCausalLM, head_dim
from engine.model.loader import load_model, resolve_model_path, weights_format
from engine.model.model_config import load_config
from engine.outputs import FinishReason, RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampling import Sampler
from engine.sampling_params import SampledToken, SamplingParams, validate_prompt
from engine.scheduler import ScheduledChunk, Scheduler
from engine.step_cost import StepTimeTarget, calibrate
from engine.grammar import GrammarCache, GrammarError
from engine.stats import FinishedRequestStats, PrefixCacheStats, SchedulerStats, StepStats
from engine.threads import ThreadBudget
from engine.threads import choose as choose_threads
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("prefixgate.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    """Single-threaded engine: everything here runs on the thread that calls step()."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None, *, prefill_compile: bool = False,
                 decode_step: bool = True) -> None:
        """model: weights another engine already loaded for the same model, dtype and device, to share
        instead of loading them again (each engine keeps its own KV cache). prefill_compile (serve): on a first
        start, a second process compiles the kernels of steps with a prefill chunk while this one compiles the
        decode step (engine/model/compile.py). decode_step False: no compiled decode step (that second process)."""
        self.config = config
        self.device = _resolve_device(config.device)
        dtype = _resolve_dtype(config.dtype, self.device)
        compiled = config.cpu_kernels == "compiled" and self.device.type == "cpu"
        if compiled:
            cpu_kernels.check_available()
        path = resolve_model_path(config.model, config.model_cache_dir)
        second = None
        if compiled and prefill_compile:
            from engine.model.compile import start_prefill_compile
            second = start_prefill_compile(config, path)
        hf_config = load_config(path)
        self.model_path = path
        self.weights_format = weights_format(path, config.quantization, config.dtype, compiled)
        kv_dtype = _kv_dtype(config.kv_cache_dtype, dtype, self.weights_format)
        self.integer_activations = config.quantized_activations == "int8" and self.weights_format != "none"
        if config.quantized_activations == "int8" and not self.integer_activations:
            logger.warning("quantized_activations int8 applies to quantized weights (a GGUF file's own formats, or "
                           "quantization q8_0 / q4_0, on the compiled CPU kernels): these run in %s on float "
                           "arithmetic", str(dtype).removeprefix("torch."))
        self.model = model if model is not None else load_model(path, hf_config, dtype, self.device, pack=compiled,
                                                                weights=self.weights_format,
                                                                integer_activations=self.integer_activations)
        self.tokenizer = load_tokenizer(path, _eos_token_ids(path, hf_config))
        self.vocab_size = hf_config.vocab_size
        kv_cache = _allocate_kv_cache(config, hf_config, kv_dtype, self.device)
        self.num_blocks = kv_cache.shape[2]
        self.max_model_len = _context_length(config, hf_config, self.num_blocks)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                                 hash_algo=config.hash_algo, min_shared_prefix_tokens=config.min_shared_prefix_tokens,
                                 eviction_policy=config.eviction_policy,
                                 max_pinned_blocks=int(config.max_pinned_fraction * self.num_blocks))
        if config.kv_disk_dir and config.enable_prefix_caching:
            kv_io = KVBlockIO(kv_cache)
            # K/V written by int8-activation decode steps are not the float kernel's: neither may serve the other
            weights = self.weights_format + ("/int8" if self.integer_activations else "")
            if (disk := _disk_tier(config, path, dtype, kv_dtype, kv_io, weights)) is not None:
                self.kv.use_disk_tier(disk, kv_io)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.model, kv_cache, self.kv, self.device, compiled_kernels=compiled,
                                  decode_step=decode_step)
        if second is not None:
            second.wait()
        if not config.enforce_eager and self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_model_len,
                                                                         config.max_num_batched_tokens):
            logger.info("captured CUDA graphs of decode steps for batch sizes %s", self.runner.graph_decode.batch_sizes)
            if (prefill := self.runner.graph_prefill) is not None:
                logger.info("captured CUDA graphs of steps with a prefill chunk for token buckets %s", prefill.buckets)
        self.thread_budget: ThreadBudget | None = None
        if self.device.type == "cpu":  # before any request holds blocks: the prefill probe writes scratch K/V
            probe_tokens = max(1, min(128, config.max_num_batched_tokens, self.num_blocks * config.block_size - 2))
            self.thread_budget = choose_threads(config.threads, config.threads_batch, self.runner.decode_probe,
                                                partial(self.runner.calibration_step, probe_tokens, 1))
            self.thread_budget.apply(has_prefill=True)
        self.step_target: StepTimeTarget | None = None
        if config.max_step_ms is not None:
            self.step_target = _step_target(config, self.runner, self.num_blocks)
            self.scheduler.prefill_cap = self.step_target.prefill_budget
        self.sampler = Sampler(frozenset(self.tokenizer.eos_token_ids))
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        # since the last stats handed out: finished requests, and latencies observed when they happened
        self._finished: list[FinishedRequestStats] = []
        self._ttfts: list[float] = []
        self._prefill_times: list[float] = []
        self._inter_token_latencies: list[float] = []
        # the last run's pins come back only now: the probes above write scratch K/V from slot 0, where the blocks
        # read back for them would lie (they overwrote a pinned system prompt's K/V, and its answers changed)
        if restored := self.kv.restore_pins(config.salt_fingerprint, config.tenants):
            logger.info("disk tier: %d pinned prefixes restored (%d blocks)", restored, self.kv.pins.num_blocks)
        self._release_idle_memory()  # with loading's freed temporaries

    # ---- requests in and out

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.tokenizer.eos_token_ids)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.validate(request.prompt_token_ids, request.params)
        if request.params.structured is not None and request.matcher is None:
            request.matcher = self.grammars.matcher(request.params.structured)
        params = request.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                             params.skip_special_tokens)
        self.requests[request.request_id] = request
        self.detokenizers[request.request_id] = detokenizer
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Graceful shutdown: cached RAM blocks go to the disk tier, so the next start hits them (and finds
        its pins)."""
        disk = self.kv.disk
        if disk is not None and not disk.closed:
            before = disk.snapshot()
            queued = self.kv.flush_to_disk()
            self.kv.save_pins()
            disk.close()
            after = disk.snapshot()
            lost = (sum(after.write_errors.values()) - sum(before.write_errors.values())
                    + after.dropped_spills - before.dropped_spills)
            if lost:
                logger.warning("disk tier: %d of %d cached blocks could not be written to %s at shutdown",
                               lost, queued, disk.dir)
            else:
                logger.info("disk tier: wrote %d cached blocks to %s at shutdown", queued, disk.dir)

    def idle(self, just_idle: bool) -> None:
        """No request runs. Pins expire; on becoming idle, the disk tier (if any) gets the cached blocks it
        lacks and the pins, so a killed engine restarts warm, and a quantized model's prefill scratch goes back
        to the OS."""
        self.kv.pins.expire()
        if self.kv.disk is not None and not self.kv.disk.closed:
            if just_idle:
                self.kv.write_behind()
            self.kv.save_pins()
        if just_idle:
            self._release_idle_memory()

    def _release_idle_memory(self) -> None:
        """A quantized model's prefill scratch and the heap's freed pages back to the OS."""
        if self.weights_format != "none":
            from engine.model import quant_matmul_cpu
            quant_matmul_cpu.release_prefill_scratch()
        heap.trim()

    def cache_command(self, command: CacheCommand) -> PinList | CacheErased:
        if command.op == "list":
            return PinList(self.kv.pins.list(command.tenant), self.kv.pins.tenant_blocks(command.tenant))
        if command.op == "erase":
            erased = self.kv.erase(command.tenant)
            logger.info("erased the cache of tenant %s: %d blocks, %d block files, %d pins", command.tenant,
                        erased.blocks, erased.disk_blocks, erased.pins)
            return erased
        raise ValueError(f"unknown cache command {command.op!r}")

    # ---- one step

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One step; an exception fails only the requests it concerns, never the engine."""
        self.num_steps += 1
        self.kv.pins.expire()
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # the queues may be half updated and nothing says by whom: fail them all
            logger.exception("scheduling failed; failing all %d requests", len(self.requests))
            return self._fail(list(self.requests.values()), "scheduling failed", exc), self.take_stats()
        if not sched.chunks:
            return [], self.take_stats()
        num_prompt_tokens = sum(_prompt_tokens_in(c) for c in sched.chunks)
        if self.thread_budget is not None:
            self.thread_budget.apply(any(c.request.is_catching_up for c in sched.chunks), len(sched.chunks),
                                     sched.num_tokens)
        started = time.perf_counter()
        try:
            logits, sampled = self.runner.execute(sched.chunks)
        except Exception as exc:  # one forward pass for the whole batch: it fails as a whole
            logger.exception("engine step failed; failing its %d requests", len(sched.chunks))
            return self._fail([c.request for c in sched.chunks], "engine step failed", exc), self.take_stats()
        if self.thread_budget is not None:
            self.thread_budget.observe(time.perf_counter() - started)
        pooled = [(c, self.runner.hidden[i]) for i, c in enumerate(sampled) if c.request.params.pooling]
        greedy_ids = self.runner.greedy_ids
        if pooled:  # embedding requests take their hidden state, not a token
            keep = [i for i, c in enumerate(sampled) if not c.request.params.pooling]
            logits, sampled = logits[keep], [sampled[i] for i in keep]
            greedy_ids = None
        tokens = self._sample(logits, sampled, greedy_ids) if sampled else []
        if self.step_target is not None:
            self._observe_step_time(sched.chunks, time.perf_counter() - started)
        now = time.monotonic()
        for chunk in sched.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        outputs: list[RequestOutput] = []
        for request, first, prompt_logits in self.runner.prompt_logits:
            outputs += self._guarded(request, self._score_prompt, first, prompt_logits)
        self.runner.prompt_logits = []
        for chunk, hidden in pooled:
            if not chunk.request.is_finished:  # (its prompt's scoring failed)
                outputs += self._guarded(chunk.request, self._pool, hidden)
        for chunk, token in zip(sampled, tokens):
            if chunk.request.is_finished:
                continue
            if isinstance(token, Exception):
                outputs += self._fail([chunk.request], "sampling failed", token)
            else:
                outputs += self._guarded(chunk.request, self._append, token, now)
        sampled_ids = {id(c) for c in sampled}
        for chunk in sched.chunks:
            if id(chunk) not in sampled_ids and not chunk.request.is_finished:
                # a prefill chunk's full blocks hit from the next step on
                outputs += self._guarded(chunk.request, self.kv.cache_full_blocks)
        num_generated = sum(1 for t in tokens if not isinstance(t, Exception))
        return outputs, self.take_stats(num_prompt_tokens, num_generated)

    def _observe_step_time(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """Corrects the step-time target's cost model by the step just run (before its tokens count as computed)."""
        decodes = [c for c in chunks if not c.request.is_catching_up]
        num_prefill = sum(c.num_tokens for c in chunks) - len(decodes)
        if num_prefill:  # only steps with a prefill share are sized by the model; pure decode steps take
            # another, faster code path (on CPU the compiled step) and would pull the correction down
            self.step_target.observe(num_prefill, sum(c.request.num_tokens for c in decodes), seconds)

    def _guarded(self, request: Request, work, *args) -> list[RequestOutput]:
        """`work(request, *args)`, one request's share of the step: if it raises, that request alone fails."""
        try:
            output = work(request, *args)
        except GrammarError as exc:
            logger.warning("request %s: %s", request.request_id, exc)
            return self._fail([request], "engine step failed", exc)
        except Exception as exc:
            logger.exception("request %s failed in its step", request.request_id)
            return self._fail([request], "engine step failed", exc)
        return [output] if output is not None else []

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledChunk],
                greedy_ids=None) -> list[SampledToken | Exception]:
        """One token per sampled chunk, or the exception that sampling its row raised. greedy_ids: each row's
        argmax where the step found them already."""
        try:
            return self.sampler(logits, [c.request.params for c in sampled],
                                [c.request.generator(logits.device) for c in sampled], [c.request for c in sampled],
                                greedy_ids)
        except Exception:  # one bad row must not fail the batch: sample row by row to find it
            return [self._sample_row(logits[i:i + 1], c.request) for i, c in enumerate(sampled)]

    def _sample_row(self, logits: torch.Tensor, request: Request) -> SampledToken | Exception:
        try:
            return self.sampler(logits, [request.params], [request.generator(logits.device)], [request])[0]
        except GrammarError as exc:
            logger.warning("request %s: %s", request.request_id, exc)
            return exc
        except Exception as exc:
            logger.exception("sampling failed for request %s", request.request_id)
            return exc

    def _append(self, request: Request, token: SampledToken, now: float) -> RequestOutput:
        """Add a sampled token to its request: timings, block caching, text and stop checks."""
        first = request.first_token_time is None
        if first:
            self._ttfts.append(now - request.arrival_time)
            self._prefill_times.append(now - (request.first_scheduled_time or now))
        else:
            self._inter_token_latencies.append(now - request.last_token_time)
        request.append_token(token, now)
        self.kv.cache_full_blocks(request)
        if first:  # the prompt is computed and cached: its breakpoints can be pinned
            self.kv.pin_prompt(request)
        return self._emit(request, token)

    def _score_prompt(self, request: Request, first: int, logits: torch.Tensor) -> None:
        """The logprobs of prompt tokens first.. (a chunk's share: the runner leaves out those already scored)."""
        targets = request.prompt_token_ids[first:first + len(logits)]
        request.prompt_logprobs += prompt_logprobs.score(logits, targets, request.params.prompt_logprobs)

    def _pool(self, request: Request, hidden: torch.Tensor) -> RequestOutput:
        """A pooling request's prompt is computed: its embedding is the last token's final hidden state."""
        if request.params.pooling == "last":
            request.embedding = torch.nn.functional.normalize(hidden.float(), dim=-1).tolist()
        self.kv.cache_full_blocks(request)  # a document embedded now is a cache hit when it is asked about
        self.kv.pin_prompt(request)
        return self._finish(request, FinishReason.STOP)

    def _fail(self, requests: list[Request], what: str, exc: Exception) -> list[RequestOutput]:
        """Finish each request (not finished yet) with an error: its blocks go back to the pool."""
        own = isinstance(exc, GrammarError)  # the request's grammar gave up, not the engine
        outputs = [self._finish(r, FinishReason.ERROR, error=str(exc) if own else f"{what}: {exc!r}")
                   for r in requests if self.requests.get(r.request_id) is r]
        for output in outputs:
            output.error_is_request = own
        return outputs

    def _emit(self, request: Request, token) -> RequestOutput:
        detok = self.detokenizers[request.request_id]
        reason = self._stop_reason(request, detok)
        if reason is not None:
            return self._finish(request, reason, new_tokens=[token])
        return self._output(request, [token], detok.take(finished=False))

    def _stop_reason(self, request: Request, detok: IncrementalDetokenizer) -> str | None:
        token_id, params = request.output_token_ids[-1], request.params
        is_eos = token_id in self.tokenizer.eos_token_ids and not params.ignore_eos
        if is_eos or token_id in params.stop_token_ids:
            request.stop_reason = None if is_eos else token_id
            if params.include_stop_str_in_output:  # its whole text (vLLM checks stop tokens before stop strings)
                detok.update(request.output_token_ids, stops=False)
            return FinishReason.STOP
        if detok.update(request.output_token_ids):
            request.stop_reason = detok.matched_stop
            return FinishReason.STOP
        if request.matcher is not None and request.matcher.is_terminated:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: str, new_tokens=(), error: str | None = None) -> RequestOutput:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        self._finished.append(self._finished_stats(request))
        detok = self.detokenizers.pop(request.request_id)
        text = "" if error is not None else detok.take(finished=True)  # a failed request's text may be broken
        return self._output(request, list(new_tokens), text, error)

    def _output(self, request: Request, new_tokens, text: str, error: str | None = None) -> RequestOutput:
        scored = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            scored, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[t.token_id for t in new_tokens],
            new_text=text,
            new_logprobs=list(new_tokens) if request.params.logprobs is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=len(request.output_token_ids),
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=error,
            embedding=request.embedding,
            num_disk_cached_tokens=request.num_disk_cached_tokens,
            num_cache_write_tokens=self._cache_write_tokens(request),
            num_pinned_tokens=request.num_pinned_tokens,
            pinned_until=request.pinned_until,
            pin_refused=request.pin_refused,
            prompt_logprobs=scored,
        )

    def _cache_write_tokens(self, request: Request) -> int:
        """Prompt tokens in full blocks that this request computed (not hit): each such block was registered
        in the cache as it filled."""
        if not self.kv.enable_caching:
            return 0
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        return max(0, computed // self.config.block_size * self.config.block_size - (request.num_cached_tokens or 0))

    # ---- stats

    def prefix_cache_stats(self) -> PrefixCacheStats:
        pool = self.kv.pool
        stats = PrefixCacheStats(queries=self.kv.num_queried_tokens, hits=self.kv.num_hit_tokens,
                                 requests=self.kv.num_lookups, evictions_capacity=pool.evictions["capacity"],
                                 evictions_preemption=self.kv.num_preemption_evictions,
                                 cached_blocks=len(pool.cached),
                                 free_cached_blocks=pool.num_free_cached, usage=pool.usage(),
                                 evictions_spill=pool.evictions["spill"],
                                 regrets=pool.num_regrets, disk_hits=self.kv.num_disk_hit_tokens,
                                 evictions_erase=pool.evictions["erase"], pins=len(self.kv.pins.pins),
                                 pinned_blocks=self.kv.pins.num_blocks, max_pinned_blocks=self.kv.pins.max_blocks,
                                 pins_released=dict(self.kv.pins.released),
                                 tenant_pinned_blocks=self.kv.pins.tenants_blocks())
        if self.kv.disk is not None:
            stats.disk = self.kv.disk.snapshot()
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                              num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
                              num_blocks=self.num_blocks, num_free_blocks=self.kv.pool.num_free_blocks,
                              prefix_cache=self.prefix_cache_stats())

    def take_stats(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> StepStats:
        """Stats of the step just run, with every request finished since the last call."""
        finished, self._finished = self._finished, []
        ttfts, self._ttfts = self._ttfts, []
        prefill_times, self._prefill_times = self._prefill_times, []
        inter_token_latencies, self._inter_token_latencies = self._inter_token_latencies, []
        pool = self.kv.pool
        return StepStats(self.scheduler_stats(), num_prompt_tokens, num_generation_tokens, finished,
                         tenant_cache=self.kv.take_tenant_lookups(), tenant_evictions=pool.take_tenant_evictions(),
                         ttfts=ttfts, prefill_times=prefill_times, inter_token_latencies=inter_token_latencies,
                         kv_events=pool.take_kv_events(), tenant_regrets=pool.take_tenant_regrets(),
                         tenant_pin_expiries=self.kv.pins.take_tenant_expiries(),
                         tenant_pin_refusals=self.kv.pins.take_tenant_refusals(),
                         threads=self.thread_budget.counts() if self.thread_budget is not None else None)

    def _finished_stats(self, r: Request) -> FinishedRequestStats:
        end = time.monotonic()
        first_token = r.first_token_time or end
        scheduled = r.first_scheduled_time or end
        return FinishedRequestStats(
            request_id=r.request_id, tenant=r.tenant, finish_reason=r.finish_reason or FinishReason.ABORT,
            num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens or 0,
            num_output_tokens=len(r.output_token_ids), queue_time=scheduled - r.arrival_time,
            ttft=first_token - r.arrival_time,
            e2e_latency=end - r.arrival_time, inter_token_latencies=list(r.inter_token_latencies),
            num_disk_cached_tokens=r.num_disk_cached_tokens, num_cache_write_tokens=self._cache_write_tokens(r))


def _context_length(config: EngineConfig, hf_config, num_blocks: int) -> int:
    """The model's context, capped by what the KV pool holds: a longer request could never finish. A longer
    one than the model's own is served as asked, with a warning (llama.cpp's way; positions past its training
    length may degrade answers)."""
    trained = hf_config.max_position_embeddings
    wanted = config.max_model_len or trained
    if wanted > trained:
        logger.warning("context length %d exceeds the model's own (%d, max_position_embeddings): answers past "
                       "%d tokens may degrade", wanted, trained, trained)
    # a request that generates nothing (an embedding, a scored prompt) holds K/V for every token of its prompt
    capacity = num_blocks * config.block_size
    if wanted > capacity:
        logger.warning("context length %d exceeds the KV pool; serving %d tokens", wanted, capacity)
    return min(wanted, capacity)


def _prompt_tokens_in(chunk: ScheduledChunk) -> int:
    start = chunk.request.num_computed_tokens
    return max(0, min(start + chunk.num_tokens, chunk.request.num_prompt_tokens) - start)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _kv_dtype(name: str, dtype: torch.dtype, weights: str) -> torch.dtype:
    """K/V storage: `auto` is the model's dtype, and bfloat16 beside quantized weights (as llama.cpp keeps K/V in
    16 bits): the pool holds twice the blocks, and the CPU decode step reads half the bytes (measured faster on
    AVX2 and AVX-512, docs/speed.md#k-v-and-weight-dtypes)."""
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if weights != "none" else dtype


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: these CPUs have no fast bf16 matmul
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _eos_token_ids(path, hf_config) -> set[int]:
    ids: set[int] = set()
    eos = generation_config(path).get("eos_token_id")
    eos = eos if eos is not None else hf_config.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    return ids


def _step_target(config: EngineConfig, runner: ModelRunner, num_blocks: int) -> StepTimeTarget:
    """Calibrates the step cost model on the real model (before any request holds blocks: it writes scratch
    K/V from slot 0) for a target of max_step_ms."""
    num_slots = num_blocks * config.block_size - 1
    cost = calibrate(runner.calibration_step, prefill_tokens=min(256, num_slots - 1),
                     context_tokens=min(1024, num_slots))
    logger.info("step cost model: %.1f ms fixed, %.3f ms per prefill token, %.4f ms per context token",
                cost.fixed_s * 1e3, cost.per_prefill_token_s * 1e3, cost.per_context_token_s * 1e3)
    # at least one block per step, so a prefill always moves on even where the target cannot be met
    return StepTimeTarget(cost, config.max_step_ms / 1000, minimum=config.block_size)


def _disk_tier(config: EngineConfig, model_path, dtype: torch.dtype, kv_dtype: torch.dtype,
               kv_io: KVBlockIO, weights_format: str) -> DiskTier | None:
    fingerprint = model_fingerprint(model_path, dtype, config.block_size, kv_io.block_shape, config.hash_algo.value,
                                    kv_dtype, weights_format)
    return open_disk_tier(config.kv_disk_dir, int(config.kv_disk_gb * 2**30), fingerprint, kv_io.block_shape,
                          kv_dtype)


def _allocate_kv_cache(config: EngineConfig, hf_config, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    kv_heads, dim = hf_config.num_key_value_heads, head_dim(hf_config)
    layers = hf_config.num_hidden_layers
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        bytes_per_block = 2 * layers * config.block_size * kv_heads * dim * dtype.itemsize
        num_blocks = max(2, config.kv_cache_memory_mb * 2**20 // bytes_per_block)
    # NOTE: one tensor for the whole pool, allocated once; a token's slot is block_id * block_size + offset
    shape = (2, layers, num_blocks, config.block_size, kv_heads, dim)
    if device.type == "cpu":  # in huge pages, as the weights (huge_pages.py)
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)
