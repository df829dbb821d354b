"""Loads a model into our decoder: a Hugging Face directory (config.json + *.safetensors) or a GGUF file
(gguf_loader.py), with its weights as floats or quantized (quant_formats.py, quant_matmul_cpu.py).

The weights stream in: each is read, decoded (or dequantized, or quantized at load) and put in place, packed
into its tiles, before the next is read, so a load peaks at about the loaded model and one weight more."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType as QType
from safetensors import safe_open
from torch import nn

from engine import heap
from engine.model import huge_pages, quant_formats
from engine.model.gguf_index import read_indexed
from engine.model.gguf_loader import FLOAT_TYPES, WEIGHTS_NAME, as_float, gguf_model_dir, is_gguf_dir, iter_tensors
from engine.model.linear import Embedding, Linear, can_pack
from engine.model.llama import LlamaForCausalLM
from engine.model.quant_formats import QuantRows, StackedRows
from engine.paths import default_cache_dir

if TYPE_CHECKING:
    from engine.model.model_config import AnyConfig
    from engine.model.quant_matmul_cpu import QuantTiles

logger = logging.getLogger("prefixgate.engine")

Weight = torch.Tensor | QuantRows | StackedRows
# what `quantization` may be besides none: the file's own formats (GGUF), or a ggml format to quantize to at load
AT_LOAD = {"q8_0": quant_formats.QType.Q8_0, "q4_0": quant_formats.QType.Q4_0}
# what a Linear or an Embedding may stream its weight from: quantized tiles (and a fused Linear's last rows in a
# layout of their own), packed float tiles (Linear), the tied lm_head's packed tiles (Embedding)
TILE_ATTRIBUTES = ("quant", "quant_tail", "packed", "tiles")
# checkpoint projections that our decoder runs as one matmul: fused name -> the parts, in order
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_FUSED_OF = {part: fused for fused, parts in FUSED_PROJECTIONS.items() for part in parts}
_LAYER_PART = re.compile(r"(model\.layers\.\d+)\.(\w+\.\w+)\.(weight|bias)")
# formats whose scales and mins (d, m, -8 d) are all fp16 values
_FP16_SCALED = {QType.Q8_0, QType.Q4_0, QType.Q4_1}
# quant_matmul_cpu's scale kinds, fewest bytes first: each holds exactly whatever the ones before it hold
_KINDS = ("fp16", "super-blocks", "float32")
# the copy into huge pages trims the C heap after each this many bytes: a trim takes milliseconds, more on a large heap
_TRIM_EVERY = 128 << 20


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
    `none` (floats of the engine's dtype). A GGUF file of float weights alone (F32, F16, BF16) runs as an HF
    checkpoint of them would. ValueError for a combination that cannot run."""
    quantized = is_gguf_dir(path) and not _gguf_formats(path) <= set(FLOAT_TYPES)
    if quantization == "auto":
        return "gguf" if quantized and native_kernels and dtype_name == "auto" else "none"
    if quantization in AT_LOAD:
        if quantized:
            raise ValueError(f"quantization {quantization}: {(path / WEIGHTS_NAME).resolve()} is already quantized "
                             "(GGUF); leave it auto")
        if not native_kernels:
            raise ValueError(f"quantization {quantization} runs on the compiled CPU kernels only (device cpu, "
                             "cpu_kernels compiled)")
    return quantization


