"""The decoder's elementwise chains as one Triton kernel each, for CUDA.

Eager PyTorch runs RMSNorm as 7 kernels in bfloat16 (cast, square, mean, add, rsqrt, multiply, scale) and the
residual add before it as one more, rotary as 5 per tensor, the K/V store as 2 more and SiLU-and-multiply as 2.
On a GPU each launch costs more than its arithmetic, even replayed from a CUDA graph, so a small model's decode
step is bound by its kernel count, far above its memory roofline (docs/speed.md#on-a-gpu-cuda). Each function
here is one kernel that computes in float32 and rounds once. The CPU keeps the eager ops (and its compiled decode
step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x0, stride_x1, dim, eps, BLOCK: tl.constexpr):
    row, sub = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    x = tl.load(x_ptr + row * stride_x0 + sub * stride_x1 + cols, mask=inside, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    # as transformers: the normalized row is rounded to the input's dtype before the weight scales it (the
    # product of two such values is exact in float32 and rounds once on the store, as torch's does)
    out = weight * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + (row * tl.num_programs(1) + sub) * dim + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, dim] or [T, heads, dim] (strided rows are fine; the last dim is contiguous)."""
    assert x.stride(-1) == 1 and x.dim() in (2, 3)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    subs, stride_sub = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    _rms_norm_kernel[(x.shape[0], subs)](x, weight, out, x.stride(0), stride_sub, dim, eps,
                                         BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _add_rms_norm_kernel(delta_ptr, residual_ptr, weight_ptr, out_ptr, stride_delta, stride_residual, dim, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    delta = tl.load(delta_ptr + row * stride_delta + cols, mask=inside, other=0.0).to(tl.float32)
    at = residual_ptr + row * stride_residual + cols
    # the sum rounded to the stream's dtype once, as torch's add does, and normalized from that rounded value
    total = (tl.load(at, mask=inside, other=0.0).to(tl.float32) + delta).to(residual_ptr.dtype.element_ty)
    tl.store(at, total, mask=inside)
    x = total.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = weight * normed.to(residual_ptr.dtype.element_ty).to(tl.float32)  # (rounded as _rms_norm_kernel does)
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta, in place, then rms_norm(residual) returned: a decoder layer's residual add and the next
    norm in one kernel (vLLM's fused_add_rms_norm). delta, residual: [T, dim], rows contiguous."""
    assert delta.shape == residual.shape and delta.stride(-1) == residual.stride(-1) == 1
    dim = residual.shape[-1]
    out = torch.empty(residual.shape, dtype=torch.result_type(weight, residual), device=residual.device)
    _add_rms_norm_kernel[(residual.shape[0],)](delta, residual, weight, out, delta.stride(0), residual.stride(0),
                                               dim, eps, BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _rotate_heads(src, stride_head, heads, cos_first, cos_second, sin_first, sin_second, half,
                  HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """(first half, second half) of every head of one token rotated, float32: [HEADS, BLOCK] each."""
    rows, cols = tl.arange(0, HEADS)[:, None], tl.arange(0, BLOCK)[None, :]
    inside = (rows < heads) & (cols < half)
    at = src + rows * stride_head + cols
    first = tl.load(at, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(at + half, mask=inside, other=0.0).to(tl.float32)
    return (first * cos_first[None, :] - second * sin_first[None, :],
            second * cos_second[None, :] + first * sin_second[None, :])


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                         stride_q0, stride_q1, stride_k0, stride_k1, stride_v0, stride_v1, stride_cos,
                         stride_slot, stride_cache_head, heads, kv_heads, half,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    angles = cos_ptr + token * stride_cos + cols
    inside = cols < half
    cos_first = tl.load(angles, mask=inside, other=0.0).to(tl.float32)
    cos_second = tl.load(angles + half, mask=inside, other=0.0).to(tl.float32)
    sines = sin_ptr + token * stride_cos + cols
    sin_first = tl.load(sines, mask=inside, other=0.0).to(tl.float32)
    sin_second = tl.load(sines + half, mask=inside, other=0.0).to(tl.float32)
    # the queries, to a contiguous [T, heads, D] output
    first, second = _rotate_heads(q_ptr + token * stride_q0, stride_q1, heads, cos_first, cos_second,
                                  sin_first, sin_second, half, HEADS, BLOCK)
    rows = tl.arange(0, HEADS)[:, None]
    mask = (rows < heads) & inside[None, :]
    dst = q_out_ptr + token * heads * 2 * half + rows * 2 * half + cols[None, :]
    kind = q_out_ptr.dtype.element_ty
    tl.store(dst, first.to(kind), mask=mask)
    tl.store(dst + half, second.to(kind), mask=mask)
    # the keys rotated and the values as they are, to the token's slot of the K/V pool, in the pool's dtype
    first, second = _rotate_heads(k_ptr + token * stride_k0, stride_k1, kv_heads, cos_first, cos_second,
                                  sin_first, sin_second, half, KV_HEADS, BLOCK)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    stored_heads = tl.where(slot >= 0, kv_heads, 0)  # slot -1: a padding token, nothing to store
    kv_rows = tl.arange(0, KV_HEADS)[:, None]
    kv_mask = (kv_rows < stored_heads) & inside[None, :]
    at = slot * stride_slot + kv_rows * stride_cache_head + cols[None, :]
    kind = k_cache_ptr.dtype.element_ty
    rounded = k_ptr.dtype.element_ty  # (as the eager path: rounded to k's dtype first)
    tl.store(k_cache_ptr + at, first.to(rounded).to(kind), mask=kv_mask)
    tl.store(k_cache_ptr + at + half, second.to(rounded).to(kind), mask=kv_mask)
    values = v_ptr + token * stride_v0 + kv_rows * stride_v1 + cols[None, :]
    tl.store(v_cache_ptr + at, tl.load(values, mask=kv_mask).to(kind), mask=kv_mask)
    tl.store(v_cache_ptr + at + half, tl.load(values + half, mask=kv_mask).to(kind), mask=kv_mask)


def rotary_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """llama.apply_rotary on q and k and attention.store_kv of the rotated k and v, in one launch (one program
    a token, all its heads). q: [T, H, D], k, v: [T, KVH, D] (strided rows are fine); cos, sin: [T, D];
    slot_mapping: [T], -1 for a token whose K/V are not kept; caches: [num_slots, KVH, D]. Returns the rotated
    q, contiguous."""
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    tokens, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rotary_store_kernel[(tokens,)](q, k, v, cos, sin, slot_mapping, out, k_cache, v_cache,
                                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                    cos.stride(0), k_cache.stride(0), k_cache.stride(1), heads, kv_heads, half,
                                    HEADS=triton.next_power_of_2(heads), KV_HEADS=triton.next_power_of_2(kv_heads),
                                    BLOCK=triton.next_power_of_2(half))
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_row, width, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + width + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output [T, 2 * I] -> [T, I]."""
    assert gate_up.stride(-1) == 1
    width = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), width,
                                                                       BLOCK=block)
    return out
