"""Quantized models end to end on tiny random weights: GGUF files in every format the kernels run (and one
they don't), and HF checkpoints quantized at load. Quantized weights give the dequantized model's greedy
tokens, with or without the cache, through the compiled decode step and the eager path alike."""
from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.model import quant_dot_cpu, quant_formats
from engine.model.quant_matmul_cpu import KERNEL_ROWS
from engine.model.loader import at_load_format, weights_format
from tests.support.tiny_gguf import write_gguf_model

NEW_TOKENS = 24
# min_tokens masks EOS as transformers' min_new_tokens does, so both pick the same token where EOS leads
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
# fp32 K/V: the dequantized model's own (quantized weights default to bf16 K/V: test_quantized_weights_keep_...)
# a chunk may hold a whole prompt (below), which is longer than the float kernel's largest step (its KERNEL_ROWS)
LIMIT = max(KERNEL_ROWS.values())
SMALL = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=LIMIT + 32, kv_cache_dtype="float32")


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # whole blocks shared (LIMIT of them on AVX2, 16 on AVX-512) and 4 tokens more; each prompt longer than the
    # float kernel's largest step, so a prompt alone runs the dequantized GEMM and its cache hit's last block the kernel
    shared = torch.randint(3, vocab_size, (LIMIT + 4,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 1, 20)]
    assert min(map(len, prompts)) > LIMIT and max(map(len, prompts)) <= SMALL["max_num_batched_tokens"]
    return prompts


def _whole_blocks(prompts) -> list[int]:
    """The cached tokens of each prompt asked again: every whole block of it but its last token."""
    return [(len(p) - 1) // SMALL["block_size"] * SMALL["block_size"] for p in prompts]


def _transformers_greedy(model_dir, prompts) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            for p in prompts]
    return [out[0, len(p):].tolist() for out, p in zip(outs, prompts)]