def load_model(path: Path, config: AnyConfig, dtype: torch.dtype, device: torch.device,
               pack: bool = True, weights: str = "none", integer_activations: bool = False) -> LlamaForCausalLM:
    """`pack`: add packed copies of the float linear weights for small batches where supported (CPU); see
    linear.py. `weights`: weights_format()'s answer; quantized weights are CPU-only. `integer_activations`:
    quantized weights run on integer dot products where the CPU and format allow (quant_dot_cpu.py)."""
    # first, so that an unsupported model type is refused before any weight is read
    with _no_weight_init():  # (not the meta device: its ops import torch._dynamo and Triton, 100 MB for nothing)
        model = LlamaForCausalLM(config)
    expected = dict(model.named_parameters())  # (a tied lm_head's weight is the embedding's: named once)
    kind = _scale_kind(path, weights)
    pack = pack and can_pack(dtype, device)
    quantized, on_floats = [], []
    for name, value in _weights(path, config, weights):
        if name not in expected:  # (a checkpoint's extra: a tied lm_head's copy, an old rotary table)
            continue
        del expected[name]
        if isinstance(value, (QuantRows, StackedRows)):
            quantized.append(name)
            tiles = _place_quantized(model, name, value, kind, integer_activations)
            if integer_activations and not tiles.integer:
                on_floats.append(name)
        else:
            _place_float(model, name, value, dtype, device, pack)
    if expected:
        raise ValueError(f"checkpoint {path} lacks weights: {list(expected)[:5]}")
    if on_floats:
        logger.warning("quantized_activations int8: %d of %d quantized weights stay on the float kernel (integer dot "
                       "products need x86 with AVX2, and groups of 32, or 16 for 6 bits): %s", len(on_floats),
                       len(quantized), ", ".join(on_floats[:3]) + (", ..." if len(on_floats) > 3 else ""))
    model = model.to(device=device, dtype=dtype).eval()  # (the buffers: every weight is in place already)
    if device.type == "cpu" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        logger.warning("bfloat16 on a CPU without the instructions oneDNN needs for it (avx512bw/vl/dq, "
                       "avx_ne_convert or AMX): prefill's plain bf16 matmuls are likely slower than float32")
    if device.type == "cpu":
        _tiles_into_huge_pages(model)
    return model


def _place_float(model: LlamaForCausalLM, name: str, value: torch.Tensor, dtype: torch.dtype,
                 device: torch.device, pack: bool) -> None:
    """A float tensor as its parameter, in `dtype` on `device`; a Linear's weight packed at once where `pack`
    (a tied embedding then reads its rows from the lm_head's tiles)."""
    module_name, leaf = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    tied = isinstance(module, Embedding) and model.config.tie_word_embeddings
    linear = model.lm_head if tied else module
    packs = pack and leaf == "weight" and isinstance(linear, Linear)
    tensor = value.to(device=device, dtype=dtype)
    if tensor is value and device.type == "cpu" and not packs:
        tensor = tensor.clone()  # memory of its own, not a view of the checkpoint's mapping
    setattr(module, leaf, nn.Parameter(tensor))
    if tied:
        model.lm_head.weight = module.weight
    if packs:
        linear.pack()
        if tied:
            module.tiles, module.weight = linear.packed, None


def _place_quantized(model: LlamaForCausalLM, name: str, rows: QuantRows | StackedRows, kind: str,
                     integer: bool) -> QuantTiles:
    """The weight as its module's tiles, scales and mins of `kind` (its float parameter gone); a tied embedding
    and lm_head share them. Stacked rows keep their two layouts (quant, quant_tail) where the head fills whole
    tiles and both run the same kernel, else they are packed as one."""
    from engine.model import quant_matmul_cpu  # (numba: only a quantized model needs it)
    module = model.get_submodule(name.removesuffix(".weight"))
    if not isinstance(module, (Embedding, Linear)):
        raise ValueError(f"{name}: a quantized weight where a float one belongs")
    runs = [rows.head, rows.tail] if isinstance(rows, StackedRows) else [rows]
    if _KINDS.index(quant_matmul_cpu.scale_kind(runs)) > _KINDS.index(kind):
        raise ValueError(f"{name}: scales that {kind} does not hold exactly")
    tiles = [quant_matmul_cpu.pack(run, integer, kind) for run in runs]
    if len(tiles) == 2 and (not isinstance(module, Linear) or runs[0].shape[0] % quant_matmul_cpu.TILE
                            or tiles[0].integer != tiles[1].integer):
        tiles = [quant_matmul_cpu.pack(quant_formats.concat(runs), integer, kind)]
    module.quant, module.weight = tiles[0], None
    if len(tiles) == 2:
        module.quant_tail = tiles[1]
    if isinstance(module, Embedding) and model.config.tie_word_embeddings:
        model.lm_head.quant, model.lm_head.weight = module.quant, None
    return module.quant


def _scale_kind(path: Path, weights: str) -> str:
    """The kind of scales every quantized weight of the model holds exactly (quant_matmul_cpu.scale_kind), known
    from the formats before any weight is decoded: fp16 for Q8_0, Q4_0 and Q4_1 alone (and quantized at load),
    super-block records where K-quants are among them (those hold fp16 scales as super-blocks of one group)."""
    if weights != "gguf":
        return "fp16"
    formats = {qtype for qtype in _gguf_formats(path) if quant_formats.supported(qtype)}
    return "fp16" if formats <= _FP16_SCALED else "super-blocks"


