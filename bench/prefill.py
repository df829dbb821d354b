"""Prefill throughput and cached TTFT of one long prompt: `python -m bench.prefill --device cuda`.

Each prompt (random token ids, a different one per repeat) is sent alone with max_tokens=1 to a fresh engine
whose token budget holds it in one step, so its TTFT is one prefill step: throughput is that step's FLOPs (two
per weight of the linear layers per token, the logits of the last token only, and causal attention's
2 * 2 * layers * heads * head_dim * tokens^2 / 2) over its time. Then the same prompt again: every full block is
a cache hit, so its TTFT is the step of the last block's tokens, replayed from a CUDA graph as serving does
(prefill_graph_cuda.py; the 4,096-token step is past the graphs' buckets and runs eagerly). With --eager-too the
cached prompts run once more with those graphs switched off, and with --gather-too the uncached ones with the
prefill kernel switched off (the gather path), in the same process; with --profile-host cProfile says where
the prompts' TTFT goes on the host. On CUDA the cached prompts' steps are timed on the GPU too (CUDA events
around their graphs' replays: the TTFT less the host's share). Times are medians; the first prompt of a kind is
a warm-up (kernel compilation) and not counted.

--kernel-sweep (CUDA) times the paged prefill kernel alone on the model's attention shapes (one row of `--tokens`
queries from position 0, K/V scattered over the block pool in bf16) for several tile shapes, warps and pipeline
stages, beside PyTorch's scaled_dot_product_attention (FlashAttention) on the same K/V laid out contiguously, and
checks each output against it. With --queries 16 the row is a cached prompt's last block (16 queries over the
whole context), timed with its keys split over programs several ways and not at all.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from engine import LLM, SamplingParams

# dense bf16 tensor-core peaks from NVIDIA's datasheets, by the device name torch reports
PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4,
                    "A100": 312.0}


def step_flops(llm: LLM, tokens: int) -> int:
    """FLOPs of a prefill step of `tokens` tokens from position 0 (multiply-adds count two)."""
    config = llm.core.model.config
    model = llm.core.model
    linear = sum(m.in_features * m.out_features for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = model.model.layers[0].self_attn.head_dim
    attention = 2 * 2 * layers * heads * head_dim * tokens * tokens // 2  # QK^T and PV over the causal half
    return 2 * linear * tokens + 2 * model.lm_head.in_features * model.lm_head.out_features + attention


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of one prompt sent alone."""
    started = time.perf_counter()
    [out] = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    if out.finish_reason == "error":  # a failed step is no TTFT
        raise RuntimeError("the prefill step failed (the engine's log says why)")
    return time.perf_counter() - started, out.num_cached_tokens


def _uncached_and_cached(llm: LLM, prompts: list[list[int]]) -> tuple[list[float], list[float], list[int]]:
    """Each prompt sent twice: (uncached TTFTs, cached TTFTs, cached tokens), the first prompt a warm-up of both
    shapes of step and not counted."""
    uncached, cached, hits = [], [], []
    for i, prompt in enumerate(prompts):
        first, _ = ttft(llm, prompt)
        again, hit = ttft(llm, prompt)
        if i > 0:
            uncached.append(first)
            cached.append(again)
            hits.append(hit)
    return uncached, cached, hits


def host_profile(llm: LLM, prompts: list[list[int]], top: int = 25) -> dict[str, list[dict]]:
    """Where a prompt's TTFT goes on the host, uncached and cached: cProfile over each prompt's two sends, the
    `top` functions by their own time in ms a prompt (a wait for the GPU shows as the call that synchronizes)."""
    import cProfile
    import pstats

    profiles = {"uncached": cProfile.Profile(), "cached": cProfile.Profile()}
    for prompt in prompts:
        for profile in profiles.values():
            profile.enable()
            ttft(llm, prompt)
            profile.disable()

    def rows(profile: cProfile.Profile) -> list[dict]:
        stats = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:top]
        return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls": calls / len(prompts),
                 "own_ms": round(own * 1e3 / len(prompts), 3),
                 "cumulative_ms": round(cumulative * 1e3 / len(prompts), 3)}
                for (path, line, name), (_, calls, own, cumulative, _) in stats]
    return {kind: rows(profile) for kind, profile in profiles.items()}


