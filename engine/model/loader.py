"""Loads a Hugging Face model directory (config.json + *.safetensors) into our decoder."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from engine.model.linear import can_pack, pack_linears
from engine.model.llama import LlamaForCausalLM

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
    with _no_weight_init():  # (not the meta device: its ops import torch._dynamo and Triton, 100 MB for nothing)
        model = LlamaForCausalLM(config)
    state = {}
    for file in files:
        state.update(load_file(file))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fuse_projections(state, config.num_hidden_layers)
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}")
    model = model.to(device=device, dtype=dtype).eval()
    if pack and can_pack(dtype, device):
        pack_linears(model)
    if device.type == "cpu":  # what was not packed gets memory of its own: the checkpoint's mapping goes with `state`
        for param in model.parameters():
            param.data = param.data.clone()
    if device.type == "cpu" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        logger.warning("bfloat16 on a CPU without the instructions oneDNN needs for it (avx512bw/vl/dq, "
                       "avx_ne_convert or AMX): prefill's plain bf16 matmuls are likely slower than float32")
    return model


@contextlib.contextmanager
def _no_weight_init():
    """Modules built to be loaded skip their random init: their parameters stay uninitialized (untouched pages)
    until the checkpoint's tensors replace them."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> None:
    """Concatenates each layer's q/k/v and gate/up weights (and biases) into the fused ones, in place."""
    for i in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([state.pop(name) for name in names])
