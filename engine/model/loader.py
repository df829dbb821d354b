"""Loads a model into our decoder: a Hugging Face directory (config.json + *.safetensors) or a GGUF file
(gguf_loader.py), with its weights as floats or quantized (quant_formats.py, quant_matmul_cpu.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from engine.model import huge_pages, quant_formats
from engine.model.gguf_loader import WEIGHTS_NAME, as_float, gguf_model_dir, is_gguf_dir, read_tensors
from engine.model.linear import Embedding, Linear, can_pack, pack_linears
from engine.model.llama import LlamaForCausalLM
from engine.model.quant_formats import QuantRows
from engine.paths import default_cache_dir

if TYPE_CHECKING:
    from engine.model.model_config import AnyConfig

logger = logging.getLogger("prefixgate.engine")

# what `quantization` may be besides none: the file's own formats (GGUF), or a ggml format to quantize to at load
AT_LOAD = {"q8_0": quant_formats.QType.Q8_0, "q4_0": quant_formats.QType.Q4_0}
# what a Linear or an Embedding may stream its weight from: quantized tiles, packed float tiles (Linear), the tied
# lm_head's packed tiles (Embedding)
TILE_ATTRIBUTES = ("quant", "packed", "tiles")
# checkpoint projections that our decoder runs as one matmul: fused name -> the parts, in order
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def resolve_model_path(model: str, cache_dir: str | None = None) -> Path:
    """`default` (or empty) means the built-in default model, fetched on first use; a `.gguf` file gets a
    model directory of its metadata (gguf_loader.gguf_model_dir)."""
    if model in ("", "default"):
        from engine.model.default_model import ensure_default_model
        return ensure_default_model(Path(cache_dir) if cache_dir else None)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_dir(path, Path(cache_dir) if cache_dir else default_cache_dir())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is not a model directory (no config.json) nor a .gguf file")
    return path


def weights_format(path: Path, quantization: str, dtype_name: str, native_kernels: bool) -> str:
    """How the weights run: `gguf` (a GGUF file's own formats), `q8_0` / `q4_0` (quantized at load) or
    `none` (floats of the engine's dtype). ValueError for a combination that cannot run."""
    gguf = is_gguf_dir(path)
    if quantization == "auto":
        return "gguf" if gguf and native_kernels and dtype_name == "auto" else "none"
    if quantization in AT_LOAD:
        if gguf:
            raise ValueError(f"quantization {quantization}: {path} is already quantized (GGUF); leave it auto")
        if not native_kernels:
            raise ValueError(f"quantization {quantization} runs on the compiled CPU kernels only (device cpu, "
                             "cpu_kernels compiled)")
    return quantization


def load_model(path: Path, config: AnyConfig, dtype: torch.dtype, device: torch.device,
               pack: bool = True, weights: str = "none", integer_activations: bool = False) -> LlamaForCausalLM:
    """`pack`: add packed copies of the float linear weights for small batches where supported (CPU); see
    linear.py. `weights`: weights_format()'s answer; quantized weights are CPU-only. `integer_activations`:
    quantized weights run on integer dot products where the CPU and format allow (quant_dot_cpu.py)."""
    state = _read_state(path, config, weights)
    quantized = {name: value for name, value in state.items() if isinstance(value, QuantRows)}
    floats = {name: value for name, value in state.items() if not isinstance(value, QuantRows)}
    with _no_weight_init():  # (not the meta device: its ops import torch._dynamo and Triton, 100 MB for nothing)
        model = LlamaForCausalLM(config)
    missing = model.load_state_dict(floats, strict=False, assign=True).missing_keys
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [name for name in missing if name != "lm_head.weight"]
    _set_quantized(model, quantized, config.tie_word_embeddings, integer_activations)
    missing = [name for name in missing if name not in quantized]
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
    del state, quantized, floats  # (the decoded rows, before the tiles are copied once more)
    if device.type == "cpu":
        _tiles_into_huge_pages(model)
    return model


def _tiles_into_huge_pages(model: LlamaForCausalLM) -> None:
    """The tiles every decode step streams (quantized, or the packed float ones) moved into one mapping of huge
    pages (huge_pages.py), one module at a time so that each original goes as its copy is placed; a tied
    embedding keeps sharing the lm_head's."""
    modules = [m for m in model.modules() if isinstance(m, (Embedding, Linear))]
    # each module's QuantTiles and packed tiles, once: a tied pair holds the same ones
    originals = {id(o): o for m in modules for o in (getattr(m, name, None) for name in TILE_ATTRIBUTES)
                 if o is not None}
    if not originals:
        return
    arena = huge_pages.Arena([t for o in originals.values()
                              for t in ((o,) if isinstance(o, torch.Tensor) else (o.data, o.scales, o.mins))])
    del originals  # (from here the modules alone hold the originals: each goes as its module's is replaced)
    copies: dict[int, object] = {}  # id of an original -> its copy

    def copy_of(original):
        if id(original) not in copies:
            copies[id(original)] = arena.place(original) if isinstance(original, torch.Tensor) else \
                dataclasses.replace(original, data=arena.place(original.data), scales=arena.place(original.scales),
                                    mins=arena.place(original.mins))
        return copies[id(original)]

    for module in modules:
        for name in TILE_ATTRIBUTES:
            if getattr(module, name, None) is not None:
                setattr(module, name, copy_of(getattr(module, name)))


def _read_state(path: Path, config: AnyConfig, weights: str) -> dict[str, torch.Tensor | QuantRows]:
    if is_gguf_dir(path):
        state = read_tensors(path / WEIGHTS_NAME, config)
        fuse_projections(state, config.num_hidden_layers)
        return state if weights == "gguf" else {name: as_float(value) for name, value in state.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state = {}
    for file in files:
        state.update(load_file(file))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fuse_projections(state, config.num_hidden_layers)
    if weights in AT_LOAD:
        # the matmuls' weights; a tied embedding is the lm_head's, an untied one stays float
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        for name in [n for n in state if n.endswith("proj.weight") or n == head]:
            state[name] = quant_formats.quantize(state[name].float().numpy(), at_load_format(name, weights))
    return state


def at_load_format(name: str, weights: str) -> quant_formats.QType:
    """The format `--quantization` gives a weight. The lm_head (or the tied embedding) stays 8-bit beside 4-bit
    layers, as llama-quantize keeps it: a 4-bit head loses the most accuracy for the bytes it saves
    (docs/quantization.md#perplexity-against-llamacpp)."""
    is_head = name in ("lm_head.weight", "model.embed_tokens.weight")
    return quant_formats.QType.Q8_0 if is_head else AT_LOAD[weights]


def _set_quantized(model: LlamaForCausalLM, quantized: dict[str, QuantRows], tied: bool, integer: bool) -> None:
    """Each quantized weight as its module's tiles (its float parameter gone); a tied embedding and lm_head
    share theirs."""
    if not quantized:
        return
    from engine.model import quant_matmul_cpu  # (numba: only a quantized model needs it)
    # the fewest bytes of scales and mins that hold every weight's exactly (one kind a model)
    kind = quant_matmul_cpu.scale_kind(list(quantized.values()))
    on_floats = []
    for name, rows in quantized.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        if not isinstance(module, (Embedding, Linear)):
            raise ValueError(f"{name}: a quantized weight where a float one belongs")
        module.quant, module.weight = quant_matmul_cpu.pack(rows, integer, kind), None
        if integer and not module.quant.integer:
            on_floats.append(name)
        if isinstance(module, Embedding) and tied:
            model.lm_head.quant, model.lm_head.weight = module.quant, None
    if on_floats:
        logger.warning("quantized_activations int8: %d of %d quantized weights stay on the float kernel (integer dot "
                       "products need x86 with AVX2, and groups of 32, or 16 for 6 bits): %s", len(on_floats),
                       len(quantized), ", ".join(on_floats[:3]) + (", ..." if len(on_floats) > 3 else ""))


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


def fuse_projections(state: dict[str, torch.Tensor | QuantRows], num_layers: int) -> None:
    """Concatenates each layer's q/k/v and gate/up weights (and biases) into the fused ones, in place:
    quantized parts stacked as integers (quant_formats.concat), or all as floats when any part is float."""
    for i in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    values = [state.pop(name) for name in names]
                    state[f"model.layers.{i}.{fused}.{kind}"] = (
                        quant_formats.concat(values) if all(isinstance(v, QuantRows) for v in values)
                        else torch.cat([as_float(v) for v in values]))
