"""Tiny GGUF models for the tests: a tiny Hugging Face model's weights written as llama.cpp's converter
writes them (its tensor names, llama's q/k rows permuted for ggml's rope), each weight in a chosen format,
beside the HF config and tokenizer (a GGUF model directory, as gguf_loader.gguf_model_dir lays out)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from engine.model.gguf_loader import GLOBAL_NAMES, LAYER_NAMES, WEIGHTS_NAME
from tests.support.k_quants import quantize_q4_k, quantize_q6_k

_TO_GGUF = {ours: theirs for theirs, ours in GLOBAL_NAMES.items()}
_QUANTIZERS = {QType.Q4_K: quantize_q4_k, QType.Q6_K: quantize_q6_k}  # the gguf library's quantize has no K-quants


def gguf_name(name: str) -> str:
    if name in _TO_GGUF:
        return _TO_GGUF[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{next(theirs for theirs, ours in LAYER_NAMES.items() if ours == rest)}"


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation: each head's two rotary halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf_model(model_dir: Path, out_dir: Path, format_of: Callable[[str], QType]) -> Path:
    """out_dir with model.gguf (2-D weights in format_of(their GGUF name), 1-D ones in F32) and every file of
    model_dir but its safetensors."""
    config = json.loads((model_dir / "config.json").read_text())
    out_dir.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    writer = GGUFWriter(out_dir / WEIGHTS_NAME, config["model_type"])
    for name, value in sorted(load_file(model_dir / "model.safetensors").items()):
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        value = value.astype(np.float32)
        if config["model_type"] == "llama" and (".q_proj." in name or ".k_proj." in name):
            value = _permute(value, config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"])
        target = gguf_name(name)
        qtype = format_of(target) if value.ndim == 2 else QType.F32
        if qtype == QType.F32:
            writer.add_tensor(target, value)
        else:
            writer.add_tensor(target, _QUANTIZERS.get(qtype, lambda v: quantize(v, qtype))(value), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_dir


def write_gguf_file(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None,
                    architecture: str = "llama") -> Path:
    """A bare GGUF file: `tensors` as they are (float32 arrays) and `metadata` (str, float: float32, int: uint32)."""
    writer = GGUFWriter(path, architecture)
    for key, value in (metadata or {}).items():
        (writer.add_string if isinstance(value, str) else
         writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
