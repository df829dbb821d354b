"""A model directory's config.json as the engine reads it: for Llama, Qwen2 and Qwen3 with plain rotary
embeddings, straight from the JSON with transformers' defaults for the keys it leaves out; anything else
(another rope type, another architecture) through transformers' AutoConfig.

Why not always AutoConfig: importing a transformers config class pulls in accelerate, sympy and
torch.distributed (transformers 5's import graph), 67-86 MB of the engine process's memory for its whole life
and seconds of start-up in every engine process, for a dozen numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    AnyConfig = ModelConfig | PretrainedConfig  # what load_config gives: the same attribute names

# transformers' defaults (LlamaConfig, Qwen2Config, Qwen3Config) for the keys the engine reads that a config.json
# may leave out (Qwen's num_key_value_heads too, 32 where it is missing); head_dim and num_key_value_heads None:
# hidden_size // num_attention_heads and num_attention_heads
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None, "eos_token_id": 2,
              "bos_token_id": 1, "attention_bias": False, "mlp_bias": False},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None, "eos_token_id": None,
              "bos_token_id": None, "attention_bias": False, "mlp_bias": False},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128, "eos_token_id": None,
              "bos_token_id": None, "attention_bias": False, "mlp_bias": False},
}
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a transformers config that the engine reads, with the same names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    rope_freq_factors: tuple[float, ...] | None = None  # a GGUF's per-frequency divisors (llama 3's rope scaling)


def plain_config(raw: dict[str, Any]) -> ModelConfig | None:
    """The config from config.json's contents, or None where transformers must read it."""
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS or any(key not in raw for key in _REQUIRED):
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None  # yarn, llama3, linear, dynamic...: transformers' own frequencies
    values = {**_COMMON, **_DEFAULTS[model_type], **raw}
    heads = values["num_attention_heads"]
    return ModelConfig(
        model_type=model_type,
        **{name: values[name] for name in _REQUIRED},
        num_key_value_heads=values.get("num_key_value_heads") or heads,
        head_dim=values["head_dim"] or values["hidden_size"] // heads,
        rms_norm_eps=values["rms_norm_eps"],
        tie_word_embeddings=values["tie_word_embeddings"],
        attention_bias=values["attention_bias"],
        mlp_bias=values["mlp_bias"],
        max_position_embeddings=values["max_position_embeddings"],
        eos_token_id=values["eos_token_id"],
        bos_token_id=values["bos_token_id"],
        rope_parameters={"rope_theta": rope.get("rope_theta", values["rope_theta"]), "rope_type": "default"},
        rope_freq_factors=tuple(values["rope_freq_factors"]) if values.get("rope_freq_factors") else None,
    )


def load_config(path: Path) -> AnyConfig:
    """ModelConfig where it can, else transformers' PretrainedConfig (the same attribute names)."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError as exc:  # (a JSONDecodeError, or text that is not UTF-8)
        raise ValueError(f"{file} is not a valid JSON file: {exc}") from None
    config = plain_config(raw) if isinstance(raw, dict) else None
    if config is not None:
        return config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, local_files_only=True)