def _greedy_twice(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of the prompts alone, then again batched (cache hits); asserts both runs agree."""
    first = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == first
    return first, [o.num_cached_tokens for o in again]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_f32_gguf_gives_transformers_greedy_tokens(arch, request, tmp_path):
    """llama.cpp's names and its q/k row permutation (llama only) undone at load."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    gguf_dir = write_gguf_model(model_dir, tmp_path / "gguf", lambda name: QType.F32)
    prompts = _prompts(LLM(str(gguf_dir), **SMALL).core.vocab_size)
    tokens, _ = _greedy_twice(LLM(str(gguf_dir), **SMALL), prompts)
    assert tokens == _transformers_greedy(model_dir, prompts)


# q/k/v stacked from three formats; one layer's ffn_down in a format no kernel runs
MIXED = {".attn_q.": QType.Q4_0, ".attn_k.": QType.Q4_1, ".attn_v.": QType.Q8_0, "blk.0.ffn_down.": QType.Q5_0}


@pytest.mark.parametrize("files", ["Q8_0", "Q4_0", "Q4_1", "mixed"])
def test_native_formats_give_the_dequantized_models_tokens(files, tiny_llama_dir, tmp_path, caplog):
    def format_of(name: str) -> QType:
        if files == "mixed":
            return next((qtype for part, qtype in MIXED.items() if part in name), QType.Q8_0)
        return QType[files]
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", format_of)
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        native = LLM(str(gguf_dir), **SMALL)
    assert native.core.weights_format == "gguf"
    layer = native.core.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant is not None and layer.self_attn.qkv_proj.weight is None
    assert native.core.model.lm_head.quant is native.core.model.model.embed_tokens.quant  # tied, one copy
    assert layer.self_attn.qkv_proj.quant.scales.dtype == torch.int16  # the file's fp16 scales, as they are
    if files == "mixed":
        qkv = layer.self_attn.qkv_proj  # 4-bit q and k, then 8-bit v in tiles of its own
        assert (qkv.quant.bits, qkv.quant_tail.bits, qkv.quant_tail.out_features) == (4, 8, qkv.out_features // 4)
        assert layer.mlp.down_proj.quant is None and "Q5_0" in caplog.text
        assert native.core.model.model.layers[1].mlp.down_proj.quant is not None
        assert native.core.runner.compiled_decode is None  # float and quantized down_proj: the eager path
    else:
        assert native.core.runner.compiled_decode is not None
    dequantized = LLM(str(gguf_dir), quantization="none", **SMALL)
    assert dequantized.core.model.lm_head.quant is None
    prompts = _prompts(native.core.vocab_size)
    tokens, cached = _greedy_twice(native, prompts)
    assert cached == _whole_blocks(prompts)  # every whole block of each prompt but its last token
    assert _greedy_twice(dequantized, prompts)[0] == tokens
    assert _greedy_twice(LLM(str(gguf_dir), cpu_kernels="eager", **SMALL), prompts)[0] == tokens


def _q4_k_m(name: str) -> QType:
    """llama-quantize's Q4_K_M mix: Q6_K for the embedding and for v and ffn_down in some layers (here layer 0)."""
    six = name == "token_embd.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight")
    return QType.Q6_K if six else QType.Q4_K


def test_k_quants_give_the_dequantized_models_tokens_from_super_block_records(k_quant_llama_dir, tmp_path):
    """A Q4_K_M-like file: its K-quants run natively with their two-level scales as super-block records and Q6_K
    in 6 bits (layer 0's qkv: Q4_K q and k in 4-bit tiles, its Q6_K v in 6-bit ones after them), the tiles the
    file's bits a weight but for 1/8 bit a Q4_K one; greedy tokens equal the dequantized model's, with or without
    the cache."""
    gguf_dir = write_gguf_model(k_quant_llama_dir, tmp_path / "gguf", _q4_k_m)
    native = LLM(str(gguf_dir), **SMALL)
    model = native.core.model
    first, second = model.model.layers
    config = model.config
    kv_size = config.num_key_value_heads * config.head_dim
    assert [first.self_attn.qkv_proj.quant.bits, second.self_attn.qkv_proj.quant.bits] == [4, 4]
    assert first.self_attn.qkv_proj.quant_tail.bits == 6 and second.self_attn.qkv_proj.quant_tail is None
    assert first.self_attn.qkv_proj.quant_tail.out_features == kv_size
    assert [first.mlp.down_proj.quant.bits, second.mlp.down_proj.quant.bits] == [6, 4]
    quants = _all_tiles(model)
    assert all(q.scales.dtype == torch.int8 for q in quants)
    # 4.625 bits a Q4_K weight (its 6-bit sub-scales and mins in bytes) and 6.5625 a Q6_K one, as the file
    six_bit = (config.vocab_size + kv_size + config.intermediate_size) * config.hidden_size  # embedding, v, down
    weights = sum(q.out_features * q.in_features for q in quants)
    assert sum(q.nbytes() for q in quants) * 8 == 6.5625 * six_bit + 4.625 * (weights - six_bit)
    assert native.core.runner.compiled_decode is not None
    prompts = _prompts(native.core.vocab_size)
    tokens, cached = _greedy_twice(native, prompts)
    assert cached == _whole_blocks(prompts)
    assert _greedy_twice(LLM(str(gguf_dir), quantization="none", **SMALL), prompts)[0] == tokens
    assert _greedy_twice(LLM(str(gguf_dir), cpu_kernels="eager", **SMALL), prompts)[0] == tokens


def _all_tiles(model) -> list:
    """Every quantized weight's tiles, once (a tied embedding shares the lm_head's), fused ones' tails too."""
    tiles = [t for m in model.modules() for t in (getattr(m, "quant", None), getattr(m, "quant_tail", None))]
    return list({id(t): t for t in tiles if t is not None}.values())


def test_gate_and_up_of_two_formats_stay_one_layout_and_give_the_dequantized_models_tokens(k_quant_llama_dir,
                                                                                             tmp_path):
    """Only q/k/v keep a tail (the compiled step runs no other): a Q6_K up beside a Q4_K gate widens the gate."""
    gguf_dir = write_gguf_model(k_quant_llama_dir, tmp_path / "gguf",
                                lambda name: QType.Q6_K if name == "blk.0.ffn_up.weight" else QType.Q4_K)
    native = LLM(str(gguf_dir), **SMALL)
    gate_up = native.core.model.model.layers[0].mlp.gate_up_proj
    assert gate_up.quant_tail is None and gate_up.quant.bits == 6
    assert native.core.runner.compiled_decode is not None
    prompts = _prompts(native.core.vocab_size)
    assert _greedy_twice(native, prompts)[0] == _greedy_twice(LLM(str(gguf_dir), quantization="none", **SMALL),
                                                              prompts)[0]


def _dequantized_twin(model_dir, out_dir, quantization: str):
    """model_dir with every weight quantize-at-load touches replaced by its quantized-then-dequantized value."""
    shutil.copytree(model_dir, out_dir)
    state = load_file(out_dir / "model.safetensors")
    tied = json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"  # an untied embedding stays float
    for name, value in state.items():
        if name.endswith("proj.weight") or name == head:
            rows = quant_formats.quantize(value.float().numpy(), at_load_format(name, quantization))
            state[name] = torch.from_numpy(np.ascontiguousarray(rows.dequantize()))
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, out_dir / "model.safetensors")
    return out_dir


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_quantized_at_load_gives_transformers_tokens_on_the_dequantized_weights(arch, quantization, request,
                                                                                 tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    twin = _dequantized_twin(model_dir, tmp_path / "twin", quantization)
    llm = LLM(str(model_dir), quantization=quantization, **SMALL)
    assert llm.core.weights_format == quantization and llm.core.runner.compiled_decode is not None
    prompts = _prompts(llm.core.vocab_size)
    tokens, cached = _greedy_twice(llm, prompts)
    assert cached == _whole_blocks(prompts)  # every whole block of each prompt but its last token
    assert tokens == _transformers_greedy(twin, prompts)


def test_quantized_weights_keep_kv_in_bfloat16_by_default(tiny_llama_dir, tmp_path):
    """As llama.cpp's 16-bit K/V: twice the blocks in the same memory; the dequantized model keeps its fp32."""
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.Q8_0)
    quantized = LLM(str(gguf_dir), kv_cache_memory_mb=1)
    dequantized = LLM(str(gguf_dir), kv_cache_memory_mb=1, quantization="none")
    assert quantized.core.runner.kv_slots.dtype == torch.bfloat16
    assert dequantized.core.runner.kv_slots.dtype == torch.float32
    assert quantized.core.num_blocks == 2 * dequantized.core.num_blocks
    assert LLM(str(gguf_dir), kv_cache_memory_mb=1, kv_cache_dtype="float32").core.runner.kv_slots.dtype == torch.float32
    prompts = _prompts(quantized.core.vocab_size)
    assert _greedy_twice(quantized, prompts)[1] == _whole_blocks(prompts)  # cached == uncached on bf16 K/V too


