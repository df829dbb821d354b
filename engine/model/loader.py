"""Loads a Hugging Face model directory (config.json + *.safetensors) into our decoder."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from engine.model.linear import can_pack, pack_linears
from engine.model.llama import LlamaForCausalLM, head_dim

logger = logging.getLogger("prefixgate.engine")

# checkpoint projections that our decoder runs as one matmul: fused name -> the parts, in order
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def resolve_model_path(model: str, cache_dir: str | None = None) -> Path:
    """`default` (or empty) means the built-in default model, converted on first use."""
    if model in ("", "default"):
        from engine.model.default_model import ensure_default_model
        return ensure_default_model(Path(cache_dir) if cache_dir else None)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is not a model directory (no config.json)")
    return path


def load_config(path: Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_model(path: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               pack: bool = True) -> LlamaForCausalLM:
    """`pack`: add packed copies of the linear weights for small batches where supported (CPU); see linear.py."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {}
    for file in files:
        state.update(load_file(file))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fuse_projections(state, config.num_hidden_layers)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}")
    # buffers (rotary frequencies) are not in the checkpoint: build them for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config, head_dim(config))
    model = model.to(device=device, dtype=dtype).eval()
    if pack and can_pack(dtype, device):
        pack_linears(model)
    if device.type == "cpu" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        logger.warning("bfloat16 on a CPU without the instructions oneDNN needs for it (avx512bw/vl/dq, "
                       "avx_ne_convert or AMX): prefill's plain bf16 matmuls are likely slower than float32")
    return model


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> None:
    """Concatenates each layer's q/k/v and gate/up weights (and biases) into the fused ones, in place."""
    for i in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([state.pop(name) for name in names])
