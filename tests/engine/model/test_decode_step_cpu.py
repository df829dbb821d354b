"""The compiled CPU decode step gives plain PyTorch's logits and K/V (a model without packed weights and torch's
attention: no numba at all) and transformers' greedy tokens for a SmolLM2-shaped model; the runner takes it only
for decode-only steps of up to MAX_ROWS rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.tiny_models import build_tiny_model
from engine import LLM, SamplingParams
from engine.model import decode_step_cpu, paged_decode_cpu
from engine.model.bfloat16_bits import numpy_view
from engine.model.loader import load_model
from engine.model.model_config import load_config
from engine.runner import ModelRunner

# three prompts sharing their first two blocks (the engine attends them by cascade) and one that
# shares nothing; ragged lengths, so the rows' contexts end mid-block at different offsets
PROMPTS = [list(range(3, 14)), list(range(3, 11)) + [40, 41, 42, 43, 44, 45], list(range(3, 12)), [90, 91, 92]]


def _plain_runner(llm: LLM, path) -> ModelRunner:
    """A runner over the engine's own K/V pool and block tables whose model has no packed weights (quantized
    ones multiply module by module) and whose attention is torch's (compiled_kernels=False): the reference the
    compiled step is held to."""
    runner = llm.core.runner
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"), pack=False,
                       weights=llm.core.weights_format, integer_activations=llm.core.integer_activations)
    kv = runner.kv_slots.view(*runner.kv_slots.shape[:2], -1, runner.block_size, *runner.kv_slots.shape[3:])
    return ModelRunner(model, kv, llm.core.kv, torch.device("cpu"), compiled_kernels=False)


def _record_both_paths(llm: LLM, path) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Makes every runner step that takes the compiled step run a second time from the same K/V in plain
    PyTorch. Returns, per compiled step, (compiled logits, plain logits, K/V after the compiled step, K/V after
    the plain one); the engine goes on with the plain results."""
    runner, plain = llm.core.runner, _plain_runner(llm, path)
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
        reference, _ = plain.execute(chunks)
        calls.append((logits, reference, after_compiled, runner.kv_slots.clone()))
        runner.greedy_ids = None  # (the compiled step's, not the reference logits')
        return reference, sampled

    runner.execute = both
    return calls


