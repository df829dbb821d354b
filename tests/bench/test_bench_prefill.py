"""bench.prefill on the tiny model on CPU (behaviour, not times): the step's FLOPs, the cache hits of the repeat."""
from __future__ import annotations

import json
import re

import pytest

from bench import prefill
from engine import LLM
from engine.model.quant_matmul_cpu import KERNEL_ROWS
from tests.support.machine import triton_module


def test_step_flops_count_the_linear_layers_the_last_logits_and_causal_attention(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), cpu_kernels="eager", num_kv_blocks=8)
    # the tiny model: 2 layers of hidden 64, 4 heads (2 kv) of 16, MLP 128
    linear = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64)
    attention = 2 * 2 * 2 * 4 * 16 * 100 * 100 // 2
    assert prefill.step_flops(llm, 100) == 2 * linear * 100 + 2 * 64 * llm.core.vocab_size + attention


def test_the_repeated_prompt_hits_every_full_block_but_the_last_tokens(tiny_llama_dir):
    result = prefill.run(str(tiny_llama_dir), device="cpu", dtype="float32", tokens=64, repeats=2,
                         cpu_kernels="eager", block_size=16, num_kv_blocks=32)
    assert result["cached_tokens"] == [48, 48]  # a hit is capped at 63 of the 64 tokens: 3 blocks
    assert result["prefill_kernel"] is False and "fraction_of_peak" not in result  # CPU: gather path, no peak
    assert result["prefill_graphs"] is False
    assert result["uncached_ttft_s"] > 0 and result["cached_ttft_s"] > 0


def test_the_host_profile_counts_one_step_a_send_uncached_and_cached(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), cpu_kernels="eager", block_size=16, num_kv_blocks=32)
    prompts = [list(range(1, 65)), list(range(2, 66))]
    profile = prefill.host_profile(llm, prompts, top=500)
    assert set(profile) == {"uncached", "cached"}
    for rows in profile.values():
        by_name = {re.sub(r":\d+", "", row["function"]): row for row in rows}  # (line numbers move)
        step, execute = by_name["core.py(step)"], by_name["runner.py(execute)"]
        assert step["calls"] == execute["calls"] == 1.0  # one step a send: the whole prompt, or its last block
        assert step["cumulative_ms"] >= execute["cumulative_ms"] > 0
        assert [row["own_ms"] for row in rows] == sorted((row["own_ms"] for row in rows), reverse=True)
    hashed = {re.sub(r":\d+", "", row["function"]): row["calls"] for row in profile["cached"]}
    assert "hashing.py(hash_full_blocks)" in hashed or "request.py(update_block_hashes)" in hashed


def test_a_failed_step_is_an_error_not_a_time(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), cpu_kernels="eager", num_kv_blocks=8)

    def fail(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(llm.core.runner, "execute", fail)
    with pytest.raises(RuntimeError, match="the prefill step failed"):
        prefill.ttft(llm, list(range(1, 40)))


def test_the_kernel_sweep_checks_every_tile_shape_against_sdpa(tiny_llama_dir):
    """On CPU tensors through Triton's interpreter (conftest), with a stand-in timer: every tiling is the same
    attention as SDPA's, and the FLOPs are causal attention's."""
    triton_module("paged_prefill_cuda")
    result = prefill.kernel_sweep(str(tiny_llama_dir), tokens=48, block_size=8, device="cpu",
                                  configs=((16, 16, 1, 1), (32, 8, 2, 2)), timer=lambda fn: 2.0)
    assert (result["heads"], result["kv_heads"], result["head_dim"]) == (4, 2, 16)
    assert result["attention_tflop"] == round(2 * 2 * 4 * 16 * 48 * 48 // 2 / 1e12, 4)
    assert [r["kernel"] for r in result["rows"]] == ["sdpa", "paged_prefill", "paged_prefill"]
    assert all(r["rel_error"] < 1e-5 for r in result["rows"][1:])
    assert all(r["ms"] == 2.0 for r in result["rows"])


def test_the_kernel_sweep_of_a_cached_block_splits_its_keys_every_way_it_is_asked(tiny_llama_dir):
    """16 queries at the end of a 96-token context (a cached prompt's last block): split or not, the same
    attention as SDPA's under the explicit mask; the FLOPs count each query's keys only."""
    triton_module("paged_prefill_cuda")
    result = prefill.kernel_sweep(str(tiny_llama_dir), tokens=96, block_size=8, device="cpu", queries=16,
                                  configs=((16, 16, 1, 1),), splits=(None, 0, 32), timer=lambda fn: 1e-9)
    assert [r.get("keys_per_split") for r in result["rows"]] == [None, None, 0, 32]
    assert all(r["rel_error"] < 1e-5 for r in result["rows"][1:])
    assert result["queries"] == 16
    # at 1e-9 ms a run, "TFLOP/s" is the FLOPs themselves: query i of 16 sees 81 + i keys
    assert {r["tflops"] for r in result["rows"]} == {2 * 2 * 4 * 16 * sum(range(81, 97))}


def test_gemm_too_times_each_prefill_gemm_in_turns_then_restores_the_default(tiny_llama_dir, monkeypatch):
    """Quantized weights' prefill on OpenBLAS and on oneMKL (cpu_gemm), each timed; the default kept after."""
    from engine.model import cpu_gemm
    default, used, real = cpu_gemm.OPENBLAS, [], cpu_gemm.matmul_nt

    def matmul_nt(x, w, out):
        used.append(cpu_gemm.OPENBLAS)
        real(x, w, out)

    monkeypatch.setattr(cpu_gemm, "matmul_nt", matmul_nt)
    tokens = KERNEL_ROWS[8] + 16  # (steps of up to KERNEL_ROWS[8] rows run the quantized kernel, no GEMM)
    result = prefill.run(str(tiny_llama_dir), device="cpu", dtype="float32", tokens=tokens, repeats=2, gemm_too=True,
                         quantization="q8_0", block_size=16, num_kv_blocks=64)
    assert result["gemm"] == ("openblas" if default else "mkl")
    assert result["openblas_uncached_ttft_s"] > 0 and result["mkl_uncached_ttft_s"] > 0
    assert set(used) == {True, False} and cpu_gemm.OPENBLAS is default


def test_a_question_behind_a_long_prompt_has_its_first_token_at_the_next_step(tiny_llama_dir, tmp_path, capsys):
    from bench import short_behind_long
    out = tmp_path / "result.json"
    assert short_behind_long.main(["--model", str(tiny_llama_dir), "--long-tokens", "1200", "--rounds", "1",
                                   "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["long_tokens"] == 1200
    (round_,) = result["rounds"]
    assert round_["question"]["steps"] == 1  # (it waited for the whole long prefill before: a step more)
    assert round_["long_alone"]["steps"] == round_["long_with_question"]["steps"] == 3  # 512 + 505 (+ 7) + 183
    assert "question" in capsys.readouterr().out
