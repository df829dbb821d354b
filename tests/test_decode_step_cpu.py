"""The compiled CPU decode step gives the eager model's logits and K/V, and the runner takes it only for
decode-only steps of up to MAX_ROWS rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import decode_step_cpu
from engine.model.bfloat16_bits import numpy_view
from engine.model.loader import load_config, load_model
from engine.runner import ModelRunner

# three prompts sharing their first two blocks (the eager path attends them by cascade) and one that
# shares nothing; ragged lengths, so the rows' contexts end mid-block at different offsets
PROMPTS = [list(range(3, 14)), list(range(3, 11)) + [40, 41, 42, 43, 44, 45], list(range(3, 12)), [90, 91, 92]]


def _record_both_paths(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Makes every runner step run twice from the same K/V: compiled (when it applies) and eager. Returns,
    per compiled step, (compiled logits, eager logits, K/V after the compiled step, K/V after the eager one);
    the engine goes on with the eager results."""
    runner = llm.core.runner
    execute, compiled = runner.execute, runner.compiled_decode
    calls = []

    def both(chunks):
        before = runner.kv_slots.clone()
        hits = []
        runner.compiled_decode = _Spy(compiled, hits)
        logits, sampled = execute(chunks)
        runner.compiled_decode = compiled
        if not hits:
            return logits, sampled
        after_compiled = runner.kv_slots.clone()
        runner.kv_slots.copy_(before)
        runner.compiled_decode = None
        eager, _ = execute(chunks)
        runner.compiled_decode = compiled
        calls.append((logits, eager, after_compiled, runner.kv_slots.clone()))
        return eager, sampled

    runner.execute = both
    return calls


class _Spy:
    def __init__(self, inner, hits: list) -> None:
        self.inner, self.hits = inner, hits

    def __call__(self, *args):
        self.hits.append(len(args[0]))
        return self.inner(*args)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_compiled_step_equals_the_eager_model(arch_dir, request):
    """Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms): same logits and same K/V written, batch 1 to 4."""
    llm = LLM(str(request.getfixturevalue(arch_dir)), block_size=4, num_kv_blocks=64)
    assert llm.core.runner.compiled_decode is not None
    calls = _record_both_paths(llm)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert {len(compiled) for compiled, *_ in calls} >= {len(PROMPTS)}  # the full batch took the compiled step
    for compiled, eager, kv_compiled, kv_eager in calls:
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_compiled, kv_eager, rtol=1e-5, atol=1e-5)


def test_greedy_output_is_the_same_with_and_without_the_compiled_step(tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    compiled = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    eager = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    eager.core.runner.compiled_decode = None
    assert ([o.token_ids for o in compiled.generate(PROMPTS, params)]
            == [o.token_ids for o in eager.generate(PROMPTS, params)])


def test_only_decode_steps_of_up_to_max_rows_take_the_compiled_step(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(decode_step_cpu, "MAX_ROWS", 3)
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    runner = llm.core.runner
    hits: list[int] = []
    runner.compiled_decode = _Spy(runner.compiled_decode, hits)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS, params)  # 4 decodes a step once all are prefilled: over the limit
    assert max(hits, default=0) <= 3
    hits.clear()
    llm.generate(PROMPTS[:3], params)  # 3 a step
    assert 3 in hits and max(hits) == 3


def test_warm_up_leaves_the_kv_pool_as_it_was(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    runner = llm.core.runner
    runner.kv_slots.normal_()
    before = runner.kv_slots.clone()
    runner.decode_probe()
    assert torch.equal(runner.kv_slots, before)


def test_rotary_rows_are_the_rotary_modules_own_output_as_the_table_grows(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    step = llm.core.runner.compiled_decode
    for positions in ([0, 7], [1023, 5], [4000, 1024, 2]):  # the last two grow the table past 1,024 rows
        got_cos, got_sin = step._rotary_rows(np.array(positions))
        want_cos, want_sin = step.rotary(torch.tensor(positions))
        assert np.array_equal(got_cos, want_cos.numpy()) and np.array_equal(got_sin, want_sin.numpy())
    assert len(step._cos) >= 4001


def test_supported_on_cpu_in_float32_and_bfloat16():
    assert decode_step_cpu.supports(torch.float32, torch.device("cpu"))
    assert decode_step_cpu.supports(torch.bfloat16, torch.device("cpu"))
    assert not decode_step_cpu.supports(torch.float16, torch.device("cpu"))
    assert not decode_step_cpu.supports(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_bfloat16_step_is_float32_math_over_bfloat16_weights_and_cache(arch_dir, request):
    """In bfloat16 the step widens weights and K/V to float32 and computes in float32: its logits are those
    of the float32 eager model over the same (bf16-valued) weights and cache, up to the rounding of the
    step's own K/V to bfloat16."""
    path = request.getfixturevalue(arch_dir)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="bfloat16")
    runner = llm.core.runner
    assert runner.compiled_decode is not None
    reference = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"), pack=False).float()
    execute, compiled = runner.execute, runner.compiled_decode
    compared = []

    def against_float32(chunks):
        kv32 = runner.kv_slots.float().view(runner.kv_slots.shape[0], runner.kv_slots.shape[1], -1,
                                            runner.block_size, *runner.kv_slots.shape[3:])
        hits = []
        runner.compiled_decode = _Spy(compiled, hits)
        logits, sampled = execute(chunks)
        runner.compiled_decode = compiled
        if hits:
            float32_runner = ModelRunner(reference, kv32, llm.core.kv, torch.device("cpu"))
            float32_runner.compiled_decode = None
            expected, _ = float32_runner.execute(chunks)
            torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)
            compared.append(len(hits))
        return logits, sampled

    runner.execute = against_float32
    llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert compared


def test_a_strided_tensor_is_refused_rather_than_copied():
    """The step writes K/V through its numpy views: a silent copy of the cache would drop those writes."""
    with pytest.raises(ValueError, match="contiguous"):
        numpy_view(torch.zeros(4, 6).t())
    cache = torch.zeros(2, 3, dtype=torch.bfloat16)
    numpy_view(cache)[0, 0] = 0x3F80  # the bits of 1.0
    assert cache[0, 0].item() == 1.0
