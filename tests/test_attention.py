"""Paged attention: cascade decoding over shared blocks equals plain attention over each sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention import DecodeBatch, _decode_attention


def test_cascade_decode_equals_plain_attention():
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 16, 4
    k_cache, v_cache = torch.randn(64, kv_heads, dim), torch.randn(64, kv_heads, dim)
    shared = torch.arange(0, 12)  # three blocks every sequence shares
    rests = [torch.arange(12, 15), torch.arange(20, 27), torch.arange(40, 41)]
    q = torch.randn(3, heads, dim)
    expected = []
    for b, rest in enumerate(rests):
        slots = torch.cat([shared, rest])
        keys, values = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
        expected.append(F.scaled_dot_product_attention(q[b][None, :, None], keys, values, scale=dim ** -0.5,
                                                       enable_gqa=True)[0, :, 0])
    padded = torch.nn.utils.rnn.pad_sequence(rests, batch_first=True)
    mask = (torch.arange(padded.shape[1])[None, :] < torch.tensor([len(r) for r in rests])[:, None])[:, None, None]
    batch = DecodeBatch(torch.arange(3), shared, padded, mask)
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, batch, dim ** -0.5), torch.stack(expected))
    # the same sequences without a shared part take the plain path
    full = torch.nn.utils.rnn.pad_sequence([torch.cat([shared, r]) for r in rests], batch_first=True)
    full_mask = (torch.arange(full.shape[1])[None, :] < torch.tensor([12 + len(r) for r in rests])[:, None])
    plain = DecodeBatch(torch.arange(3), None, full, full_mask[:, None, None])
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, plain, dim ** -0.5), torch.stack(expected))
