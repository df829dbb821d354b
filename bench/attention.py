"""Decode attention alone, over the paged cache: `python -m bench.attention`.

Times paged_decode_cpu.attend (the kernel the decode step runs for every layer) for a batch of decodes
over random K/V of the model's shapes, every layer's cache a separate tensor as in the engine, so the
K/V come from memory as in a real step. `--shared-prefix N`: the rows share their first N slots as one
cascade group. `--in-cache`: every row's context is 64 slots read over and over (the K/V stay in the
CPU caches), which times the arithmetic alone. `--between-matmuls`: before each layer's attention, that
layer's four weight matmuls (random packed weights of the model's shapes, not timed) stream ~14 MB through
the caches as in a decode step, leaving attention's code and data cold as it finds them there. Times are
medians over repeats of all layers (of the attention calls alone).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.matmul import step_shapes
from engine.model import packed_matmul_cpu
from engine.model.attention import SharedPrefix
from engine.model.bfloat16_bits import numpy_view
from engine.model.cpu_threads import use_threads
from engine.model.llama import head_dim
from engine.model.loader import resolve_model_path
from engine.model.model_config import load_config
from engine.model.paged_decode_cpu import attend, cascade_groups


def run(model: str = "default", batch: int = 8, context: int = 1000, shared_prefix: int = 0,
        kv_cache_dtype: str = "float32", in_cache: bool = False, repeats: int = 20, between_matmuls: bool = False,
        log=print) -> dict:
    config = load_config(resolve_model_path(model))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = head_dim(config)
    own = context - shared_prefix
    num_slots = shared_prefix + batch * own
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, kv_cache_dtype)
    caches = [(torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)) for _ in range(config.num_hidden_layers)]
    views = [(numpy_view(k), numpy_view(v)) for k, v in caches]
    q = torch.randn(batch, heads * dim, generator=gen).numpy()
    rows = [shared_prefix + b * own + np.arange(own) for b in range(batch)]
    if in_cache:
        rows = [shared_prefix + b * own + np.arange(own) % 64 for b in range(batch)]
    slots, lengths = np.stack(rows).astype(np.int64), np.full(batch, own, np.int64)
    groups = [SharedPrefix(torch.arange(batch), torch.arange(shared_prefix))] if shared_prefix else []
    group, shared_slots, shared_lengths = cascade_groups(groups, batch)
    out = np.empty((batch, heads * dim), np.float32)
    threads = use_threads()
    scale = np.float32(dim ** -0.5)

    weight_matmuls = _layer_matmuls(config, batch, gen, threads) if between_matmuls else None

    def step() -> float:
        seconds = 0.0
        for layer, (k, v) in enumerate(views):
            if weight_matmuls:
                weight_matmuls(layer)
            start = time.perf_counter()
            attend(q, k, v, slots, lengths, group, shared_slots, shared_lengths, heads, scale, threads, out)
            seconds += time.perf_counter() - start
        return seconds

    step()  # compiles, or loads from numba's cache
    times = [step() for _ in range(repeats)]
    kv_bytes = sum(k.element_size() for k, _ in caches) * 2 * kv_heads * dim * (shared_prefix + batch * own)
    result = {"batch": batch, "context": context, "shared_prefix": shared_prefix, "kv_cache_dtype": kv_cache_dtype,
              "in_cache": in_cache, "between_matmuls": between_matmuls, "layers": len(caches),
              "ms": statistics.median(times) * 1e3,
              "kv_mb": kv_bytes / 1e6}
    shared = f", {shared_prefix} shared" if shared_prefix else ""
    read = " (K/V in cache)" if in_cache else f" for {result['kv_mb']:.0f} MB of K/V"
    read += ", the layers' weight matmuls between the calls" if between_matmuls else ""
    log(f"attention, {len(caches)} layers, batch {batch}, {context}-token contexts{shared}, K/V {kv_cache_dtype}: "
        f"{result['ms']:.2f} ms{read}")
    return result


def _layer_matmuls(config, batch: int, gen: torch.Generator, threads: int):
    """layer -> runs that layer's four weight matmuls (qkv, o, gate/up, down) at `batch` rows over random packed
    weights of the model's shapes."""
    shapes = step_shapes(config)[:-1]  # without the lm_head: 4 a layer
    weights = [packed_matmul_cpu.pack(torch.randn(shape, generator=gen) * 0.02).numpy() for shape in shapes]
    inputs = {k: torch.randn(batch, k, generator=gen).numpy() for _, k in shapes}
    outputs = [np.empty((batch, n), np.float32) for n, _ in shapes]
    no_bias = np.zeros(0, np.float32)

    def run_layer(layer: int) -> None:
        for i in range(4 * layer, 4 * layer + 4):
            packed_matmul_cpu.matmul(inputs[shapes[i][1]], weights[i], no_bias, outputs[i], False, threads)

    return run_layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__)
    parser.add_argument("--model", default="default", help="whose shapes (its config only; K/V are random)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--in-cache", action="store_true", help="64 slots per row, read over and over")
    parser.add_argument("--between-matmuls", action="store_true",
                        help="each layer's weight matmuls run (untimed) before its attention, as in a decode step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args.model, args.batch, args.context, args.shared_prefix, args.kv_cache_dtype, args.in_cache,
                 args.repeats, args.between_matmuls)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