class _TimedReplays:
    """Stands in for a captured graph: each replay between two CUDA events. A cached prompt's step finds the GPU
    idle (the copies of its inputs go first, on the same stream), so the events bracket the step's GPU time alone:
    its TTFT less the host's share."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))

    def times_ms(self) -> list[float]:
        return [start.elapsed_time(end) for start, end in self.events]


def run(model: str = "default", device: str = "cuda", dtype: str = "bfloat16", tokens: int = 4096,
        repeats: int = 3, gather_too: bool = False, eager_too: bool = False, profile_host: bool = False,
        gemm_too: bool = False, **overrides) -> dict:
    llm = LLM(model, device=device, dtype=dtype, max_num_batched_tokens=tokens, max_num_seqs=1, **overrides)
    gen = torch.Generator().manual_seed(0)

    def fresh() -> list[list[int]]:
        return [torch.randint(0, llm.core.vocab_size, (tokens,), generator=gen).tolist() for _ in range(repeats + 1)]

    graphs = llm.core.runner.graph_prefill
    if graphs is not None:  # the cached steps' replays timed on the GPU (the uncached step runs eagerly)
        graphs.graphs = {bucket: _TimedReplays(graph) for bucket, graph in graphs.graphs.items()}
    uncached, cached, hits = _uncached_and_cached(llm, fresh())
    flops = step_flops(llm, tokens)
    result = {"model": model, "device": device, "dtype": dtype, "tokens": tokens,
              "device_name": torch.cuda.get_device_name() if llm.core.device.type == "cuda" else "cpu",
              "prefill_kernel": llm.core.runner.prefill_kernel,
              "prefill_graphs": llm.core.runner.graph_prefill is not None, "step_tflop": round(flops / 1e12, 3),
              "uncached_ttft_s": round(statistics.median(uncached), 4),
              "cached_ttft_s": round(statistics.median(cached), 4), "cached_tokens": hits}
    result["prefill_tflops"] = round(flops / statistics.median(uncached) / 1e12, 1)
    result["cached_over_uncached"] = round(statistics.median(cached) / statistics.median(uncached), 4)
    if (peak := peak_tflops(llm.core.device)) is not None:
        result["peak_bf16_tflops"] = peak
        result["fraction_of_peak"] = round(result["prefill_tflops"] / peak, 3)
    if graphs is not None:
        bucket = next((b for b in graphs.buckets if b >= tokens - hits[0]), None)
        if bucket is not None and bucket < tokens:  # (else the uncached steps replay the same graph)
            replays = graphs.graphs[bucket].times_ms()[1:]  # (not the warm-up prompt's)
            result["cached_step_gpu_ms"] = round(statistics.median(replays), 4)
    if profile_host:
        result["host_profile"] = host_profile(llm, fresh())
    if eager_too and llm.core.runner.graph_prefill is not None:
        llm.core.runner.graph_prefill = None
        eager_cached = _uncached_and_cached(llm, fresh())[1]
        result["eager_cached_ttft_s"] = round(statistics.median(eager_cached), 4)
    if gemm_too and llm.core.device.type == "cpu":
        result |= _each_gemm(llm, list(zip(fresh(), fresh())))
    if gather_too and llm.core.runner.prefill_kernel:
        llm.core.runner.prefill_kernel, llm.core.runner.graph_prefill = False, None
        gather = [ttft(llm, prompt)[0] for prompt in fresh()][1:]
        result["gather_uncached_ttft_s"] = round(statistics.median(gather), 4)
    return result


def _each_gemm(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Uncached TTFTs on each float GEMM of quantized weights' prefill (cpu_gemm: OpenBLAS, oneMKL), taking turns
    prompt by prompt (a pair's prompts differ: no cache hits); the first pair a warm-up."""
    from engine.model import cpu_gemm
    default, times = cpu_gemm.OPENBLAS, {True: [], False: []}
    try:
        for i, pair in enumerate(pairs):
            for openblas, prompt in zip((default, not default), pair):
                cpu_gemm.OPENBLAS = openblas
                seconds = ttft(llm, prompt)[0]
                if i > 0:
                    times[openblas].append(seconds)
    finally:
        cpu_gemm.OPENBLAS = default
    return {"gemm": "openblas" if default else "mkl",
            "openblas_uncached_ttft_s": round(statistics.median(times[True]), 4),
            "mkl_uncached_ttft_s": round(statistics.median(times[False]), 4)}


SWEEP = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 1), (64, 64, 8, 2), (64, 32, 4, 2), (64, 128, 4, 2),
         (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3))


