"""A plain quantizer into llama.cpp's Q4_K and Q6_K blocks, for tiny test models: the gguf library decodes
K-quants but cannot make them. Each scale is simply its group's range over the format's levels (llama.cpp
searches for better ones); the byte layout is ggml's, so the gguf library's dequantizer reads the result."""
from __future__ import annotations

import numpy as np

QK_K = 256


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def _ratio(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    return np.divide(values, step, out=np.zeros_like(values), where=step != 0)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> [N, K / 256 * 144] uint8: per super-block d, dmin (fp16), eight 6-bit scales and mins
    packed in 12 bytes, then 256 nibbles (each 32-byte run: one group low, the next high)."""
    n = weight.shape[0]
    w = weight.reshape(n, -1, 8, 32).astype(np.float32)
    low = -np.minimum(w.min(axis=-1), 0)  # each group's min, as the positive amount below zero
    span = (w.max(axis=-1) + low) / 15
    d, dmin = _fp16(span.max(axis=-1) / 63), _fp16(low.max(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(span, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(low, dmin[..., None])), 0, 63).astype(np.uint8)
    step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
    q = np.clip(np.rint(_ratio(w + offset, step)), 0, 15).astype(np.uint8).reshape(n, -1, 4, 2, 32)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, -1, 128)
    head = np.stack([d, dmin], axis=-1).astype(np.float16).view(np.uint8)
    return np.concatenate([head, packed, qs], axis=-1).reshape(n, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> [N, K / 256 * 210] uint8: 128 bytes of low nibbles, 64 of top bit pairs, sixteen int8
    scales, d (fp16)."""
    n = weight.shape[0]
    w = weight.reshape(n, -1, 16, 16).astype(np.float32)
    extreme = np.take_along_axis(w, np.abs(w).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    group_scale = -extreme / 32  # the largest magnitude lands on -32, the widest level
    d = _fp16(np.abs(group_scale).max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(group_scale, d[..., None])), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    u = (np.clip(np.rint(_ratio(w, step)), -32, 31) + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32)
    # ql: per half of 128 weights, 64 bytes: weights i (low nibble) and 64 + i (high); qh: 32 bytes, weights
    # i, 32 + i, 64 + i, 96 + i at bit pairs 0, 2, 4, 6
    low = u & 0x0F
    ql = (low[:, :, :, 0:2].reshape(n, -1, 2, 64) | (low[:, :, :, 2:4].reshape(n, -1, 2, 64) << 4)).reshape(n, -1, 128)
    top = u >> 4
    qh = (top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)).reshape(n, -1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16)[..., None].view(np.uint8)],
                          axis=-1).reshape(n, -1)
