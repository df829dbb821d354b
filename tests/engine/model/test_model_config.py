"""config.json read without transformers: every field the engine reads equals transformers' own config's, for
each model type, with keys left out, set to null or given; other rope types and architectures go through
transformers; an engine on a plain config never imports it."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from engine.model.model_config import ModelConfig, load_config, plain_config

FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
SHAPE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}
GIVEN = {"head_dim": 32, "num_key_value_heads": 2, "eos_token_id": [1, 2], "bos_token_id": 5,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "attention_bias": True,
         "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
NULLS = {"num_key_value_heads": None, "eos_token_id": None, "rope_theta": 5e5, "rope_scaling": None}


def _write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("keys", [{}, NULLS, GIVEN, {"head_dim": None}], ids=["left-out", "nulls", "given", "no-head-dim"])
def test_plain_configs_read_as_transformers_reads_them(tmp_path, model_type, keys):
    raw = {"model_type": model_type, **SHAPE, **keys}
    if model_type == "qwen3" and keys.get("head_dim", 0) is None:
        raw["head_dim"] = 16  # transformers refuses a null head_dim for Qwen3
    ours, theirs = plain_config(raw), AutoConfig.from_pretrained(_write(tmp_path, raw))
    assert isinstance(ours, ModelConfig)
    for name in FIELDS:
        expected = getattr(theirs, name, None)
        if expected is None and name in ("head_dim", "attention_bias", "mlp_bias"):  # fields Qwen2 does not have
            expected = {"head_dim": 16, "attention_bias": False, "mlp_bias": False}[name]
        assert getattr(ours, name) == expected, name


def test_the_tiny_models_configs_read_as_transformers_reads_them(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
    for path in (tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
        ours, theirs = load_config(path), AutoConfig.from_pretrained(path)
        assert isinstance(ours, ModelConfig)
        assert {n: getattr(ours, n) for n in FIELDS} == {n: getattr(theirs, n, getattr(ours, n)) for n in FIELDS}


@pytest.mark.parametrize("extra", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    {"model_type": "mistral"},
])
def test_other_rope_types_and_architectures_go_through_transformers(tmp_path, extra):
    raw = {"model_type": "llama", **SHAPE, **extra}
    assert plain_config(raw) is None
    config = load_config(_write(tmp_path, raw))
    assert not isinstance(config, ModelConfig) and config.model_type == raw["model_type"]


def test_an_engine_on_a_plain_config_never_imports_transformers(tiny_llama_dir):
    """(transformers' config classes pull in accelerate, sympy and torch.distributed: tens of MB per process)"""
    code = ("import sys; from engine.config import EngineConfig; from engine.core import EngineCore; "
            f"EngineCore(EngineConfig(model={str(tiny_llama_dir)!r}, cpu_kernels='eager', threads=1, "
            "threads_batch=1)); print(sorted(m for m in ('transformers', 'accelerate', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_config_that_is_not_json_is_named_in_the_error(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json is not a valid JSON file"):
        load_config(tmp_path)
