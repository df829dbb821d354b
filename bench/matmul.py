"""The weight matmuls of one decode step, by kernel: `python -m bench.matmul`.

A decode step multiplies its few rows by every weight once (per layer the fused qkv, o, gate/up and down
projections, then the lm_head): 121 matmuls for SmolLM2-135M. This times them alone, with random weights
of the model's shapes, for each kernel the engine has had: the packed-weight microkernel
(engine/model/packed_matmul_cpu.py, what the engine uses), oneDNN over its own packed layout (what it used
before), `F.linear` over the row-major weight (what prefill uses) and, with --quantized, the quantized
kernels (engine/model/quant_matmul_cpu.py: float arithmetic; quant_dot_cpu.py: int8 activations and integer
dot products, x86) over the same weights in ggml formats (the K-quants, which the gguf library cannot quantize
to: random blocks of the format, read by the loader's decoder), and beside the float kernel the way larger
steps go (`prefill_linear`: each weight dequantized into a scratch, then a float GEMM), so that `--rows
33,48,64,96,128` shows where one overtakes the other (quant_matmul_cpu.KERNEL_ROWS). The kernels take turns within
each repeat, so that load from other processes shows in all alike; times are medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType as QType

from engine.model import packed_matmul_cpu, quant_dot_cpu, quant_formats, quant_matmul_cpu
from engine.model.bfloat16_bits import numpy_view
from engine.model.cpu_threads import use_threads
from engine.model.llama import head_dim
from engine.model.loader import resolve_model_path
from engine.model.model_config import load_config


def step_shapes(config) -> list[tuple[int, int]]:
    """(out_features, in_features) of every weight matmul of a decode step."""
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim(config)
    layer = [(qkv, config.hidden_size), (config.hidden_size, config.num_attention_heads * head_dim(config)),
             (2 * config.intermediate_size, config.hidden_size), (config.hidden_size, config.intermediate_size)]
    return layer * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]


def run(model: str = "default", rows=(1, 8, 16, 32), repeats: int = 15, dtype: str = "float32", log=print,
        quantized: tuple[str, ...] = ()) -> dict:
    torch_dtype = getattr(torch, dtype)
    shapes = step_shapes(load_config(resolve_model_path(model)))
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(shape, generator=gen) * 0.02).to(torch_dtype) for shape in shapes]
    packed = [numpy_view(packed_matmul_cpu.pack(w)) for w in weights]
    onednn = None
    if torch.backends.mkldnn.is_available():
        try:
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        except RuntimeError:  # bf16 without the instructions oneDNN needs for it
            onednn = None
    no_bias = np.zeros(0, np.float32)
    threads = use_threads()
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    tiles = {}
    for name in quantized:  # each format on both kernels: float arithmetic and integer dot products (x86)
        rows_of = [_in_format(w.float().numpy(), QType[name.upper()], gen) for w in weights]
        kind = quant_matmul_cpu.scale_kind(rows_of)  # as the loader packs them (fp16: the reference quantizer's)
        tiles[f"{name} float"] = [quant_matmul_cpu.pack(r, scales=kind) for r in rows_of]
        if quant_dot_cpu.X86:
            tiles[f"{name} int8"] = [quant_matmul_cpu.pack(r, integer=True, scales=kind) for r in rows_of]
    bytes_read = {f"{name} (engine)": sum(t.nbytes() for t in ts) for name, ts in tiles.items()}
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=gen).to(torch_dtype) for k in {k for _, k in shapes}}
        floats = {k: x.float().numpy() for k, x in inputs.items()}
        outs = [np.empty((m, n), np.float32) for n, _ in shapes]

        def ours():
            for (_, k), w, out in zip(shapes, packed, outs):
                packed_matmul_cpu.matmul(floats[k], w, no_bias, out, False, threads)

        def plain():
            for (_, k), w in zip(shapes, weights):
                F.linear(inputs[k], w)

        kernels = {"packed (engine)": ours, "F.linear": plain}
        for name, weight_tiles in tiles.items():
            def quant(weight_tiles=weight_tiles):
                for (_, k), w, out in zip(shapes, weight_tiles, outs):
                    quant_matmul_cpu.quant_matmul(floats[k], *w.arrays(), no_bias, out, False, threads)
            kernels[f"{name} (engine)"] = quant
            if name.endswith("float"):
                def dequantized(weight_tiles=weight_tiles):
                    for (_, k), w in zip(shapes, weight_tiles):
                        quant_matmul_cpu.prefill_linear(torch.from_numpy(floats[k]), w, None)
                kernels[f"{name} dequantized + GEMM"] = dequantized
                bytes_read[f"{name} dequantized + GEMM"] = bytes_read[f"{name} (engine)"]
        if onednn is not None:
            def dnnl():
                for (_, k), w in zip(shapes, onednn):
                    torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
            kernels["oneDNN packed"] = dnnl
        times = {name: [] for name in kernels}
        for _ in range(repeats + 1):  # the first round warms up (compiles, allocates)
            for name, kernel in kernels.items():
                start = time.perf_counter()
                kernel()
                times[name].append(time.perf_counter() - start)
        row = {"rows": m, "matmuls": len(shapes), "weight_mb": weight_bytes / 1e6, "dtype": dtype,
               "ms": {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()},
               "bytes_mb": {name: bytes_read.get(name, weight_bytes) / 1e6 for name in kernels}}
        log(f"{len(shapes)} matmuls, {m:>2} rows ({dtype}): " + ", ".join(
            f"{name} {ms:.1f} ms ({bytes_read.get(name, weight_bytes) / ms / 1e6:.0f} GB/s)"
            for name, ms in row["ms"].items()))
        results.append(row)
    return {"rows": results, "threads": torch.get_num_threads()}


# where each K-quant block keeps its fp16 factors (Q4_K: d, dmin first; Q6_K: d last); its other bytes are any
K_QUANT_FACTORS = {QType.Q4_K: (0, 2), QType.Q6_K: (208,)}


def _in_format(weight: np.ndarray, qtype: QType, gen: torch.Generator) -> quant_formats.QuantRows:
    """The weight in a ggml format by the gguf library's reference quantizer, or for a K-quant, which it cannot
    make, random blocks of the weight's shape (small fp16 factors, any sub-scales and integers) decoded as a file's
    are: the kernels' work depends on the format and the shape, not the values."""
    if qtype not in K_QUANT_FACTORS:
        return quant_formats.quantize(weight, qtype)
    per_block, block_bytes, _ = quant_formats.FORMATS[qtype]
    n, k = weight.shape
    blocks = torch.randint(0, 256, (n, k // per_block, block_bytes), generator=gen, dtype=torch.uint8).numpy()
    for at in K_QUANT_FACTORS[qtype]:
        blocks[..., at:at + 2] = np.full(blocks.shape[:2], 1e-3, np.float16).view(np.uint8).reshape(n, -1, 2)
    return quant_formats.decode(blocks.reshape(n, -1), qtype, k)


def _unknown(name: str) -> str | None:
    """Why this cannot be timed (None: it can): not a format the kernels run."""
    qtype = getattr(QType, name.upper(), None)
    if qtype is None:
        return "not a ggml format"
    if not quant_formats.supported(qtype):
        return "not a format the engine runs natively (docs/quantization.md)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.matmul", description=__doc__)
    parser.add_argument("--model", default="default", help="whose shapes (its config only; the weights are random)")
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantized", default="", help="also the quantized kernels over the weights in these "
                        "ggml formats: q8_0, q4_0, q4_1 (by the gguf library's reference quantizer), q4_k, q6_k "
                        "(random blocks)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    formats = tuple(f for f in args.quantized.split(",") if f)
    for name in formats:
        if (problem := _unknown(name)) is not None:
            parser.error(f"--quantized {name}: {problem}")
    result = run(args.model, tuple(int(r) for r in args.rows.split(",")), args.repeats, args.dtype, quantized=formats)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
