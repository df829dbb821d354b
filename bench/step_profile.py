"""Where a step's time goes, kernel by kernel: `python -m bench.step_profile [--device cuda] [--prefill N]`.

On CUDA it runs the recorded decode step's forward eagerly (the profiler sees a graph replay as one
launch; the forward launches the same kernels) under torch's profiler and prints how often each GPU
kernel ran a step and its time: their sum is what a replay comes down to, less the gaps between
launches. --enforce-eager profiles the eager step instead (attention by gather, no graph). On CPU it
profiles whole steps and prints each op's own time. --prefill N profiles instead steps that prefill a prompt of
N tokens in one chunk, a fresh prompt each (no cache hit), and prints their wall time beside the kernels' sum:
the difference is the host's (launches, bookkeeping) where the GPU waits on it.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.decode import blocks_per_sequence, start_decoding
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams


def run(model: str = "default", device: str = "cpu", dtype: str = "float32", batch: int = 1, context: int = 1000,
        steps: int = 8, enforce_eager: bool = False, **engine_overrides) -> dict:
    engine_overrides.setdefault("num_kv_blocks", batch * blocks_per_sequence(context, steps + 16, engine_overrides) + 8)
    core = EngineCore(EngineConfig(model=model, device=device, dtype=dtype, enforce_eager=enforce_eager,
                                   max_num_seqs=batch, max_num_batched_tokens=2048, **engine_overrides))
    start_decoding(core, batch, context, steps + 8)
    core.step()  # warm-up; it leaves its inputs in the graph's buffers
    graphs = core.runner.graph_decode
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if graphs is not None:  # (rewrites the last step's K/V with the same values)
                graphs.forward(graphs.graph_rows(batch))
                torch.cuda.synchronize()
            else:
                core.step()
    return {"device": core.device.type, "dtype": dtype, "batch": batch, "context": context,
            **_table(prof, core.device.type == "cuda", steps)}


def run_prefill(model: str = "default", device: str = "cpu", dtype: str = "float32", tokens: int = 4096,
                steps: int = 3, **engine_overrides) -> dict:
    """Steps that each prefill a fresh `tokens`-token prompt in one chunk (max_tokens=1), after one warm-up."""
    engine_overrides.setdefault("num_kv_blocks", blocks_per_sequence(tokens, 16, engine_overrides) + 8)
    core = EngineCore(EngineConfig(model=model, device=device, dtype=dtype, enforce_eager=True, max_num_seqs=1,
                                   max_num_batched_tokens=tokens, **engine_overrides))
    gen = torch.Generator().manual_seed(0)

    def one_step(i: int) -> float:
        prompt = torch.randint(0, core.vocab_size, (tokens,), generator=gen).tolist()
        core.add_request(Request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        start = time.perf_counter()
        outputs, _ = core.step()
        if core.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        assert [o.finish_reason for o in outputs] == ["length"], "the prefill step failed"
        return elapsed

    one_step(-1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        walls = [one_step(i) for i in range(steps)]
    return {"device": core.device.type, "dtype": dtype, "tokens": tokens,
            "prefill_kernel": core.runner.prefill_kernel, "step_wall_us": statistics.median(walls) * 1e6,
            **_table(prof, core.device.type == "cuda", steps)}


def _table(prof, on_gpu: bool, steps: int) -> dict:
    """Each GPU kernel's (or, on CPU, each op's own) count and time a step, the costliest first."""
    count: collections.Counter = collections.Counter()
    time_us: collections.Counter = collections.Counter()
    for event in prof.events():
        if on_gpu and event.device_type == DeviceType.CUDA:
            count[event.name] += 1
            time_us[event.name] += event.time_range.elapsed_us()
        elif not on_gpu and event.device_type == DeviceType.CPU:
            count[event.name] += 1
            time_us[event.name] += event.self_cpu_time_total
    rows = [{"name": name, "per_step": count[name] / steps, "us_per_step": time_us[name] / steps}
            for name, _ in time_us.most_common()]
    return {"rows": rows, "kernels_per_step": sum(count.values()) / steps if on_gpu else None,
            "total_us_per_step": sum(time_us.values()) / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: profile the eager step (no graph)")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="profile steps that prefill an N-token prompt instead of decode steps")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    what = "kernels" if args.device == "cuda" else "ops (self time)"
    if args.prefill:
        result = run_prefill(args.model, args.device, args.dtype, args.prefill)
        print(f"prefill step of {args.prefill} tokens, {args.device} {args.dtype} (prefill kernel "
              f"{'on' if result['prefill_kernel'] else 'off'}): {what} {result['total_us_per_step']:.0f} us a step, "
              f"wall {result['step_wall_us']:.0f} us")
    else:
        result = run(args.model, args.device, args.dtype, args.batch, args.context, enforce_eager=args.enforce_eager)
        print(f"decode step, batch {args.batch}, {args.context}-token contexts, {args.device} {args.dtype}: {what} "
              f"{result['total_us_per_step']:.0f} us a step")
    if result["kernels_per_step"]:
        print(f"{result['kernels_per_step']:.0f} kernels a step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for row in result["rows"][:args.top]:
        print(f"{row['us_per_step']:9.1f} us {row['per_step']:6.1f}x  {row['name'][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
