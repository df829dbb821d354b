"""Decode step time against the memory-bandwidth roofline: `python -m bench.decode`.

A decode step reads every weight once plus each sequence's K/V, so its floor is
(weight bytes + K/V bytes read) / memory bandwidth. The bandwidth is measured here with a streaming
read (a large tensor's sum on torch's threads, or on the GPU with --device cuda) before every timed
step, so that load from other processes shows in both alike. Step times and bandwidths are medians;
the roofline ratio is the median over steps of each step against the probe taken just before it.
Where batches 1 and 8 are both asked for, batch 8's steps are timed once more in turns with a batch-1
engine over the same weights, so that their ratio compares steps of the same moment
(measure_in_turns). --transformers times plain
`transformers` decoding the same prompts (its own KV cache, one forward per token) in the same run; --llama-bench
times llama.cpp on the same GGUF file from the same context against the same probe (bench/llama_bench.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import llama_bench
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model import huge_pages, loader
from engine.model.gguf_loader import WEIGHTS_NAME, is_gguf_dir
from engine.request import Request
from engine.sampling_params import SamplingParams

PROBE_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}  # far larger than any cache (an H100's L2 is 50 MB)


def bandwidth_probe(device: torch.device) -> torch.Tensor:
    """The tensor bandwidth_gb_s reads: on CPU in huge pages, as the engine keeps its weights and KV pool
    (huge_pages.py); in 4 KB pages the read is bound by TLB misses, not memory (27 against 34 GB/s measured)."""
    if device.type == "cpu":
        return huge_pages.zeros((PROBE_BYTES["cpu"] // 4,), torch.float32).fill_(1.0)
    return torch.ones(PROBE_BYTES[device.type] // 4, device=device)


def bandwidth_gb_s(probe: torch.Tensor, repeats: int = 3) -> float:
    """Streaming read: the best of a few sums over a tensor far larger than the caches, on every core this
    process may use (the machine's rate: the engine's thread budget, which sets torch's thread count, may have
    chosen one decode thread, and one core reads about half of it)."""
    budget = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    best = float("inf")
    try:
        for _ in range(repeats):
            _synchronize(probe.device)
            start = time.perf_counter()
            probe.sum()
            _synchronize(probe.device)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(budget)
    return probe.numel() * probe.element_size() / best / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the linear layers (the embedding reads only a few rows): quantized
    tiles as they are packed (integers, scales and mins), float weights at their dtype's size."""
    itemsize = next(p for p in model.parameters()).element_size()

    def read(m: torch.nn.Linear) -> int:
        if getattr(m, "quant", None) is None:
            return m.in_features * m.out_features * itemsize
        return m.quant.nbytes() + (m.quant_tail.nbytes() if getattr(m, "quant_tail", None) is not None else 0)
    return sum(read(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def kv_bytes_per_token(core: EngineCore) -> int:
    kv = core.runner.kv_slots
    return 2 * kv.shape[1] * kv.shape[3] * kv.shape[4] * kv.element_size()


def prompt(b: int, context: int, shared: int, vocab_size: int) -> list[int]:
    """Request b's prompt: its first `shared` tokens the same for every b (a shared system prompt), the rest its own."""
    return [(b * 7919 * (i >= shared) + 31 * i) % (vocab_size - 3) + 3 for i in range(context)]


def blocks_per_sequence(context: int, new_tokens: int, engine_overrides: dict) -> int:
    """KV blocks one decoding sequence needs, at the block size the engine will get."""
    return -(-(context + new_tokens) // engine_overrides.get("block_size", EngineConfig().block_size))


def start_decoding(core: EngineCore, batch: int, context: int, steps: int, shared: int = 0) -> list[Request]:
    """`batch` requests with `context`-token prompts whose first `shared` tokens are the same (a shared system
    prompt; the rest differ), prefilled; the next steps are pure decodes."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    requests = []
    for b in range(batch):
        requests.append(Request(f"decode-{b}", prompt(b, context, shared, core.vocab_size), params))
        core.add_request(requests[-1])
    while any(not r.output_token_ids for r in requests):
        core.step()
    return requests


def measure(core: EngineCore, probe: torch.Tensor, batch: int, context: int, steps: int, shared: int = 0) -> dict:
    requests = start_decoding(core, batch, context, steps, shared)
    step_s, bandwidth = [], []
    for i in range(steps):
        bandwidth.append(bandwidth_gb_s(probe, repeats=1))  # every step: the probe swings between steps
        start = time.perf_counter()
        core.step()
        step_s.append(time.perf_counter() - start)
    replay_ms = graph_replay_ms(core, batch)  # while the requests still hold their blocks
    for r in requests:
        core.abort(r.request_id)
    step = statistics.median(step_s)
    bw = statistics.median(bandwidth)
    weights = weight_bytes(core.model)
    # K/V a step has to read: the shared prefix once (cascade attention), each sequence's own part once
    kv = kv_bytes_per_token(core) * (shared + batch * (context - shared + steps // 2))
    roofline_s = (weights + kv) / (bw * 1e9)
    # each step against the probe taken just before it: the bandwidth here drifts within a minute (other
    # tenants of the host), and a step and its own probe see the same phase of that drift
    ratio = statistics.median((weights + kv) / (b * 1e9) / s for b, s in zip(bandwidth, step_s))
    return {"batch": batch, "context": context, "shared_prefix": shared, "step_ms": step * 1e3,
            "ms_per_token": step * 1e3 / batch, "tok_s": batch / step, "bandwidth_gb_s": bw,
            "weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "roofline_ms": roofline_s * 1e3, "roofline_ratio": ratio,
            "steps": steps, "graph_replay_ms": replay_ms}


def graph_replay_ms(core: EngineCore, batch: int, repeats: int = 50) -> float | None:
    """CUDA: the GPU's share of a step, the median replay of the step's graph alone (the rest of a step is
    the engine's Python: scheduling, block tables, sampling, detokenizing). The replays rewrite the K/V of
    the last step's slots with the same values."""
    graphs = core.runner.graph_decode
    if graphs is None or batch > graphs.max_rows:
        return None
    graph = graphs.graphs[graphs.graph_rows(batch)]
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def transformers_step_ms(model_path: str, batch: int, context: int, steps: int, dtype: str,
                         device: torch.device, shared: int = 0) -> float:
    """Median ms of one plain `transformers` decode step (a forward of each row's newest token over its own
    KV cache, then greedy argmax) after prefilling `batch` prompts of `context` tokens."""
    from bench.hf_baseline import hf_model
    hf = hf_model(model_path, getattr(torch, dtype)).to(device)
    prompts = torch.tensor([prompt(b, context, shared, hf.config.vocab_size) for b in range(batch)], device=device)
    times = []
    with torch.inference_mode():
        out = hf(prompts, use_cache=True)
        for _ in range(steps):
            _synchronize(device)
            start = time.perf_counter()
            newest = out.logits[:, -1].argmax(-1, keepdim=True)
            out = hf(newest, past_key_values=out.past_key_values, use_cache=True)
            out.logits[:, -1].argmax(-1).tolist()  # the engine's sampler reads its ids too
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure_in_turns(core: EngineCore, partner: EngineCore, batch: int, context: int, steps: int,
                     shared: int = 0) -> dict:
    """`batch` decodes on `core`, each step right after a batch-1 step on `partner` (an engine over the same
    weights): the two steps of a pair see the same moment of the machine, whose memory bandwidth swings
    within a minute, so their ratio carries less of that noise than two medians taken a few seconds apart."""
    batched = start_decoding(core, batch, context, steps, shared)
    single = start_decoding(partner, 1, context, steps, shared)
    pairs = []
    for _ in range(steps):
        start = time.perf_counter()
        partner.step()
        middle = time.perf_counter()
        core.step()
        pairs.append((middle - start, time.perf_counter() - middle))
    for engine, requests in ((core, batched), (partner, single)):
        for r in requests:
            engine.abort(r.request_id)
    return {"batch": batch, "pairs": steps, "ratio": statistics.median(b / one for one, b in pairs),
            "batch1_ms": statistics.median(one for one, _ in pairs) * 1e3,
            "batch_ms": statistics.median(b for _, b in pairs) * 1e3}


def run(model: str = "default", batches=(1, 4, 8, 16), context: int = 1000, steps: int = 24,
        dtype: str = "auto", log=print, shared_prefix: int = 0, transformers: bool = False,
        llama_bench_binary: str | None = None, llama_gguf: str | Path | None = None, **engine_overrides) -> dict:
    # a pool that holds every sequence of the largest batch: a smaller one would preempt some and time a smaller batch
    blocks_per_seq = blocks_per_sequence(context, steps + 8, engine_overrides)
    engine_overrides.setdefault("num_kv_blocks", max(batches) * blocks_per_seq + 8)
    core = EngineCore(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(batches),
                                   max_num_batched_tokens=2048, **engine_overrides))
    probe = bandwidth_probe(core.device)
    start_decoding(core, 1, 64, 4)  # warm-up: first forwards pay for allocations
    for r in list(core.requests.values()):
        core.abort(r.request_id)
    if llama_bench_binary and not llama_gguf:
        if not is_gguf_dir(core.model_path):
            raise ValueError(f"llama-bench needs a GGUF file: {model} is not a GGUF model (name one: llama_gguf)")
        llama_gguf = core.model_path / WEIGHTS_NAME
    rows = []
    resolved = str(core.runner.dtype).removeprefix("torch.")  # what `auto` chose (the activations' dtype)
    weights = "" if core.weights_format == "none" else f", weights {core.weights_format}"
    for batch in batches:
        row = measure(core, probe, batch, context, steps, shared_prefix)
        row["dtype"] = resolved
        row["weights_format"] = core.weights_format
        row["kv_cache_dtype"] = str(core.runner.kv_slots.dtype).removeprefix("torch.")
        kv = f", K/V {row['kv_cache_dtype']}" if row["kv_cache_dtype"] != resolved else ""
        shared = f", {shared_prefix} shared" if shared_prefix else ""
        row["device"] = core.device.type
        if transformers:
            row["transformers_step_ms"] = transformers_step_ms(str(core.model_path), batch, context, steps, resolved,
                                                               core.device, shared_prefix)
        baseline = f"; transformers {row['transformers_step_ms']:.2f} ms/step" if transformers else ""
        if row["graph_replay_ms"] is not None:
            baseline += f"; graph replay alone {row['graph_replay_ms']:.2f} ms"
        if llama_bench_binary and batch == 1:
            elements = kv_bytes_per_token(core) // core.runner.kv_slots.element_size()
            theirs = row["llama_bench"] = llama_bench.measure(
                llama_bench_binary, Path(llama_gguf), lambda: bandwidth_gb_s(probe, repeats=1), context,
                steps, elements, torch.get_num_threads())
            baseline += (f"; llama-bench on the file {theirs['ms_per_token']:.2f} ms/token, each run vs its own probe: "
                         f"{theirs['roofline_ratio']:.0%} ({theirs['weight_mb']:.0f} MB of weights)")
        log(f"decode batch {batch:>2} ({core.device.type}, {resolved}{weights}{kv}{shared}): {row['step_ms']:.2f} ms/step, "
            f"{row['tok_s']:.1f} tok/s, roofline {row['roofline_ms']:.2f} ms at {row['bandwidth_gb_s']:.1f} GB/s; "
            f"each step vs its own probe: {row['roofline_ratio']:.0%}{baseline}")
        rows.append(row)
    b1 = next((r for r in rows if r["batch"] == 1), None)
    b8 = next((r for r in rows if r["batch"] == 8), None)
    in_turns = None
    if b1 and b8:
        # a batch-1 engine over the same weights, whose steps take turns with batch 8's
        partner = EngineCore(EngineConfig(model=model, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=2048,
                                          max_model_len=context + steps + 8,
                                          **{**engine_overrides, "num_kv_blocks": blocks_per_seq + 8}),
                             model=core.model)
        in_turns = measure_in_turns(core, partner, 8, context, steps, shared_prefix)
        log(f"decode batch 8 / batch 1, steps in turns: {in_turns['ratio']:.2f}x (median of {steps} pairs; "
            f"{in_turns['batch_ms']:.1f} vs {in_turns['batch1_ms']:.1f} ms)")
    return {"rows": rows, "batch8_over_batch1": b8["step_ms"] / b1["step_ms"] if b1 and b8 else None,
            "batch8_in_turns": in_turns, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto: a GGUF model's own formats (the default model: Q4_1), else float32")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "q8_0", "q4_0"),
                        help="q8_0 / q4_0: quantize an HF checkpoint at load")
    parser.add_argument("--quantized-activations", default="float32", choices=("float32", "int8"),
                        help="quantized weights' matmuls: int8 activations and integer dot products, or exact floats")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="K/V storage (auto: the model's dtype)")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="the first N tokens of every prompt are the same (cascade attention reads them once)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--transformers", action="store_true",
                        help="also time plain transformers decoding the same prompts, batch by batch")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: no graphs of decode steps (to measure what they buy)")
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear weights (to measure what packing buys)")
    parser.add_argument("--no-paged-kernel", action="store_true",
                        help="decode attention through gather + SDPA (to measure what the paged CPU kernel buys; "
                             "the compiled step, whose supports() asks the kernel's, goes too)")
    parser.add_argument("--no-compiled-decode", action="store_true",
                        help="decode steps through eager PyTorch (to measure what the compiled step buys)")
    parser.add_argument("--llama-bench", default=None, metavar="BINARY",
                        help="also time llama.cpp's llama-bench at batch 1 on the GGUF file against the same probe")
    parser.add_argument("--llama-gguf", default=None, metavar="FILE",
                        help="the GGUF file llama-bench reads (default: --model's, when that is a GGUF model)")
    parser.add_argument("--plot", default=None, help="plot the run's step times against the roofline here (PNG)")
    parser.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                        help="measure nothing: plot these saved --json runs together into --plot")
    args = parser.parse_args(argv)
    if args.replot:
        from bench import report
        report.decode_runs([json.loads(Path(p).read_text())["rows"] for p in args.replot], Path(args.plot))
        return 0
    if args.no_compiled_decode:
        from engine.model import decode_step_cpu
        decode_step_cpu.supports = lambda dtype, device: False
    if args.no_paged_kernel:
        from engine.model import paged_decode_cpu
        paged_decode_cpu.supports = lambda dtype, device: False
    if args.no_pack:
        import functools

        import engine.core
        engine.core.load_model = functools.partial(loader.load_model, pack=False)
    result = run(args.model, tuple(int(b) for b in args.batches.split(",")), args.context, args.steps, args.dtype,
                 shared_prefix=args.shared_prefix, transformers=args.transformers, llama_bench_binary=args.llama_bench,
                 llama_gguf=args.llama_gguf, kv_cache_dtype=args.kv_cache_dtype,
                 device=args.device, enforce_eager=args.enforce_eager, quantization=args.quantization,
                 quantized_activations=args.quantized_activations)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        from bench import report
        report.decode_runs([result["rows"]], Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
