"""Micro-benchmarks: block hash + lookup per block, and prefill efficiency against this machine's matmul."""
from __future__ import annotations

import random
import time

import torch

from engine.config import EngineConfig, HashAlgo
from engine.core import EngineCore
from engine.kv.hashing import hash_full_blocks
from engine.kv.kv_cache_manager import KVCacheManager
from engine.model.llama import head_dim
from engine.model.model_config import load_config
from engine.request import Request
from engine.sampling_params import SampledToken, SamplingParams
from engine.scheduler import Scheduler


def hash_lookup_us_per_block(algo: HashAlgo, num_tokens: int = 4096, block_size: int = 16,
                             repeats: int = 20) -> dict:
    """Time the engine's own lookup path (hash every block of a new request, find it in the pool,
    compare its tokens) for a prompt whose blocks are all cached."""
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(num_tokens)]
    num_blocks = num_tokens // block_size
    kv = KVCacheManager(num_blocks + 1, block_size, hash_algo=algo)
    for block, block_hash in zip(kv.pool.blocks, hash_full_blocks(tokens, block_size, algo=algo)):
        i = block.block_id
        kv.pool.cache_block(block, block_hash, tuple(tokens[i * block_size:(i + 1) * block_size]))
    params = SamplingParams(max_tokens=1)
    best_lookup = best_hash = float("inf")
    for i in range(repeats):
        request = Request(f"r{i}", tokens, params)  # a new id: the manager remembers a waiting request's hit
        start = time.perf_counter()
        prefix = kv.find_cached_prefix(request)
        best_lookup = min(best_lookup, time.perf_counter() - start)
        start = time.perf_counter()
        hash_full_blocks(tokens, block_size, algo=algo)
        best_hash = min(best_hash, time.perf_counter() - start)
    assert prefix.num_tokens == (num_tokens - 1) // block_size * block_size
    return {"algo": algo.value, "blocks": num_blocks, "hash_us": best_hash / num_blocks * 1e6,
            "hash_lookup_us": best_lookup / num_blocks * 1e6}


def lpm_step_ms(num_waiting: int, prefix_tokens: int = 4096, block_size: int = 16, steps: int = 20) -> dict:
    """Scheduling cost per step (no model) with `num_waiting` requests queued behind a full batch, all
    sharing a cached `prefix_tokens`-token prefix: lpm orders the whole queue every step."""
    rng = random.Random(0)
    prefix = [rng.randrange(50_000) for _ in range(prefix_tokens)]
    kv = KVCacheManager(prefix_tokens // block_size + steps + 8, block_size)
    params = SamplingParams(max_tokens=steps + 1)
    seed = Request("seed", prefix, params)
    assert kv.allocate(seed, prefix_tokens)
    seed.num_computed_tokens = prefix_tokens
    kv.cache_full_blocks(seed)
    kv.free(seed)
    config = EngineConfig(block_size=block_size, max_num_seqs=1, max_num_batched_tokens=16,
                          scheduling_policy="lpm", lpm_max_queue=num_waiting + 1)
    scheduler = Scheduler(config, kv, clock=lambda: 0.0)  # a still clock: nobody becomes overdue
    for i in range(num_waiting + 1):  # the first step admits one of them: it holds the only sequence slot
        scheduler.add(Request(f"w{i}", prefix + [rng.randrange(50_000) for _ in range(16)], params,
                              arrival_time=0.0))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        times.append(time.perf_counter() - start)
        for chunk in out.chunks:  # the running request computes its chunk and samples a token
            chunk.request.num_computed_tokens += chunk.num_tokens
            chunk.request.append_token(SampledToken(1), 0.0)
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == num_waiting
    steady = sorted(times[1:])
    return {"waiting": num_waiting, "prefix_tokens": prefix_tokens, "first_step_ms": times[0] * 1e3,
            "step_ms": steady[len(steady) // 2] * 1e3}  # median of the later steps


def matmul_gflops(m: int = 2048, k: int = 576, n: int = 1536, seconds: float = 1.0) -> float:
    """fp32 GEMM throughput at the model's own shapes (best of several runs)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def flops_per_prompt_token(hf_config, num_tokens: int) -> float:
    """Matmul FLOPs per prefill token: the layers' weights, plus causal attention over on average
    num_tokens/2 keys; the LM head runs for one position per prompt and is left out."""
    h = hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    dim = head_dim(hf_config)
    inter = hf_config.intermediate_size
    weights = h * heads * dim + 2 * h * kv_heads * dim + heads * dim * h + 3 * h * inter
    attention = 2 * heads * dim * (num_tokens / 2)  # QK^T and AV, per token
    return hf_config.num_hidden_layers * 2 * (weights + attention)


def prefill_efficiency(core_factory, lengths=(512, 2048), gflops: float | None = None) -> list[dict]:
    """Prefill tokens/s of one prompt (cache off, default chunking) x FLOPs/token / matmul GFLOP/s."""
    gflops = gflops or matmul_gflops()
    rows = []
    for n in lengths:
        core: EngineCore = core_factory()
        rng = random.Random(n)
        prompt = [rng.randrange(100, core.vocab_size) for _ in range(n)]
        request = Request(f"prefill-{n}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        core.add_request(request)
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        seconds = time.perf_counter() - start
        hf_config = load_config(core.model_path)
        tok_s = n / seconds
        achieved = tok_s * flops_per_prompt_token(hf_config, n) / 1e9
        rows.append({"tokens": n, "seconds": seconds, "tokens_per_s": tok_s, "achieved_gflops": achieved,
                     "matmul_gflops": gflops, "efficiency": achieved / gflops})
        del core
    return rows


if __name__ == "__main__":  # python -m bench.micro: the scheduling rows alone (no model needed)
    for n in (256, 1024):
        row = lpm_step_ms(n)
        print(f"lpm, {n} waiting on a {row['prefix_tokens']}-token prefix: {row['step_ms']:.2f} ms/step "
              f"(first step, hashing every prompt: {row['first_step_ms']:.0f} ms)")
