"""kv_cache_dtype: K/V stored in bfloat16 beside a float32 model. The pool holds twice the blocks in the same
memory, both decode paths (compiled and eager) read the same bf16 K/V, the answers stay those of float32 K/V
on the tiny model, and the disk tier keeps bf16 blocks apart from float32 ones."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.disk_tier import model_fingerprint
from tests.engine.model.test_decode_step_cpu import PROMPTS, _record_both_paths

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_pool_stores_bf16_and_holds_twice_the_blocks(tiny_llama_dir):
    fp32 = LLM(str(tiny_llama_dir), kv_cache_memory_mb=1)
    bf16 = LLM(str(tiny_llama_dir), kv_cache_memory_mb=1, kv_cache_dtype="bfloat16")
    assert fp32.core.runner.kv_slots.dtype == torch.float32
    assert bf16.core.runner.kv_slots.dtype == torch.bfloat16
    assert bf16.core.num_blocks == 2 * fp32.core.num_blocks
    assert next(bf16.core.model.parameters()).dtype == torch.float32  # only the K/V change


def test_greedy_answers_match_float32_kv_on_the_tiny_model(tiny_llama_dir):
    fp32 = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    bf16 = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, kv_cache_dtype="bfloat16")
    expected = [o.token_ids for o in fp32.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in bf16.generate(PROMPTS, GREEDY)] == expected
    # again from the prefix cache: the cached bf16 blocks give the same answers
    assert [o.token_ids for o in bf16.generate(PROMPTS, GREEDY)] == expected


def test_compiled_and_eager_steps_read_and_write_the_same_bf16_kv(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, kv_cache_dtype="bfloat16")
    assert llm.core.runner.compiled_decode is not None
    calls = _record_both_paths(llm, tiny_llama_dir)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls
    for compiled, eager, kv_compiled, kv_eager in calls:
        # the new K/V: float32 math in both, rounded to bf16 (nearest even) in both; a last-bit difference in
        # float32 can round to the neighbouring bf16 value
        torch.testing.assert_close(kv_compiled.float(), kv_eager.float(), rtol=1e-2, atol=1e-2)
        # and such a neighbour moves the logits: on an AVX-512/AMX Xeon 11-25 of a step's new K/V values
        # landed one bf16 step apart and the logits up to 5e-3 (the greedy test above checks the answers)
        torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


def test_the_disk_tier_keeps_bf16_blocks_apart(tiny_llama_dir):
    shape = (2, 2, 16, 2, 16)
    fp32 = model_fingerprint(tiny_llama_dir, torch.float32, 16, shape, "sha256")
    assert model_fingerprint(tiny_llama_dir, torch.float32, 16, shape, "sha256", torch.float32) == fp32
    assert model_fingerprint(tiny_llama_dir, torch.float32, 16, shape, "sha256", torch.bfloat16) != fp32


def test_a_warm_restart_serves_bf16_blocks_from_disk(tiny_llama_dir, tmp_path):
    prompt = list(range(3, 3 + 4 * 16 + 1))
    first = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    expected = first.generate(prompt, GREEDY)[0].token_ids
    first.close()  # graceful shutdown: the cached blocks go to disk
    again = LLM(str(tiny_llama_dir), num_kv_blocks=12, kv_disk_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    out = again.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 64 and again.stats().disk_hits == 64
    assert out.token_ids == expected
    again.close()


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
