"""Integer dot products (quant_dot_cpu): the activations' int8 rounding against its bound, and the kernel
against a float64 reference computed on the rounded activations, for every layout (4 and 8 bits in groups of 32,
6 bits in groups of 16), row groups of 1, 2 and more, widths that are not whole tiles and planted outliers in
scales and mins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from llvmlite import binding

from engine.model import kernel_cache, quant_dot_cpu, quant_matmul_cpu
from engine.model.quant_formats import QuantRows, SuperBlocks
from engine.model.quant_matmul_cpu import SUPER_HEAD, TILE

pytestmark = pytest.mark.skipif(not quant_dot_cpu.X86, reason="integer dot products are x86 (AVX2) code")
REPO = Path(__file__).resolve().parents[3]
HOST_FEATURES = binding.get_host_cpu_features().flatten()

# (bits, with mins): Q4_1 / Q4_K / Q4_0 (min = -8 scale), Q8_0, an 8-bit stack with mins (Q4_1 beside Q8_0),
# Q6_K, a 6-bit stack with mins (Q4_K beside Q6_K)
LAYOUTS = [(4, True), (8, False), (8, True), (6, False), (6, True)]
# whole-tile passes up to ROW_GROUP rows, half-tile passes of GEMM_ROWS beyond (a last one partly filled); 4-bit
# weights with 512-bit VNNI: whole-tile passes of WIDE_ROWS
ROW_COUNTS = sorted({1, 2, 3, quant_dot_cpu.ROW_GROUP, quant_dot_cpu.ROW_GROUP + 1, quant_dot_cpu.GEMM_ROWS,
                     2 * quant_dot_cpu.GEMM_ROWS + 1, quant_dot_cpu.WIDE_ROWS, quant_dot_cpu.WIDE_ROWS + 1,
                     2 * quant_dot_cpu.WIDE_ROWS + 1, 40})


def _group(bits: int) -> int:
    return quant_dot_cpu.SIX_BIT_GROUP if bits == 6 else 32


def _rows(n: int, k: int, bits: int, with_mins: bool, seed: int = 0, half: bool = False) -> QuantRows:
    """Random rows; `half`: their scales and mins fp16 values, as Q8_0's, Q4_0's and Q4_1's are."""
    rng = np.random.default_rng(seed)
    low, high = {4: (0, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
    q = rng.integers(low, high, (n, k), dtype=np.uint8 if bits == 4 else np.int8)
    q[1, :32] = {4: 15, 6: 31, 8: -128}[bits]  # the largest products the 16-bit pair sums must hold
    q[2, :16] = low  # (6 bits: read + 32 as 0)
    group = _group(bits)
    scales = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float32)
    scales[n // 2, 0] = 3.0  # planted outliers: one group's scale, one group's min
    mins = rng.uniform(-0.1, 0.1, (n, k // group)).astype(np.float32) if with_mins else None
    if mins is not None:
        mins[0, -1] = -40.0
    if half:
        scales, mins = (None if v is None else v.astype(np.float16).astype(np.float32) for v in (scales, mins))
    return QuantRows(q, scales, mins, group, bits)


def _k_quant_rows(n: int, k: int, bits: int, with_mins: bool, size: int = 128) -> QuantRows:
    """Random rows whose scales and mins have a K-quant's two levels: an fp16 factor per super-block of `size`
    weights times an int8 per group of 32 (16 for 6 bits; planted outliers among both)."""
    rng = np.random.default_rng(3)
    q, group = _rows(n, k, bits, False).q, _group(bits)

    def levels(low: float, high: float):
        d = rng.uniform(low, high, (n, k // size)).astype(np.float16).astype(np.float32)
        d[n // 2, -1] = 2.0
        sub = rng.integers(-128, 128, (n, k // group), dtype=np.int8)
        sub[0, -1], sub[-1, 0] = -128, 127
        return d, sub, np.repeat(d, size // group, axis=1) * sub.astype(np.float32)

    d, sub_scales, scales = levels(1e-4, 1e-3)
    dmin, sub_mins, mins = levels(-1e-3, 1e-3) if with_mins else (None, None, None)
    return QuantRows(q, scales, mins, group, bits, SuperBlocks(size, d, sub_scales, dmin, sub_mins))


def _rows_of_kind(n: int, k: int, bits: int, with_mins: bool, scales: str) -> QuantRows:
    """Rows whose scales scale_kind() packs as `scales` (K a multiple of 128 for super-blocks)."""
    if scales == "super-blocks":
        return _k_quant_rows(n, k, bits, with_mins)
    return _rows(n, k, bits, with_mins, half=scales == "fp16")


def _quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    xq = np.empty(x.shape, np.int8)
    d = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    sums, totals = np.empty_like(d), np.empty((x.shape[0], x.shape[1] // 16), np.int32)
    quant_dot_cpu.quantize_activations(x, xq, d, sums, totals)
    return xq, d, sums, totals


def _reference(x: np.ndarray, rows: QuantRows) -> np.ndarray:
    """The product the kernel computes: the dequantized weight times the rounded activations, in float64."""
    xq, d, _, _ = _quantized(x)
    rounded = xq.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    return rounded @ rows.dequantize().astype(np.float64).T


def test_activations_round_to_int8_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # a zero group: scale 0, every byte 0
    x[2, 70] = 1e4  # an outlier takes its group's scale
    xq, d, sums, totals = _quantized(x)
    assert np.abs(xq.astype(np.int32)).max() == 127 and d[1, 1] == 0 and not xq[1, 32:64].any()
    step = np.repeat(d, 32, axis=1)
    assert np.all(np.abs(xq * step - x) <= step / 2 * (1 + 1e-6))
    # the mins multiply the rounded activations' sum; 8-bit weights on 512-bit vectors take off 128 times it, 6-bit
    # weights 32 times its share of their group of 16
    np.testing.assert_array_equal(totals, xq.astype(np.int32).reshape(3, 6, 16).sum(axis=2))
    np.testing.assert_array_equal(sums, d * totals.reshape(3, 3, 2).sum(axis=2).astype(np.float32))


@pytest.mark.parametrize("scales", quant_matmul_cpu.SCALE_KINDS)
@pytest.mark.parametrize("bits,with_mins", LAYOUTS)
@pytest.mark.parametrize("n", [TILE, 3 * TILE + 5])
def test_product_matches_float64_on_the_rounded_activations(bits, with_mins, n, scales):
    k = 384 if scales == "super-blocks" else 96  # 3 super-blocks of 4 groups
    rows = _rows_of_kind(n, k, bits, with_mins, scales)
    assert quant_matmul_cpu.scale_kind([rows]) == scales
    tiles = quant_matmul_cpu.pack(rows, integer=True, scales=scales)
    assert tiles.integer and tiles.bits == bits and tiles.in_features == k
    assert tiles.scales.element_size() == {"fp16": 2, "float32": 4, "super-blocks": 1}[scales]
    for m in ROW_COUNTS:
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        got = quant_matmul_cpu.linear(torch.from_numpy(x), tiles, None).numpy()
        expected = _reference(x, rows)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("bits,with_mins", LAYOUTS)
def test_fp16_scales_as_records_of_one_group_give_the_fp16_products_bit_for_bit(bits, with_mins):
    """A file that mixes K-quants with Q8_0 / Q4_1 packs every weight as super-block records (one kind a model):
    the fp16 ones as records of one group, sub-scales of 1, whose products are the fp16 kind's exactly."""
    rows = _rows(2 * TILE + 3, 96, bits, with_mins, half=True)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((3, 96)).astype(np.float32))
    as_fp16, as_records = (quant_matmul_cpu.pack(rows, integer=True, scales=kind) for kind in ("fp16", "super-blocks"))
    assert as_records.integer and as_records.scales.dtype == torch.int8
    np.testing.assert_array_equal(quant_matmul_cpu.linear(x, as_records, None).numpy(),
                                  quant_matmul_cpu.linear(x, as_fp16, None).numpy())


def test_the_rounding_error_stays_within_its_bound_of_the_exact_product():
    """|sum_k w_k (x_k - d xq_k)| <= sum_k |w_k| d / 2: what int8 activations may cost against the float
    kernel."""
    rows = _rows(2 * TILE, 128, 4, True)
    x = np.random.default_rng(5).standard_normal((2, 128)).astype(np.float32)
    got = quant_matmul_cpu.linear(torch.from_numpy(x), quant_matmul_cpu.pack(rows, integer=True), None).numpy()
    exact = x.astype(np.float64) @ rows.dequantize().astype(np.float64).T
    _, d, _, _ = _quantized(x)
    bound = (np.repeat(d, 32, axis=1) / 2) @ np.abs(rows.dequantize().astype(np.float64)).T
    assert np.all(np.abs(got - exact) <= bound + 1e-4)


@pytest.mark.parametrize("scales", quant_matmul_cpu.SCALE_KINDS)
@pytest.mark.parametrize("bits,with_mins", LAYOUTS)
def test_a_row_gets_the_same_floats_in_a_batch_of_any_size(bits, with_mins, scales):
    """Whole-tile passes (a few rows) and half-tile passes (more) compute each output by the same operations: a
    row's product in a prefill-sized batch is its product alone, bit for bit, through Linear as the model runs it."""
    from engine.model.linear import MAX_PACKED_ROWS, Linear
    rows = _rows_of_kind(3 * TILE + 5, 256, bits, with_mins, scales)
    layer = Linear(256, 3 * TILE + 5, bias=True)
    layer.quant, layer.weight = quant_matmul_cpu.pack(rows, integer=True, scales=scales), None
    m = MAX_PACKED_ROWS + quant_dot_cpu.GEMM_ROWS + 1
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((m, 256)).astype(np.float32))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(m)])
    np.testing.assert_array_equal(layer(x).detach().numpy(), alone.detach().numpy())
    np.testing.assert_array_equal(layer(x[:quant_dot_cpu.GEMM_ROWS + 1]).detach().numpy(),
                                  alone[:quant_dot_cpu.GEMM_ROWS + 1].detach().numpy())


def test_no_rows_give_an_empty_product():
    """A prefill chunk that ends inside a prompt samples no token: the lm_head multiplies no rows (the kernels,
    given a row count outside their cases, would take it for their largest and write past the scratch)."""
    tiles = quant_matmul_cpu.pack(_rows(TILE, 64, 8, False), integer=True)
    assert quant_matmul_cpu.linear(torch.empty(0, 64), tiles, None).shape == (0, TILE)


def test_bias_and_accumulate_add_onto_the_output():
    rows = _rows(TILE + 7, 64, 4, True)
    tiles = quant_matmul_cpu.pack(rows, integer=True)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    bias = np.arange(TILE + 7, dtype=np.float32)
    out = np.full((3, TILE + 7), 2.0, np.float32)
    quant_matmul_cpu.quant_matmul(x, *tiles.arrays(), bias, out, True, 2)
    np.testing.assert_allclose(out, 2.0 + bias + _reference(x, rows), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scales", quant_matmul_cpu.SCALE_KINDS)
@pytest.mark.parametrize("bits,with_mins", LAYOUTS)
def test_rows_and_dequantize_read_the_quad_layout_exactly(bits, with_mins, scales):
    rows = _rows_of_kind(2 * TILE + 3, 256, bits, with_mins, scales)
    tiles = quant_matmul_cpu.pack(rows, integer=True, scales=scales)
    exact = rows.dequantize()
    np.testing.assert_array_equal(quant_matmul_cpu.dequantize_rows(tiles, 0, torch.empty(exact.shape)).numpy(), exact)
    ids = torch.tensor([0, 1, 37, 2 * TILE + 2])
    np.testing.assert_array_equal(quant_matmul_cpu.embedding_rows(tiles, ids).numpy(), exact[ids.numpy()])


def test_8_bit_groups_of_16_keep_the_float_kernel():
    """8-bit weights in groups of 16 (a Q8_0 stacked beside a Q6_K) have no int8 layout here: the weight packs for
    the float kernel; 6-bit ones (Q6_K's) take the 6-bit quads."""
    rng = np.random.default_rng(0)
    q, scales = rng.integers(-32, 32, (TILE, 64), dtype=np.int8), rng.uniform(0.01, 0.02, (TILE, 4)).astype(np.float32)
    assert not quant_matmul_cpu.pack(QuantRows(q, scales, None, 16, 8), integer=True).integer
    assert quant_matmul_cpu.pack(QuantRows(q, scales, None, 16, 6), integer=True).integer


def test_k_quants_keep_their_file_bytes_in_the_quad_layout():
    """Q4_K (4 bits, groups of 32 in super-blocks of 256) on integer dot products keeps its two-level scales and
    mins: 4.625 bits a weight (its file's 4.5, the 6-bit sub-scales and sub-mins held as bytes), where float32
    products took 6; Q6_K its file's bytes exactly."""
    rows = _k_quant_rows(TILE, 512, 4, True, size=256)
    tiles = quant_matmul_cpu.pack(rows, integer=True, scales=quant_matmul_cpu.scale_kind([rows]))
    assert tiles.integer and tiles.scales.shape == (1, 2, SUPER_HEAD + 8 * TILE)
    assert tiles.nbytes() * 8 / (TILE * 512) == 4.625
    # Q6_K: 6 bits a weight and an int8 sub-scale per 16 under an fp16 factor per 256, its file's 6.5625
    rows = _k_quant_rows(TILE, 512, 6, False, size=256)
    tiles = quant_matmul_cpu.pack(rows, integer=True, scales=quant_matmul_cpu.scale_kind([rows]))
    assert tiles.integer and tiles.bits == 6 and tiles.scales.shape == (1, 2, SUPER_HEAD + 16 * TILE)
    assert tiles.nbytes() * 8 / (TILE * 512) == 6.5625


VNNI_CHECK = """
import sys
import numpy as np
import torch
from engine.model import kernel_cache, quant_dot_cpu, quant_matmul_cpu
from tests.engine.model.test_quant_dot import LAYOUTS, _rows
assert quant_dot_cpu.VNNI == (sys.argv[1] != "off"), kernel_cache.target_cpu()
x = torch.from_numpy(np.random.default_rng(5).standard_normal((40, 96)).astype(np.float32))
products = [quant_matmul_cpu.linear(x[:count], quant_matmul_cpu.pack(_rows(70, 96, bits, with_mins), integer=True),
                                    None).numpy() for bits, with_mins in LAYOUTS for count in (1, 5, 40)]
np.save(sys.argv[2], np.concatenate([p.ravel() for p in products]))
asm = "".join(quant_matmul_cpu._integer_matmul.inspect_asm().values()).splitlines()
print(any("vpdpbusd" in line for line in asm), any("vpdpbusd" in line and "zmm" in line for line in asm))
"""


def _without(features: str, *names: str) -> str:
    return ",".join("-" + f[1:] if f[1:] in names else f for f in features.split(","))


@pytest.mark.slow  # fresh processes, each compiling the integer kernels
@pytest.mark.skipif(not kernel_cache.has_vnni(HOST_FEATURES), reason="the host has no VNNI to compare AVX2's code with")
def test_vnni_gives_the_same_bits_as_avx2s_pairs(tmp_path):
    """The integer kernels with `vpdpbusd` (the host's VNNI: on 512-bit vectors for 4-bit weights where it has
    AVX512-VNNI), with it on 256-bit vectors only (where the host also has AVX-VNNI), and without it (AVX2's
    `vpmaddubsw` and `vpmaddwd`) give every layout's product bit for bit, at whole-tile and half-tile row
    counts."""
    wide = kernel_cache.has_wide_vnni(HOST_FEATURES)
    variants = {"on": (HOST_FEATURES, f"True {wide}"),
                "off": (_without(HOST_FEATURES, "avxvnni", "avx512vnni"), "False False")}
    if wide and kernel_cache.has_vnni(_without(HOST_FEATURES, "avx512vnni")):
        variants["narrow"] = (_without(HOST_FEATURES, "avx512vnni"), "True False")
    # (numba shows no machine code of a kernel loaded from its cache: each run compiles into an empty one; the
    # runs go at once, each compiling on one core)
    checks = {name: subprocess.Popen([sys.executable, "-c", VNNI_CHECK, name, str(tmp_path / f"{name}.npy")],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "NUMBA_CPU_FEATURES": features,
                                          "NUMBA_CACHE_DIR": str(tmp_path / name)})
              for name, (features, _) in variants.items()}
    for name, check in checks.items():
        stdout, stderr = check.communicate(timeout=600)
        assert check.returncode == 0, stderr[-3000:]
        assert stdout.strip() == variants[name][1], name  # which instructions the code has
    for name in variants:
        assert np.array_equal(np.load(tmp_path / "on.npy"), np.load(tmp_path / f"{name}.npy")), name


def test_the_quad_layout_is_a_type_of_its_own_for_the_compiled_step():
    """Quads hold int8 bytes where the float kernel's tiles hold uint8: compiled code picks its path by type, so a
    step compiles only the path its weights take, and a projection whose layers mix the two keeps the module
    path (the step holds one typed list per projection)."""
    from torch import nn

    from engine.model.linear import Linear, uniform_linears
    rows = _rows(TILE, 64, 4, True)
    quads, floats = quant_matmul_cpu.pack(rows, integer=True), quant_matmul_cpu.pack(rows)
    assert (quads.data.dtype, floats.data.dtype) == (torch.int8, torch.uint8)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32))
    np.testing.assert_allclose(quant_matmul_cpu.linear(x, quads, None).numpy(), _reference(x.numpy(), rows),
                               rtol=1e-5, atol=1e-5)

    def model_of(*tiles) -> nn.Module:
        layers = nn.ModuleList()
        for t in tiles:
            layer = nn.Module()
            layer.down_proj = Linear(64, TILE)
            layer.down_proj.quant, layer.down_proj.weight = t, None
            layers.append(layer)
        return layers

    assert uniform_linears(model_of(quads, quads)) and uniform_linears(model_of(floats, floats))
    assert not uniform_linears(model_of(quads, floats))