class _Spy:
    def __init__(self, inner, hits: list) -> None:
        self.inner, self.hits = inner, hits

    def run(self, *args):
        """The runner's entry (numpy index arrays): counts the step's rows."""
        self.hits.append(len(args[0]))
        return self.inner.run(*args)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_compiled_step_equals_plain_pytorch(arch_dir, request):
    """Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms): same logits and same K/V written, batch 1 to 4."""
    path = request.getfixturevalue(arch_dir)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64)
    assert llm.core.runner.compiled_decode is not None
    calls = _record_both_paths(llm, path)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert {len(compiled) for compiled, *_ in calls} >= {len(PROMPTS)}  # the full batch took the compiled step
    for compiled, plain, kv_compiled, kv_plain in calls:
        torch.testing.assert_close(compiled, plain, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_compiled, kv_plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_compiled_step_on_quantized_weights_equals_the_module_path(quantization, tiny_qwen2_dir):
    """The step's matmuls and embedding rows over quantized tiles (and a float bias: Qwen2's q/k/v). Float
    arithmetic only: int8 activations round, and the two paths' fp32 differences (1e-7) then land on either side
    of a rounding step now and then (their own test: test_quantized_models.py's int8 case)."""
    llm = LLM(str(tiny_qwen2_dir), block_size=4, num_kv_blocks=64, quantization=quantization,
              kv_cache_dtype="float32")  # (quantized weights default to bf16 K/V, whose rounding the two paths may split)
    assert llm.core.runner.compiled_decode is not None
    calls = _record_both_paths(llm, tiny_qwen2_dir)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert {len(compiled) for compiled, *_ in calls} >= {len(PROMPTS)}
    for compiled, plain, kv_compiled, kv_plain in calls:
        torch.testing.assert_close(compiled, plain, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_compiled, kv_plain, rtol=1e-5, atol=1e-5)


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


def test_the_steps_greedy_tokens_are_its_logits_argmax(tiny_llama_dir):
    """The lm_head's threads find each row's largest logit among their columns: batch 1 to 4, the runner's
    greedy ids are numpy's argmax of the step's logits."""
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    runner = llm.core.runner
    execute, rows = runner.execute, []

    def check(chunks):
        logits, sampled = execute(chunks)
        if runner.greedy_ids is not None:
            rows.append(len(sampled))
            assert np.array_equal(runner.greedy_ids, np.argmax(logits.numpy(), axis=1))
        return logits, sampled

    runner.execute = check
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert {1, len(PROMPTS)} <= set(rows)


@pytest.mark.parametrize("start,end", [(0, 100), (5, 100), (3, 20), (7, 8), (0, 64)])
def test_first_largest_is_the_first_of_equal_maxima(start, end):
    """Within vectors and in the tail past them, from an unaligned start, an infinity included: numpy's
    argmax of the range."""
    rng = np.random.default_rng(start * 100 + end)
    for plant in ([], [end - 1], [start, end - 1], [(start + end) // 2, end - 1], [start + 1, (start + end) // 2]):
        row = rng.standard_normal(100).astype(np.float32)
        row[[j for j in plant if start <= j < end]] = 9.0
        assert decode_step_cpu._first_largest(row, start, end) == start + np.argmax(row[start:end])
        row[end - 1] = np.inf
        assert decode_step_cpu._first_largest(row, start, end) == end - 1


def test_greedy_of_runs_takes_an_earlier_run_on_a_tie():
    logits = np.zeros((3, 64), np.float32)
    logits[0, [10, 40]] = 5.0  # a tie across the runs [0, 32) and [32, 64): the first
    logits[1, [10, 40]] = 5.0, 6.0  # the later run's larger value
    logits[2, 50] = 1.0
    best = np.array([[np.argmax(logits[r, :32]) for r in range(3)],
                     [32 + np.argmax(logits[r, 32:]) for r in range(3)]])
    greedy = np.empty(3, np.int64)
    decode_step_cpu._greedy_of_runs(logits, best, 2, greedy)
    assert greedy.tolist() == [10, 40, 50] == np.argmax(logits, axis=1).tolist()
    decode_step_cpu._greedy_of_runs(logits, best, 1, greedy)  # one run: its own largest only
    assert greedy.tolist() == [10, 10, 0]


def test_rotary_rows_are_the_rotary_modules_own_output_as_the_table_grows(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    step = llm.core.runner.compiled_decode
    # the third grows the table past 1,024 rows; one position is a view of the table's row
    for positions in ([0, 7], [1023, 5], [4000, 1024, 2], [4000], [3]):
        got_cos, got_sin = step._rotary_rows(np.array(positions))
        want_cos, want_sin = step.rotary(torch.tensor(positions))
        assert np.array_equal(got_cos, want_cos.numpy()) and np.array_equal(got_sin, want_sin.numpy())
    assert len(step._cos) >= 4001


def test_supported_on_cpu_in_float32_and_bfloat16():
    assert decode_step_cpu.supports(torch.float32, torch.device("cpu"))
    assert decode_step_cpu.supports(torch.bfloat16, torch.device("cpu"))
    assert not decode_step_cpu.supports(torch.float16, torch.device("cpu"))
    assert not decode_step_cpu.supports(torch.float32, torch.device("cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_bfloat16_step_is_float32_math_over_bfloat16_weights_and_cache(arch_dir, request):
    """In bfloat16 the step widens weights and K/V to float32 and computes in float32: its logits are those
    of the float32 plain PyTorch model over the same (bf16-valued) weights and cache, up to the rounding of the
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
            float32_runner = ModelRunner(reference, kv32, llm.core.kv, torch.device("cpu"), compiled_kernels=False)
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


# SmolLM2-135M's attention and widths (hidden 576; 9 query heads of 64 over 3 kv heads; its norm epsilon and rotary
# base) in 2 layers of random weights. Their scale is 0.1 rather than its 0.02: logits 5x wider apart, so the
# argmax margins checked below stay clear of float32 noise, and attention scores over +-20
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                     max_position_embeddings=2048, initializer_range=0.1)
NEW_TOKENS = 8
MARGIN = 1e-3  # the smallest gap between transformers' best two logits that a greedy comparison relies on
BLOCK_SIZE = 12  # shared prefixes of 25 and 22 blocks: 300 and 264 slots, no multiple of a 16- or 32-key tile


@pytest.fixture(scope="module")
def smollm2_case(tmp_path_factory):
    """(model dir, prefixes to cache first, a batch of prompts, one prompt alone, transformers' greedy tokens
    and logits of every prompt). The batch: 12 rows behind a 300-token prefix (a cascade group in the matmul
    form, in 64-slot chunks: 4 and one of 44), 3 behind a 264-token one (the plain loops, 85-slot chunks), and
    2 that share nothing and grow past 2 * CHUNK (to 513 slots: a last chunk of one slot); 17 rows, past one
    row group of the matmuls."""
    path = build_tiny_model(tmp_path_factory.mktemp("smollm2-shaped"), "llama", **SMOLLM2_SHAPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()

    prefixes = [tokens(300), tokens(264)]
    batch = [prefixes[0] + tokens(n) for n in (1, 2, 5, 11, 12, 13, 40, 100, 180, 211, 230, 251)]
    batch += [prefixes[1] + tokens(n) for n in (1, 30, 77)] + [tokens(505), tokens(530)]
    alone = tokens(520)
    expected = {}
    for prompt in batch + [alone]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
        expected[tuple(prompt)] = (out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits))
    for tokens, logits in expected.values():  # greedy from the raw logits (min_new_tokens masks EOS, never chosen)
        assert tokens == logits.argmax(dim=-1).tolist()
    margins = torch.cat([logits.topk(2).values.diff(dim=-1).abs() for _, logits in expected.values()])
    assert margins.min() > MARGIN, "this seed gives a near tie between two tokens: the comparison would be luck"
    assert 2 * paged_decode_cpu.CHUNK in range(505, 505 + NEW_TOKENS)
    return path, prefixes, batch, alone, expected


def _record_logits(llm: LLM) -> dict[tuple[tuple[int, ...], int], torch.Tensor]:
    """The logits each request's tokens were sampled from, by (prompt, index of the token)."""
    runner = llm.core.runner
    execute = runner.execute
    recorded: dict = {}

    def record(chunks):
        logits, sampled = execute(chunks)
        for row, chunk in zip(logits, sampled):
            recorded[tuple(chunk.request.prompt_token_ids), len(chunk.request.output_token_ids)] = row.clone()
        return logits, sampled

    runner.execute = record
    return recorded


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", ["compiled", "eager"])
def test_smollm2_shaped_model_gives_transformers_greedy_tokens_and_logits(smollm2_case, cpu_kernels):
    """Compiled decode steps of 17 rows and of one (and eager PyTorch, no numba) against transformers: the same
    greedy tokens, and every sampled token's logits within 1e-4 (a wrong epsilon or rotary moves them more)."""
    path, prefixes, batch, alone, expected = smollm2_case
    llm = LLM(str(path), block_size=BLOCK_SIZE, num_kv_blocks=600, max_model_len=1024,
              max_num_batched_tokens=4096, cpu_kernels=cpu_kernels)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prefixes, SamplingParams(max_tokens=1))  # cached, so that the batch's rows share their blocks
    recorded = _record_logits(llm)
    steps: list[tuple[int, list[int]]] = []  # the compiled steps' rows and cascade groups' sizes
    if cpu_kernels == "compiled":
        run = llm.core.runner.compiled_decode.run

        def spy(input_ids, *args):
            steps.append((len(input_ids), sorted(len(group.rows) for group in args[-1])))
            return run(input_ids, *args)

        llm.core.runner.compiled_decode.run = spy
    outputs = llm.generate(batch, greedy) + llm.generate(alone, greedy)
    for out in outputs:
        tokens, logits = expected[tuple(out.prompt_token_ids)]
        assert out.token_ids == tokens
        got = torch.stack([recorded[tuple(out.prompt_token_ids), i] for i in range(NEW_TOKENS)])
        torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
    if cpu_kernels == "compiled":
        assert (len(batch), [3, 12]) in steps and (1, []) in steps


def test_typed_list_holds_the_items_in_order_as_a_list_of_their_type():
    """What the step's per-layer lists are built with: each item the very array given (no copy), in order, in a
    numba typed list of that array type; a quantized weight's (data, scales, mins, group) tuples too."""
    from numba import typeof, types

    arrays = [np.arange(i, i + 4, dtype=np.float32) for i in range(3)]
    built = decode_step_cpu.typed_list(arrays)
    assert typeof(built) == types.ListType(typeof(arrays[0])) and len(built) == 3
    assert all(np.shares_memory(ours, given) and np.array_equal(ours, given) for ours, given in zip(built, arrays))
    quantized = [(np.zeros((1, 2, 16), np.uint8), np.ones((1, 1, 16), np.float32), np.zeros((1, 0, 16), np.float32),
                  32) for _ in range(2)]
    built = decode_step_cpu.typed_list(quantized)
    assert typeof(built) == types.ListType(typeof(quantized[0])) and [item[3] for item in built] == [32, 32]