def test_weights_format_follows_dtype_and_kernels(tiny_llama_dir, tmp_path):
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.Q8_0)
    assert weights_format(gguf_dir, "auto", "auto", True) == "gguf"
    assert weights_format(gguf_dir, "auto", "float32", True) == "none"  # a dtype asked for: dequantized
    assert weights_format(gguf_dir, "auto", "auto", False) == "none"  # eager kernels: dequantized
    assert weights_format(tiny_llama_dir, "auto", "auto", True) == "none"
    with pytest.raises(ValueError, match="already quantized"):
        weights_format(gguf_dir, "q8_0", "auto", True)
    with pytest.raises(ValueError, match="compiled CPU kernels only"):
        weights_format(tiny_llama_dir, "q4_0", "auto", False)


def test_int8_activations_where_they_cannot_apply_say_so(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """--quantized-activations int8 on float weights, or on a CPU without integer dot products, runs the float
    path, and says so at start-up rather than silently."""
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        llm = LLM(str(tiny_llama_dir), quantized_activations="int8", kv_cache_memory_mb=1)
    assert not llm.core.integer_activations
    assert "applies to quantized weights" in caplog.text and "float32 on float arithmetic" in caplog.text
    caplog.clear()
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.Q8_0)
    monkeypatch.setattr(quant_dot_cpu, "X86", False)  # as on an ARM CPU
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        llm = LLM(str(gguf_dir), quantized_activations="int8", **SMALL)
    packed = [m.quant for m in llm.core.model.modules() if getattr(m, "quant", None) is not None]
    assert packed and not any(quant.integer for quant in packed)
    assert "stay on the float kernel" in caplog.text and "model.embed_tokens.weight" in caplog.text


