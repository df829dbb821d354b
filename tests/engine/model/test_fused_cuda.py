"""The CUDA path's fused elementwise kernels against the eager ops they replace (on CUDA where there is one,
through Triton's interpreter on CPU elsewhere)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import store_kv
from engine.model.llama import RMSNorm, apply_rotary
from tests.support.machine import KERNEL_DEVICE as DEVICE, triton_module

fused_cuda = triton_module("fused_cuda")


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape,dtype", [((5, 576), torch.float32), ((3, 100), torch.float32),
                                         ((4, 96), torch.bfloat16)])
def test_rms_norm_matches_the_module(shape, dtype):
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    norm.weight.data = _randn(shape[-1], dtype=dtype, seed=1)
    x = _randn(*shape, dtype=dtype)
    expected = norm(x).detach()  # eager ops on CPU
    out = fused_cuda.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5).cpu()
    assert out.dtype == expected.dtype
    # bf16: two roundings, each of which Triton's interpreter does by truncation (a GPU rounds to nearest)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalizes(dtype):
    """A layer's residual add and the next norm in one kernel: the stream updated in place to residual + delta
    (rounded once, as torch's add), and the norm of that rounded sum, as the module computes it."""
    dim = 576 + 3  # a masked tail
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = _randn(dim, dtype=dtype, seed=1)
    residual, delta = _randn(4, dim, dtype=dtype), _randn(4, dim, dtype=dtype, seed=2)
    expected_stream = residual + delta
    expected = norm(expected_stream).detach()
    stream = residual.to(DEVICE)
    out = fused_cuda.add_rms_norm(delta.to(DEVICE), stream, norm.weight.to(DEVICE), 1e-5).cpu()
    assert out.dtype == expected.dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # (the interpreter rounds bf16 by truncation)
    torch.testing.assert_close(stream.cpu().float(), expected_stream.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    if DEVICE.type == "cuda":  # one add rounded to nearest, as torch's: the same bits (the norm's float32 sum of
        assert torch.equal(stream.cpu(), expected_stream)  # squares runs in another order: an ulp apart at most)


def test_add_and_norm_is_the_add_then_the_norm_on_cpu():
    """The module's CPU path (no kernel): a new stream tensor, the caller's left as it was."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = _randn(64, seed=1)
    residual, delta = _randn(3, 64), _randn(3, 64, seed=2)
    before = residual.clone()
    out, stream = norm.add_and_norm(delta, residual)
    assert torch.equal(stream, before + delta) and torch.equal(residual, before)
    assert torch.equal(out, norm(before + delta))


def test_rms_norm_of_strided_heads():
    """q_norm / k_norm (Qwen3) normalize [T, heads, D] views into the fused qkv projection's output."""
    qkv = _randn(3, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, :9 * 64].view(3, 9, 64)
    weight = _randn(64, seed=2)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = weight
    out = fused_cuda.rms_norm(q.to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    torch.testing.assert_close(out, norm(q).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim,cache_dtype", [(9, 3, 64, torch.float32), (2, 1, 16, torch.float32),
                                                             (4, 2, 80, torch.float32), (6, 2, 64, torch.bfloat16)])
def test_rotary_and_store_match_the_eager_ops(heads, kv_heads, dim, cache_dtype):
    """q and k rotated, k and v written to their slots (in the pool's dtype), every other slot untouched: as
    apply_rotary and store_kv do it; a token of slot -1 (a CUDA graph's padding) stores nothing. 80: halves of
    40, masked columns; 9 and 3 heads: masked head rows."""
    tokens, num_slots = 6, 20
    # strided views into one fused projection's output, as its split gives
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim + 7)
    q, k, v = (part.view(tokens, -1, dim) for part in
               qkv[:, :(heads + 2 * kv_heads) * dim].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    angles = torch.arange(tokens)[:, None] * _randn(dim // 2, seed=3)[None, :].abs()
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.tensor([13, 2, 7, -1, 0, 8])
    cache = _randn(2, num_slots, kv_heads, dim, seed=4).to(cache_dtype)
    expected_cache = cache.clone()
    kept = slots >= 0
    store_kv(apply_rotary(k, cos, sin)[kept], v[kept], expected_cache[0], expected_cache[1], slots[kept])
    out_cache = cache.to(DEVICE)
    out = fused_cuda.rotary_and_store(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
                                      slots.to(DEVICE), out_cache[0], out_cache[1]).cpu()
    torch.testing.assert_close(out, apply_rotary(q, cos, sin), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()
    tolerance = 1e-5 if cache_dtype == torch.float32 else 1e-2  # (the interpreter rounds bf16 by truncation)
    torch.testing.assert_close(out_cache.cpu().float(), expected_cache.float(), rtol=tolerance, atol=tolerance)
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(out_cache.cpu()[:, untouched], cache[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_eager_ops(dtype):
    gate_up = _randn(3, 2 * 1536, dtype=dtype)  # 1,536 wide: two blocks of 1,024, the second masked
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(dtype)
    out = fused_cuda.silu_and_mul(gate_up.to(DEVICE)).cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
