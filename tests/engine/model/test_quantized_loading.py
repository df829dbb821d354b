"""What a load makes of a checkpoint's formats: a GGUF file of float weights runs (and quantizes at load) as an HF
checkpoint would, rows that are not whole blocks stay float, an unsupported architecture is refused before any
weight is read, and weights stream in, one decoded at a time."""
from __future__ import annotations

import logging
import types
import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from bench.hf_baseline import hf_model
from bench.tiny_models import build_tiny_model
from engine import LLM, SamplingParams
from engine.model import quant_formats
from engine.model.loader import load_model, weights_format
from tests.support.tiny_gguf import write_gguf_file, write_gguf_model

SMALL = dict(block_size=16, num_kv_blocks=64)
GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16], ids=["F16", "BF16"])
def test_a_float_gguf_runs_as_float_weights(qtype, tiny_llama_dir, tmp_path, caplog):
    """No quantized tensor in the file: the model's dtype for K/V, and int8 activations refused aloud."""
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: qtype)
    assert weights_format(gguf_dir, "auto", "auto", True) == "none"
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        llm = LLM(str(gguf_dir), quantized_activations="int8", **SMALL)
    assert llm.core.weights_format == "none" and not llm.core.integer_activations
    assert llm.core.runner.kv_slots.dtype == torch.float32
    assert "applies to quantized weights" in caplog.text


def test_a_float_gguf_quantizes_at_load_as_its_hf_checkpoint(tiny_llama_dir, tmp_path):
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.F32)
    from_gguf = LLM(str(gguf_dir), quantization="q4_0", **SMALL)
    assert from_gguf.core.model.model.layers[0].self_attn.qkv_proj.quant is not None
    from_hf = LLM(str(tiny_llama_dir), quantization="q4_0", **SMALL)
    assert from_gguf.generate(PROMPT, GREEDY)[0].token_ids == from_hf.generate(PROMPT, GREEDY)[0].token_ids


def test_a_quantized_gguf_refuses_quantization_naming_the_users_file(tiny_llama_dir, tmp_path):
    """The model directory (the cache's) links the user's file: the refusal names that file."""
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "cache", lambda name: QType.Q8_0)
    users_file = tmp_path / "mine.gguf"
    (gguf_dir / "model.gguf").rename(users_file)
    (gguf_dir / "model.gguf").symlink_to(users_file)
    with pytest.raises(ValueError, match="already quantized") as refused:
        weights_format(gguf_dir, "q8_0", "auto", True)
    assert str(users_file) in str(refused.value) and str(gguf_dir) not in str(refused.value)


def test_quantize_at_load_leaves_rows_that_are_not_whole_blocks_in_float(tmp_path, caplog):
    """An intermediate size of 200: ffn_down's rows are not whole 32-weight blocks, so it stays float (packed),
    as llama-quantize leaves such a tensor; the other weights are quantized."""
    model_dir = build_tiny_model(tmp_path / "inter200", "llama", intermediate_size=200)
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        llm = LLM(str(model_dir), quantization="q8_0", **SMALL)
    layer = llm.core.model.model.layers[0]
    assert layer.mlp.down_proj.quant is None and layer.mlp.down_proj.packed is not None
    assert layer.mlp.gate_up_proj.quant is not None and llm.core.model.lm_head.quant is not None
    warnings = [r.message for r in caplog.records if "not whole blocks" in r.message]
    assert len(warnings) == 1 and "model.layers.1.mlp.down_proj.weight" in warnings[0]
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_an_unsupported_architecture_is_refused_before_its_weights_are_read(tmp_path):
    """phi3's fused attn_qkv has no place in our decoder: the model type is named, not the tensor."""
    (tmp_path / "config.json").write_text("{}")
    write_gguf_file(tmp_path / "model.gguf", {"blk.0.attn_qkv.weight": np.zeros((96, 32), np.float32)},
                    architecture="phi3")
    with pytest.raises(ValueError, match="unsupported model type 'phi3'; supported: "):
        load_model(tmp_path, types.SimpleNamespace(model_type="phi3"), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_load_decodes_one_weight_at_a_time(quantization, tmp_path, monkeypatch):
    """However many layers, the QuantRows alive at once stay a handful (a fused projection's parts and the weight
    before it), natively or dequantized: each weight is decoded and placed (packed) before the next is read. The
    model's logprobs are transformers' on the file's dequantized weights (gguf_loader.read_tensors, all at once)."""
    model_dir = build_tiny_model(tmp_path / "deep", "llama", num_hidden_layers=8)
    gguf_dir = write_gguf_model(model_dir, tmp_path / "gguf", lambda name: QType.Q8_0)
    alive, peak = [0], [0]
    init = quant_formats.QuantRows.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(self, lambda: alive.__setitem__(0, alive[0] - 1))

    monkeypatch.setattr(quant_formats.QuantRows, "__init__", counted)
    llm = LLM(str(gguf_dir), quantization=quantization, kv_cache_dtype="float32", **SMALL)
    monkeypatch.undo()
    assert llm.core.weights_format == ("gguf" if quantization == "auto" else "none")
    assert 0 < peak[0] <= 6  # (all at once: 8 layers of 7 weights and the embedding, and the fused ones)
    ours = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    with torch.no_grad():
        theirs = torch.log_softmax(hf_model(str(gguf_dir))(torch.tensor([PROMPT])).logits[0], -1)
    for position in range(1, len(PROMPT)):
        assert ours[position].logprob == pytest.approx(theirs[position - 1, PROMPT[position]].item(), abs=1e-4)


def test_dequantize_in_runs_of_rows_is_the_gguf_librarys(monkeypatch):
    """A run of rows at a time (the float64 temporaries of one run, not of the whole weight): the same floats."""
    weight = np.random.default_rng(0).standard_normal((10, 64)).astype(np.float32)
    raw = quantize(weight, QType.Q4_1)
    monkeypatch.setattr(quant_formats, "DEQUANTIZE_WEIGHTS", 3 * 64)
    rows = quant_formats.decode(raw, QType.Q4_1, 64)
    assert np.array_equal(rows.dequantize(), dequantize(raw, QType.Q4_1).reshape(10, 64))