def _gguf_formats(path: Path) -> set[QType]:
    return {tensor.qtype for tensor in read_indexed(path / WEIGHTS_NAME)[1]}


def _weights(path: Path, config: AnyConfig, weights: str) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights by our names, projections fused, one at a time, in the form `weights` runs them."""
    if is_gguf_dir(path):
        stream = _fused(iter_tensors(path / WEIGHTS_NAME, config))
        if weights == "gguf":
            return stream
        stream = ((name, as_float(value)) for name, value in stream)
    else:
        stream = _fused(_safetensors_weights(path))
    return _quantized_at_load(stream, config.tie_word_embeddings, weights) if weights in AT_LOAD else stream


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name)


def _fused(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """The weights with each layer's q/k/v and gate/up (weights and biases) concatenated into the fused ones,
    each given once its last part has come: quantized parts stacked as integers (quant_formats.concat), or all as
    floats when any part is float. A part whose siblings never come is dropped (the fused weight is then missing)."""
    waiting: dict[str, Weight] = {}
    for name, value in weights:
        match = _LAYER_PART.fullmatch(name)
        fused = _FUSED_OF.get(match[2]) if match else None
        if fused is None:
            yield name, value
            continue
        waiting[name] = value
        names = [f"{match[1]}.{part}.{match[3]}" for part in FUSED_PROJECTIONS[fused]]
        if all(part in waiting for part in names):  # (the parts go with the call: none is left behind here)
            yield f"{match[1]}.{fused}.{match[3]}", _concat(fused, [waiting.pop(part) for part in names])


def _concat(fused: str, values: list[Weight]) -> Weight:
    if all(isinstance(value, QuantRows) for value in values):
        # q/k/v of two formats keep two layouts; the compiled step runs no other tail (gate and up of two formats,
        # rare, are widened to one)
        return quant_formats.stack(values) if fused == "self_attn.qkv_proj" else quant_formats.concat(values)
    return torch.cat([as_float(value) for value in values])


def _quantized_at_load(weights: Iterable[tuple[str, torch.Tensor]], tied: bool,
                       at_load: str) -> Iterator[tuple[str, Weight]]:
    """The matmuls' weights quantized (at_load_format); a tied embedding is the lm_head's, an untied one stays
    float. A weight whose rows are not whole blocks stays float, as llama-quantize leaves it, with one warning."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    kept = []
    for name, value in weights:
        if name.endswith("proj.weight") or name == head:
            qtype = at_load_format(name, at_load)
            if value.shape[1] % quant_formats.block_size(qtype):
                kept.append(name)
            else:
                value = quant_formats.quantize(value.float().numpy(), qtype)
        yield name, value
    if kept:
        logger.warning("quantization %s: %d weights whose rows are not whole blocks of %d stay in float: %s",
                       at_load, len(kept), quant_formats.block_size(AT_LOAD[at_load]),
                       ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else ""))


def at_load_format(name: str, weights: str) -> quant_formats.QType:
    """The format `--quantization` gives a weight. The lm_head (or the tied embedding) stays 8-bit beside 4-bit
    layers, as llama-quantize keeps it: a 4-bit head loses the most accuracy for the bytes it saves
    (docs/quantization.md#perplexity-against-llamacpp)."""
    is_head = name in ("lm_head.weight", "model.embed_tokens.weight")
    return quant_formats.QType.Q8_0 if is_head else AT_LOAD[weights]


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
    heap.trim()  # (first the loading's freed temporaries)
    arena = huge_pages.Arena([t for o in originals.values()
                              for t in ((o,) if isinstance(o, torch.Tensor) else (o.data, o.scales, o.mins))])
    del originals  # (from here the modules alone hold the originals: each goes as its module's is replaced)
    copies: dict[int, object] = {}  # id of an original -> its copy
    moved = 0  # bytes copied since the heap was last trimmed

    def place(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        moved += tensor.nbytes
        return arena.place(tensor)

    def copy_of(original):
        if id(original) not in copies:
            copies[id(original)] = place(original) if isinstance(original, torch.Tensor) else \
                dataclasses.replace(original, data=place(original.data), scales=place(original.scales),
                                    mins=place(original.mins))
        return copies[id(original)]

    for module in modules:
        for name in TILE_ATTRIBUTES:
            if getattr(module, name, None) is not None:
                setattr(module, name, copy_of(getattr(module, name)))
        if moved >= _TRIM_EVERY:  # the originals' pages back to the OS as they go: glibc's heap keeps them
            heap.trim()
            moved = 0


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