def kernel_sweep(model: str = "default", tokens: int = 4096, block_size: int = 16, configs=SWEEP,
                 device: str = "cuda", timer=None, queries: int | None = None,
                 splits: tuple[int | None, ...] = (None,)) -> dict:
    """The kernel's time and attention TFLOP/s per (query rows, keys, warps, stages) and keys per split (None:
    the kernel's own choice, 0: none), SDPA's on the same K/V. One row of `queries` queries (default: all
    `tokens`) at the end of a `tokens`-token context: a cached prompt's last block is 16 queries over its whole
    context. timer(fn) -> ms: triton.testing.do_bench's median by default (the tests pass another for CPU
    tensors)."""
    import torch.nn.functional as F
    from transformers import AutoConfig

    from engine.model import paged_prefill_cuda
    from engine.model.loader import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    queries = tokens if queries is None else queries
    if timer is None:
        import triton.testing
        timer = functools.partial(triton.testing.do_bench, return_mode="median")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (the interpreter's 16-bit dots are wrong)
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = tokens // block_size
    q = torch.randn(queries, heads, dim, device=device, generator=gen, dtype=dtype)
    k = torch.randn(tokens, kv_heads, dim, device=device, generator=gen, dtype=dtype)
    v = torch.randn(tokens, kv_heads, dim, device=device, generator=gen, dtype=dtype)
    table = torch.randperm(num_blocks, device=device, generator=gen).int()
    slots = (table.long()[:, None] * block_size + torch.arange(block_size, device=device)).flatten()
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    k_cache[slots], v_cache[slots] = k, v  # token t sits in slot slots[t]
    starts = torch.tensor([0, queries], dtype=torch.int32, device=device)
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    scale = dim ** -0.5
    # the keys each query sees: all before it in the context (causal over the whole prompt when queries = tokens)
    flops = 2 * 2 * heads * dim * sum(range(tokens - queries + 1, tokens + 1))
    seen = (torch.arange(tokens, device=device)[None, :]
            <= torch.arange(tokens - queries, tokens, device=device)[:, None])

    def sdpa():
        causal = {"is_causal": True} if queries == tokens else {"attn_mask": seen}
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], scale=scale, enable_gqa=True,
                                              **causal)[0].transpose(0, 1)

    expected = sdpa().float()
    rows = [{"kernel": "sdpa", "ms": timer(sdpa)}]
    for tiles in configs:
        for keys_per_split in splits:
            def kernel(tiles=tiles, keys_per_split=keys_per_split):
                return paged_prefill_cuda.paged_prefill(q, k_cache, v_cache, table[None], starts, lens, scale,
                                                        block_size, tiles=tiles, keys_per_split=keys_per_split)
            error = ((kernel().float() - expected).norm() / expected.norm()).item()
            rows.append({"kernel": "paged_prefill", "tiles": tiles, "keys_per_split": keys_per_split,
                         "rel_error": round(error, 5), "ms": timer(kernel)})
    for row in rows:
        row["tflops"] = round(flops / row["ms"] / 1e9, 1)
    return {"model": model, "tokens": tokens, "queries": queries, "heads": heads, "kv_heads": kv_heads,
            "head_dim": dim, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "attention_tflop": round(flops / 1e12, 4), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "auto"),
                        help="auto: the engine's default (on CPU a GGUF file's weights run in their own formats)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gather-too", action="store_true", help="also time the uncached prompts on the gather path")
    parser.add_argument("--eager-too", action="store_true",
                        help="CUDA: also time the cached prompts with the prefill steps' CUDA graphs off")
    parser.add_argument("--profile-host", action="store_true",
                        help="also profile the prompts' TTFT on the host, uncached and cached (cProfile's top "
                             "functions)")
    parser.add_argument("--kernel-sweep", action="store_true",
                        help="CUDA: time the prefill kernel alone per tile shape, beside SDPA (one layer's attention)")
    parser.add_argument("--queries", type=int, default=None,
                        help="--kernel-sweep: the row's queries at the end of its context (default: all --tokens); "
                             "fewer time the kernel's split keys, as a cached prompt's last block (16)")
    parser.add_argument("--quantized-activations", default="float32", choices=("float32", "int8"),
                        help="CPU, quantized weights: int8 runs their matmuls on integer dot products")
    parser.add_argument("--gemm-too", action="store_true",
                        help="CPU, quantized weights: also time uncached prompts on OpenBLAS's and oneMKL's GEMM in turns")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.kernel_sweep:
        queries = args.queries or args.tokens
        # a few queries over a long context: the tiles the kernel picks, its keys split several ways
        configs, splits = ((None,), (None, 0, 256, 512, 1024)) if queries < args.tokens else (SWEEP, (None,))
        result = kernel_sweep(args.model, args.tokens, configs=configs, queries=queries, splits=splits)
        for row in result["rows"]:
            split = row.get("keys_per_split", "")
            print(f"{row['kernel']:14}{str(row.get('tiles', '')):20}{'split ' + str(split) if split != '' else '':12}"
                  f"{row['ms']:8.3f} ms{row['tflops']:8.1f} TFLOP/s  rel error {row.get('rel_error', '-')}")
    else:
        result = run(args.model, args.device, args.dtype, args.tokens, args.repeats, args.gather_too, args.eager_too,
                     args.profile_host, args.gemm_too, quantized_activations=args.quantized_activations)
        for kind, rows in result.get("host_profile", {}).items():
            print(f"host profile, {kind} prompts: ms a prompt")
            for row in rows:
                print(f"{row['own_ms']:8.3f} own {row['cumulative_ms']:8.3f} cumulative {row['calls']:8.1f} calls"
                      f"  {row['function']}")
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
