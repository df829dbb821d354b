"""Plain `transformers`, the baseline the benchmarks run beside the engine, on the engine's own weights: a checkpoint
directory as it is, and a GGUF model directory (the default model's Q4_1 file, `--model FILE.gguf`) dequantized to
float32 by the engine's reader (exact for the formats it decodes), since transformers' own GGUF loading needs
`accelerate`."""
from __future__ import annotations

import torch

from engine.model.gguf_loader import WEIGHTS_NAME, as_float, is_gguf_dir, read_tensors
from engine.model.loader import resolve_model_path


def hf_model(model: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' causal LM of `model` (a directory, a .gguf file or "default"), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = resolve_model_path(model)
    if not is_gguf_dir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: as_float(value).to(dtype) for name, value in read_tensors(path / WEIGHTS_NAME, config).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise ValueError(f"{path}: weights not those of {type(hf).__name__}: missing {missing}, unexpected "
                         f"{unexpected}")
    hf.tie_weights()
    return hf.eval()