@pytest.mark.skipif(not quant_dot_cpu.X86, reason="integer dot products are x86 (AVX2) code")
@pytest.mark.parametrize("files", ["Q8_0", "Q4_1"])
def test_int8_activations_run_integer_dot_products_and_the_cache_never_changes_their_tokens(files, tiny_llama_dir,
                                                                                           tmp_path):
    """--quantized-activations int8: every matmul weight packed for integer dot products; greedy tokens with cache hits
    equal those without (prefill's large batches multiply the same rounded activations), and the first token's
    logprobs stay within the activations' rounding of the exact kernel's."""
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType[files])
    llm = LLM(str(gguf_dir), quantized_activations="int8", **SMALL)
    assert llm.core.integer_activations and llm.core.runner.compiled_decode is not None
    assert all(m.quant.integer for m in llm.core.model.modules() if getattr(m, "quant", None) is not None)
    prompts = _prompts(llm.core.vocab_size)
    _, cached = _greedy_twice(llm, prompts)
    assert cached == _whole_blocks(prompts)
    _assert_near_the_exact_kernels(llm, LLM(str(gguf_dir), **SMALL), prompts)


def _assert_near_the_exact_kernels(llm: LLM, exact: LLM, prompts, relative: float = 0.1) -> None:
    """The first token's distribution (prefill): the five likeliest tokens of each model, with their logprobs,
    within the activations' rounding of the other's (measured here: up to 7% of a logprob after 2 layers of
    random weights and 270-token prompts, whose near-ties may swap neighbours; 13.5% on the Q4_K_M-like file,
    whose 6-bit lm_head multiplies rounded activations too, each of its matmuls within 3e-7 of float64 on them;
    a wrong kernel moves them by whole units)."""
    assert not exact.core.integer_activations and not exact.core.model.lm_head.quant.integer
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    for ours, theirs in zip(llm.generate(prompts, first), exact.generate(prompts, first)):
        ours_top, theirs_top = dict(ours.logprobs[0].top_logprobs), dict(theirs.logprobs[0].top_logprobs)
        shared = ours_top.keys() & theirs_top.keys()
        assert len(shared) >= 4
        for token in shared:
            assert abs(ours_top[token] - theirs_top[token]) <= relative * abs(theirs_top[token]) + 0.02


@pytest.mark.skipif(not quant_dot_cpu.X86, reason="integer dot products are x86 (AVX2) code")
def test_int8_activations_on_k_quants_read_their_super_block_records(k_quant_llama_dir, tmp_path):
    """--quantized-activations int8 on a Q4_K_M-like file: the Q4_K and Q6_K weights (and layer 0's qkv, Q4_K q
    and k before a Q6_K v in tiles of its own) on integer dot products with their two-level scales as
    super-block records (the file's bytes, not float32 products); greedy tokens with cache hits equal those
    without, the first token's logprobs near the exact kernels'."""
    gguf_dir = write_gguf_model(k_quant_llama_dir, tmp_path / "gguf", _q4_k_m)
    llm = LLM(str(gguf_dir), quantized_activations="int8", **SMALL)
    first, second = llm.core.model.model.layers
    assert [first.self_attn.qkv_proj.quant.bits, first.self_attn.qkv_proj.quant_tail.bits,
            first.mlp.down_proj.quant.bits, llm.core.model.lm_head.quant.bits,
            second.mlp.down_proj.quant.bits] == [4, 6, 6, 6, 4]
    quants = _all_tiles(llm.core.model)
    assert all(q.integer and q.scales.dtype == torch.int8 for q in quants)
    assert llm.core.runner.compiled_decode is not None
    prompts = _prompts(llm.core.vocab_size)
    _, cached = _greedy_twice(llm, prompts)
    assert cached == _whole_blocks(prompts)
    _assert_near_the_exact_kernels(llm, LLM(str(gguf_dir), **SMALL), prompts, relative=0.2)


def test_quantized_at_load_the_head_stays_8_bit_beside_4_bit_layers():
    """llama-quantize's rule: the lm_head (the tied embedding) of a Q4_0 file is Q8_0."""
    assert at_load_format("model.layers.0.mlp.down_proj.weight", "q4_0") == QType.Q4_0
    assert at_load_format("model.embed_tokens.weight", "q4_0") == QType.Q8_0
    assert at_load_format("lm_head.weight", "q4_0") == QType.Q8_0
    assert at_load_format("model.layers.0.self_attn.qkv_proj.weight", "q8_0") == QType.Q8_0
