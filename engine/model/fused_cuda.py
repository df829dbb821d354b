"""The decoder's elementwise chains as one Triton kernel each, for CUDA.

Eager PyTorch runs RMSNorm as 7 kernels in bfloat16 (cast, square, mean, add, rsqrt, multiply, scale),
rotary as 5 per tensor and SiLU-and-multiply as 2. On a GPU each launch costs more than its
arithmetic, even replayed from a CUDA graph, so a small model's decode step is bound by its kernel
count, far above its memory roofline (docs/speed.md#on-a-gpu-cuda). Each function
here is one kernel that computes in float32 and rounds once. The CPU keeps the eager ops (and its
compiled decode step).
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
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_x0, stride_x1, stride_cos, half, BLOCK: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < half
    src = x_ptr + token * stride_x0 + head * stride_x1
    first = tl.load(src + cols, mask=inside).to(tl.float32)
    second = tl.load(src + half + cols, mask=inside).to(tl.float32)
    angles = token * stride_cos + cols
    cos_first = tl.load(cos_ptr + angles, mask=inside).to(tl.float32)
    cos_second = tl.load(cos_ptr + angles + half, mask=inside).to(tl.float32)
    sin_first = tl.load(sin_ptr + angles, mask=inside).to(tl.float32)
    sin_second = tl.load(sin_ptr + angles + half, mask=inside).to(tl.float32)
    dst = out_ptr + (token * tl.num_programs(1) + head) * 2 * half
    kind = out_ptr.dtype.element_ty
    tl.store(dst + cols, (first * cos_first - second * sin_first).to(kind), mask=inside)
    tl.store(dst + half + cols, (second * cos_second + first * sin_second).to(kind), mask=inside)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.apply_rotary in one kernel. x: [T, heads, D] (strided rows are fine); cos, sin: [T, D]."""
    assert x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rotary_kernel[(x.shape[0], x.shape[1])](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), half,
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
