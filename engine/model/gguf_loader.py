"""Loads a GGUF file (llama.cpp's format) into our decoder, each weight in its file's format.

The gguf library parses the file once into a tensor index (gguf_index.py) that later loads memory-map the
weights from; transformers' GGUF support builds the config and the tokenizer (with its chat template) from the
file's metadata, once, into a small directory beside the cache (gguf_model_dir).
Weights: a format quant_formats decodes stays quantized (quant_matmul_cpu's tiles) when `native`, else it is
dequantized exactly into `dtype`; a format with no kernel here is dequantized once, with a warning naming it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from engine.model import quant_formats
from engine.model.gguf_index import END_TOKEN_KEYS, float_tensor, read_indexed, write_index
from engine.model.quant_formats import QuantRows, StackedRows

if TYPE_CHECKING:
    from engine.model.model_config import AnyConfig

logger = logging.getLogger("prefixgate.engine")

GENERATION_CONFIG = "generation_config.json"
WEIGHTS_NAME = "model.gguf"  # the weights inside a GGUF model directory (the file itself or a link to it)
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
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
ROPE_FACTORS = "rope_freqs.weight"  # llama 3's rope scaling, as llama.cpp's converter writes it: config.json takes it
# the texts llama.cpp's vocabulary also ends a generation on, where a file's tokenizer has them (a chat template's
# end of turn, which many files do not name as their EOS)
END_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
             "<|end_of_text|>")
_DIR_VERSION = 2  # in the model directory's key: a directory an older build laid out is built again

def hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name == ROPE_FACTORS:
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
    key = hashlib.sha256(f"{gguf_file} {stat.st_size} {stat.st_mtime_ns} {_DIR_VERSION}".encode()).hexdigest()[:12]
    model_dir = cache_dir / "gguf" / f"{gguf_file.stem}-{key}"
    if (model_dir / "config.json").is_file():
        return model_dir
    staged = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.partial")
    staged.mkdir(parents=True, exist_ok=True)
    try:
        write_metadata(gguf_file, staged)
    except BaseException:  # (a file we cannot read: no half-built directory left behind at each try)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    (staged / WEIGHTS_NAME).symlink_to(gguf_file)
    try:
        staged.rename(model_dir)
    except OSError:  # another process built it first
        if not (model_dir / "config.json").is_file():
            raise
    return model_dir


def write_metadata(gguf_file: Path, out_dir: Path) -> None:
    """The file's tensor index, config.json and the tokenizer (chat template inside tokenizer_config.json) from
    its metadata, with what transformers leaves out of them: the file's rope scaling, and generation_config.json's
    EOS ids, every token a turn may end with."""
    index = write_index(gguf_file, out_dir)  # (first: a split file is refused before anything else is read)
    logger.info("reading the config and tokenizer of %s", gguf_file.name)
    from transformers import AutoConfig, AutoTokenizer  # (a file's first use only: the directory keeps them)
    try:
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as exc:  # transformers' GGUF support raises KeyErrors and the like for what it cannot read
        raise ValueError(f"{gguf_file.name}: transformers cannot read its {index['architecture']} config or its "
                         f"tokenizer ({type(exc).__name__}: {exc})") from exc
    _set_rope_scaling(config, gguf_file, index)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    write_end_tokens(out_dir, index, tokenizer.get_vocab())


def write_end_tokens(model_dir: Path, index: dict, vocab: dict[str, int]) -> None:
    """generation_config.json's eos_token_id: the file's EOS, end-of-turn and end-of-message tokens and the end
    texts its vocabulary has (llama.cpp stops on each)."""
    ends = {index["metadata"][key] for key in END_TOKEN_KEYS if key in index["metadata"]}
    ends.update(vocab[text] for text in END_TEXTS if text in vocab)
    if ends:
        update_generation_config(model_dir, {"eos_token_id": sorted(ends)})


def has_end_tokens(model_dir: Path) -> bool:
    return "eos_token_id" in generation_config(model_dir)


def generation_config(model_dir: Path) -> dict:
    """The directory's generation_config.json ({} where it has none)."""
    path = model_dir / GENERATION_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def update_generation_config(model_dir: Path, fields: dict) -> None:
    """`fields` written into generation_config.json over what it holds (atomically)."""
    path = model_dir / GENERATION_CONFIG
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**generation_config(model_dir), **fields}, indent=2) + "\n")
    tmp.replace(path)


def _set_rope_scaling(config, gguf_file: Path, index: dict) -> None:
    """transformers reads no rope scaling from a llama or qwen2 GGUF: llama 3's per-frequency factors (a
    tensor), or a linear or YaRN scaling named in the metadata."""
    factors = float_tensor(gguf_file, index, ROPE_FACTORS)
    if factors is not None:
        config.rope_freq_factors = factors.tolist()  # (engine.model.llama divides the frequencies by them)
    metadata, arch = index["metadata"], index["architecture"]
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = int(
                metadata.get(f"{arch}.rope.scaling.original_context_length", config.max_position_embeddings))
        config.rope_parameters = {**(config.rope_parameters or {}), **scaling}
    elif kind != "none":
        raise ValueError(f"{gguf_file.name}: rope scaling {kind!r} is not supported (linear and yarn are)")


def is_gguf_dir(path: Path) -> bool:
    return (path / WEIGHTS_NAME).exists() and not any(path.glob("*.safetensors"))


def _head_order(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (its converter interleaves each head's two rotary
    halves for ggml's rope; ours rotates halves)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def iter_tensors(gguf_file: Path, config: AnyConfig) -> Iterator[tuple[str, torch.Tensor | QuantRows]]:
    """Every weight by our name, one at a time (a load holds one decoded weight, not all): float tensors, QuantRows
    where a kernel runs the format (the rest dequantized to float32, with a warning once all have come). The
    tensors come through the index beside the file."""
    arch, tensors = read_indexed(gguf_file)
    fallback: dict[str, list[str]] = {}
    for tensor in tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        qtype, k = tensor.qtype, tensor.dims[0]
        if qtype in FLOAT_TYPES:  # (bf16 comes as its bytes: the gguf library's dequantize reads them)
            value: torch.Tensor | QuantRows = torch.from_numpy(np.array(dequantize(tensor.data, qtype),
                                                                        dtype=np.float32))
        elif quant_formats.supported(qtype):
            value = quant_formats.decode(tensor.data, qtype, k)
        else:
            fallback.setdefault(qtype.name, []).append(tensor.name)
            value = torch.from_numpy(dequantize(tensor.data, qtype).reshape(-1, k).astype(np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            order = _head_order(value.shape[0], heads)
            value = quant_formats.take_rows(value, order) if isinstance(value, QuantRows) else value[order]
        yield name, value
    for qtype_name, names in fallback.items():
        logger.warning("%s: %d tensors in %s, which no kernel here runs, dequantized to float32 at load (%s...)",
                       gguf_file.name, len(names), qtype_name, ", ".join(names[:3]))


def read_tensors(gguf_file: Path, config: AnyConfig) -> dict[str, torch.Tensor | QuantRows]:
    """iter_tensors' weights all at once (a reference model's, a test's)."""
    return dict(iter_tensors(gguf_file, config))


def as_float(value: torch.Tensor | QuantRows | StackedRows) -> torch.Tensor:
    return torch.from_numpy(value.dequantize()) if isinstance(value, (QuantRows, StackedRows)) else value
