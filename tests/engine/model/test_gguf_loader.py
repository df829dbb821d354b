"""GGUF float tensors load as the checkpoint's weights: F32 exactly, F16 and BF16 as the weights rounded to
them, llama.cpp's names and q/k row permutation undone."""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file

from engine.model.gguf_loader import read_tensors
from engine.model.model_config import load_config
from tests.support.tiny_gguf import gguf_name, write_gguf_model

# llama.cpp's name part -> the file's format and the torch dtype that rounds the same way; the rest F32
ROUNDED = {"ffn_up.": (QType.BF16, torch.bfloat16), "attn_q.": (QType.F16, torch.float16)}


def _rounding(gguf: str) -> tuple[QType, torch.dtype]:
    return next((pair for part, pair in ROUNDED.items() if part in gguf), (QType.F32, torch.float32))


def test_float_tensors_are_the_checkpoints_weights_in_their_files_precision(tiny_llama_dir, tmp_path):
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: _rounding(name)[0])
    state = read_tensors(gguf_dir / "model.gguf", load_config(gguf_dir))
    reference = load_file(tiny_llama_dir / "model.safetensors")
    reference.pop("lm_head.weight", None)  # tied: the embedding
    assert sorted(state) == sorted(reference)
    for name, weight in reference.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], weight.to(_rounding(gguf_name(name))[1]).float()), name
