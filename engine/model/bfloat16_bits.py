"""float32 and bfloat16 arrays in numba kernels. numpy has no bfloat16, so bfloat16 tensors reach the
kernels as their uint16 bits; these helpers read and write elements of either kind as float32, chosen
per array type when numba compiles (float32 pays nothing)."""
from __future__ import annotations

import numpy as np
import torch
from numba import types
from numba.core.extending import intrinsic, overload


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view (never a copy: kernels write K/V through it) of a contiguous float32 or bfloat16
    tensor, bfloat16 as its uint16 bits."""
    if not t.is_contiguous():
        raise ValueError(f"CPU kernels need contiguous tensors, got strides {t.stride()}")
    t = t.detach()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@intrinsic
def bits_from_float(typingctx, value):
    """The int32 whose bits are the float32 `value`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int32))
    return types.int32(types.float32), codegen


def as_float32(value):
    """An array element as float32 (compiled per element type below)."""


@overload(as_float32, inline="always")
def _as_float32_for(value):
    if value == types.uint16:  # bfloat16 bits: a bfloat16 is the top half of a float32
        return lambda value: float_from_bits(np.int32(value) << 16)
    return lambda value: value


def to_element(array, value):
    """A float32 as an element of `array`: itself, or bfloat16 bits rounded to nearest even (as torch)."""


@overload(to_element, inline="always")
def _to_element_for(array, value):
    if array.dtype == types.uint16:
        def to_bfloat16(array, value):
            bits = bits_from_float(value)
            return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 & 0xFFFF)
        return to_bfloat16
    return lambda array, value: value
