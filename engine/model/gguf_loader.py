"""Loads a GGUF file (llama.cpp's format) into our decoder, each weight in its file's format.

The gguf library parses the file once into a tensor index (gguf_index.py) that later loads memory-map the
weights from; transformers' GGUF support builds the config and the tokenizer (with its chat template) from the
file's metadata, once, into a small directory beside the cache (gguf_model_dir).
Weights: a format quant_formats decodes stays quantized (quant_matmul_cpu's tiles) when `native`, else it is
dequantized exactly into `dtype`; a format with no kernel here is dequantized once, with a warning naming it.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from engine.model import quant_formats
from engine.model.gguf_index import read_indexed, write_index
from engine.model.quant_formats import QuantRows

if TYPE_CHECKING:
    from engine.model.model_config import AnyConfig

logger = logging.getLogger("prefixgate.engine")

WEIGHTS_NAME = "model.gguf"  # the weights inside a GGUF model directory (the file itself or a link to it)
_FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# llama.cpp's tensor names -> ours ({i}: the layer); a name not here is an error, not a silent skip
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_ROPE_TABLES = ("rope_freqs.weight",)  # llama 3's rope scaling factors: the config already carries them

def hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name in _ROPE_TABLES:
        return None
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family decoder")


def gguf_model_dir(gguf_file: Path, cache_dir: Path) -> Path:
    """A model directory for a GGUF file: config.json, the tokenizer and the tensor index built from its
    metadata, and the file linked as model.gguf. Built once per file (keyed by its path, size and mtime)."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:12]
    model_dir = cache_dir / "gguf" / f"{gguf_file.stem}-{key}"
    if (model_dir / "config.json").is_file():
        return model_dir
    staged = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.partial")
    staged.mkdir(parents=True, exist_ok=True)
    write_metadata(gguf_file, staged)
    (staged / WEIGHTS_NAME).symlink_to(gguf_file)
    try:
        staged.rename(model_dir)
    except OSError:  # another process built it first
        if not (model_dir / "config.json").is_file():
            raise
    return model_dir


def write_metadata(gguf_file: Path, out_dir: Path) -> None:
    """config.json and the tokenizer (chat template inside tokenizer_config.json) from the file's metadata, and
    the file's tensor index."""
    logger.info("reading the config and tokenizer of %s", gguf_file.name)
    from transformers import AutoConfig, AutoTokenizer  # (a file's first use only: the directory keeps them)
    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    write_index(gguf_file, out_dir)


def is_gguf_dir(path: Path) -> bool:
    return (path / WEIGHTS_NAME).exists() and not any(path.glob("*.safetensors"))


def _head_order(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (its converter interleaves each head's two rotary
    halves for ggml's rope; ours rotates halves)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def read_tensors(gguf_file: Path, config: AnyConfig) -> dict[str, torch.Tensor | QuantRows]:
    """Every weight by our name: float tensors, QuantRows where a kernel runs the format (the rest
    dequantized to float32, with a warning). The tensors come through the index beside the file."""
    arch, tensors = read_indexed(gguf_file)
    state: dict[str, torch.Tensor | QuantRows] = {}
    fallback: dict[str, list[str]] = {}
    for tensor in tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        qtype, k = tensor.qtype, tensor.dims[0]
        if qtype in _FLOAT_TYPES:  # (bf16 comes as its bytes: the gguf library's dequantize reads them)
            value: torch.Tensor | QuantRows = torch.from_numpy(np.array(dequantize(tensor.data, qtype),
                                                                        dtype=np.float32))
        elif quant_formats.supported(qtype):
            value = quant_formats.decode(tensor.data, qtype, k)
        else:
            fallback.setdefault(qtype.name, []).append(tensor.name)
            value = torch.from_numpy(dequantize(tensor.data, qtype).reshape(-1, k).astype(np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            rows = value.shape[0]
            order = _head_order(rows, heads)
            value = quant_formats.take_rows(value, order) if isinstance(value, QuantRows) else value[order]
        state[name] = value
    for qtype_name, names in fallback.items():
        logger.warning("%s: %d tensors in %s, which no kernel here runs, dequantized to float32 at load (%s...)",
                       gguf_file.name, len(names), qtype_name, ", ".join(names[:3]))
    return state


def as_float(value: torch.Tensor | QuantRows) -> torch.Tensor:
    return torch.from_numpy(value.dequantize()) if isinstance(value, QuantRows) else value
