"""Paged attention: cascade decoding over shared blocks equals plain attention over each sequence, and the
paged CPU kernel equals the gather + SDPA path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.model import attention, paged_decode_cpu
from engine.model.attention import DecodeBatch, SharedPrefix, _attend, _attend_matmul, _decode_attention

HEADS, KV_HEADS, DIM = 6, 2, 16


def _reference(q, k_cache, v_cache, contexts, dim=DIM):
    out = []
    for b, slots in enumerate(contexts):
        keys, values = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], keys, values, scale=dim ** -0.5,
                                                  enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def _padded(rests):
    """Slots, lengths and padding bias of a decode batch whose rows read `rests`."""
    slots = torch.nn.utils.rnn.pad_sequence(rests, batch_first=True)
    lengths = torch.tensor([len(r) for r in rests])
    padding = torch.arange(slots.shape[1])[None, :] >= lengths[:, None]
    return slots, lengths, torch.zeros(padding.shape).masked_fill(padding, float("-inf"))[:, None, None]


@pytest.fixture(params=[True, False], ids=["paged kernel", "gather + sdpa"])
def decode_path(request) -> bool:
    """Runs a test through the paged CPU kernel (True: DecodeBatch.paged_kernel) and through the plain path."""
    return request.param


def test_cascade_decode_equals_plain_attention(decode_path):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    shared = torch.arange(0, 12)  # three blocks every sequence shares
    rests = [torch.arange(12, 15), torch.arange(20, 27), torch.arange(40, 41)]
    q = torch.randn(3, HEADS, DIM)
    expected = _reference(q, k_cache, v_cache, [torch.cat([shared, r]) for r in rests])
    slots, lengths, mask = _padded(rests)
    batch = DecodeBatch(torch.arange(3), slots, lengths, mask, [SharedPrefix(torch.arange(3), shared)], decode_path)
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5), expected)
    # the same sequences without a shared part take the plain path
    slots, lengths, mask = _padded([torch.cat([shared, r]) for r in rests])
    plain = DecodeBatch(torch.arange(3), slots, lengths, mask, [], decode_path)
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, plain, DIM ** -0.5), expected)


def test_cascade_groups_and_an_outsider(decode_path):
    """Two groups share different prefixes and one decode shares nothing: each row still gets its own attention."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(128, KV_HEADS, DIM), torch.randn(128, KV_HEADS, DIM)
    prefix_a, prefix_b = torch.arange(0, 16), torch.arange(16, 24)
    rests = [torch.arange(30, 35), torch.arange(100, 128), torch.arange(40, 43), torch.arange(50, 60),
             torch.arange(60, 61)]
    contexts = [torch.cat([prefix_a, rests[0]]), torch.cat([prefix_b, rests[1]]), torch.cat([prefix_a, rests[2]]),
                rests[3], torch.cat([prefix_b, rests[4]])]
    q = torch.randn(5, HEADS, DIM)
    slots, lengths, mask = _padded(rests)
    groups = [SharedPrefix(torch.tensor([0, 2]), prefix_a), SharedPrefix(torch.tensor([1, 4]), prefix_b)]
    batch = DecodeBatch(torch.arange(5), slots, lengths, mask, groups, decode_path)
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5),
                               _reference(q, k_cache, v_cache, contexts))


def test_fused_cpu_kernel_and_plain_matmuls_agree():
    """The CPU path (torch's fused kernel) and the path other devices take give the same output and lse."""
    torch.manual_seed(2)
    q, k, v = torch.randn(3, HEADS, 2, DIM), torch.randn(3, 5, KV_HEADS, DIM), torch.randn(3, 5, KV_HEADS, DIM)
    bias = torch.zeros(3, 1, 1, 5)
    bias[1, ..., 3:] = float("-inf")
    fused = _attend(q, k.transpose(1, 2), v.transpose(1, 2), bias, 0.3)
    plain = _attend_matmul(q, k.transpose(1, 2), v.transpose(1, 2), bias, 0.3)
    torch.testing.assert_close(fused, plain)


def test_cascade_decode_in_bfloat16_keeps_the_dtype(decode_path):
    torch.manual_seed(3)
    k_cache = torch.randn(32, KV_HEADS, DIM).bfloat16()
    v_cache = torch.randn(32, KV_HEADS, DIM).bfloat16()
    q = torch.randn(2, HEADS, DIM).bfloat16()
    slots, lengths, bias = _padded([torch.arange(8, 10), torch.arange(12, 15)])
    batch = DecodeBatch(torch.arange(2), slots, lengths, bias.bfloat16(),
                        [SharedPrefix(torch.arange(2), torch.arange(0, 8))], decode_path)
    out = _decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5)
    expected = _reference(q.float(), k_cache.float(), v_cache.float(),
                          [torch.cat([torch.arange(0, 8), r]) for r in (torch.arange(8, 10), torch.arange(12, 15))])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("dim", [DIM, 64, 128])  # 64 and 128 have their own compiled copies of a chunk
def test_paged_kernel_equals_gather_and_sdpa(batch_size, dtype, dim):
    """Long, ragged contexts over scattered blocks, split over several chunks; bfloat16 against the same bf16
    values in float32."""
    torch.manual_seed(4)
    block_size, num_blocks = 16, 64
    # large scores: the chunks' maxima differ, so their merge has to rescale
    k_cache = (torch.randn(num_blocks * block_size, KV_HEADS, dim) * 3).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, KV_HEADS, dim).to(dtype)
    rests = []
    for _ in range(batch_size):
        length = int(torch.randint(1, 3 * paged_decode_cpu.CHUNK, ()))
        blocks = torch.randperm(num_blocks)[:-(-length // block_size)]
        rests.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length])
    slots, lengths, bias = _padded(rests)
    q = torch.randn(batch_size, HEADS, dim).to(dtype)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5)
    assert out.dtype == dtype
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    keys = attention._gather(k_cache, slots).transpose(1, 2)
    values = attention._gather(v_cache, slots).transpose(1, 2)
    expected, _ = _attend(q.unsqueeze(2), keys, values, bias, dim ** -0.5)
    tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}  # the output is rounded to bf16
    torch.testing.assert_close(out.float(), expected.squeeze(2), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64])
def test_paged_kernel_cascade_over_long_shared_prefixes(dtype, dim):
    """Two cascade groups whose shared prefixes span several chunks, and a row in no group: each row gets
    plain attention over its whole context."""
    torch.manual_seed(5)
    k_cache = (torch.randn(2048, KV_HEADS, dim) * 3).to(dtype)
    v_cache = torch.randn(2048, KV_HEADS, dim).to(dtype)
    prefix_a = torch.arange(0, 2 * paged_decode_cpu.CHUNK + 16)
    prefix_b = torch.arange(600, 600 + paged_decode_cpu.CHUNK)
    rests = [torch.arange(1000, 1003), torch.arange(1100, 1400), torch.arange(1500, 1501), torch.arange(1600, 1620),
             torch.arange(1700, 1710)]
    groups = [SharedPrefix(torch.tensor([0, 1, 4]), prefix_a), SharedPrefix(torch.tensor([3, 2]), prefix_b)]
    contexts = [torch.cat([prefix_a, rests[0]]), torch.cat([prefix_a, rests[1]]), torch.cat([prefix_b, rests[2]]),
                torch.cat([prefix_b, rests[3]]), torch.cat([prefix_a, rests[4]])]
    contexts.append(torch.arange(1800, 2000))  # in no group
    rests.append(contexts[-1])
    q = torch.randn(len(rests), HEADS, dim).to(dtype)
    slots, lengths, _ = _padded(rests)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5, groups)
    expected = _reference(q.float(), k_cache.float(), v_cache.float(), contexts, dim)
    tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_paged_kernel_row_without_slots_gets_zeros_not_nan():
    k_cache, v_cache = torch.randn(32, KV_HEADS, DIM), torch.randn(32, KV_HEADS, DIM)
    slots = torch.tensor([[0, 1, 2], [0, 0, 0]])
    out = paged_decode_cpu.paged_decode(torch.randn(2, HEADS, DIM), k_cache, v_cache, slots, torch.tensor([3, 0]),
                                        DIM ** -0.5)
    assert torch.equal(out[1], torch.zeros(HEADS, DIM)) and torch.all(torch.isfinite(out[0]))


def test_paged_kernel_serves_fp32_and_bf16_on_cpu_only():
    assert paged_decode_cpu.supports(torch.float32, torch.device("cpu"))
    assert paged_decode_cpu.supports(torch.bfloat16, torch.device("cpu"))
    assert not paged_decode_cpu.supports(torch.float16, torch.device("cpu"))
    assert not paged_decode_cpu.supports(torch.float32, torch.device("cuda"))


def test_bf16_caches_beside_float32_queries(decode_path):
    """kv_cache_dtype=bfloat16 beside a float32 model: both decode paths read bf16 K/V for float32 queries
    and answer in float32, as attention over the same K/V values in float32 would."""
    torch.manual_seed(6)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM).bfloat16(), torch.randn(64, KV_HEADS, DIM).bfloat16()
    shared, rests = torch.arange(0, 12), [torch.arange(12, 15), torch.arange(20, 27), torch.arange(40, 45)]
    q = torch.randn(3, HEADS, DIM)
    contexts = [torch.cat([shared, rests[0]]), torch.cat([shared, rests[1]]), rests[2]]
    expected = _reference(q, k_cache.float(), v_cache.float(), contexts)
    slots, lengths, mask = _padded(rests)
    batch = DecodeBatch(torch.arange(3), slots, lengths, mask, [SharedPrefix(torch.tensor([0, 1]), shared)],
                        decode_path)
    out = _decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_a_row_in_two_cascade_groups_is_refused():
    groups = [SharedPrefix(torch.tensor([0, 1]), torch.arange(4)), SharedPrefix(torch.tensor([1, 2]), torch.arange(8))]
    with pytest.raises(ValueError, match="one cascade group"):
        paged_decode_cpu.cascade_groups(groups, 3)


def test_fast_exp_matches_exp_over_the_softmax_range():
    """x <= 0 down to the clamp, with the points where x log2(e) is half an integer (the rounding's ties)."""
    from numba import njit

    @njit(fastmath=True)
    def exps(xs):
        out = np.empty_like(xs)
        for i in range(len(xs)):
            out[i] = paged_decode_cpu.fast_exp(xs[i])
        return out

    xs = np.concatenate([np.linspace(-87.0, 0.0, 100_001), -(np.arange(0, 120) + 0.5) * np.log(2)]).astype(np.float32)
    np.testing.assert_allclose(exps(xs), np.exp(xs.astype(np.float64)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 1)])
def test_paged_kernel_serves_every_gqa_group_size(heads, kv_heads, dim):
    """1 to 12 query heads per kv head: keys are scored for up to 4 heads at once, values weighted for up to 4
    (head size 64) or 2 (128), larger groups in turns of those."""
    torch.manual_seed(6)
    k_cache, v_cache = torch.randn(600, kv_heads, dim) * 3, torch.randn(600, kv_heads, dim)
    contexts = [torch.arange(0, 37), torch.arange(100, 400), torch.randperm(600)[:90]]
    q = torch.randn(len(contexts), heads, dim)
    slots, lengths, _ = _padded(contexts)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, contexts, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads, members", [(6, 2, 4), (6, 2, 11), (4, 4, 12), (8, 2, 5), (12, 1, 2)])
def test_large_cascade_groups_take_the_matmul_path_and_agree(heads, kv_heads, members, dim, dtype):
    """A group with at least CASCADE_QUERIES queries per kv head is scored and weighted as two matmuls per
    chunk (_cascade): several row groups of the microkernel, chunks whose length is no multiple of 16 or 32,
    a prefix of scattered blocks, a row outside the group, and K/V in float32 and bfloat16."""
    assert members * heads // kv_heads >= paged_decode_cpu.CASCADE_QUERIES
    torch.manual_seed(7)
    k_cache = (torch.randn(1400, kv_heads, dim) * 3).to(dtype)
    v_cache = torch.randn(1400, kv_heads, dim).to(dtype)
    blocks = torch.randperm(40)[:19]
    prefix = (blocks[:, None] * 16 + torch.arange(16)).flatten()[:299]  # 299 slots: chunks of 64, last of 43
    rests = [torch.arange(700 + 20 * b, 700 + 20 * b + 1 + b) for b in range(members)] + [torch.arange(1300, 1350)]
    contexts = [torch.cat([prefix, r]) for r in rests[:-1]] + [rests[-1]]
    q = torch.randn(len(rests), heads, dim).to(dtype)
    slots, lengths, _ = _padded(rests)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5,
                                        [SharedPrefix(torch.arange(members), prefix)])
    expected = _reference(q.float(), k_cache.float(), v_cache.float(), contexts, dim)
    tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_tasks_are_dealt_so_both_threads_get_own_chunks_beside_the_cascade():
    """8 rows sharing 960 slots (15 cascade tasks of 64 slots, the matmul form) and 40 own slots each
    (8 plain tasks): a plain row-slot is dealt as PLAIN_COST cascade ones, so the own chunks do not all
    land on one thread. Every task is dealt once."""
    rows, per_kv, dim = 8, 3, 64
    plan = paged_decode_cpu._plan(np.full(rows, 40, np.int64), np.zeros(rows, np.int64), np.array([960], np.int64),
                                  2, per_kv, dim)
    source, by_bin, bin_first = plan[1], plan[7], plan[8]
    assert sorted(by_bin) == list(range(len(source)))
    own_per_bin = [int((source[by_bin[bin_first[b]:bin_first[b + 1]]] < rows).sum()) for b in range(2)]
    assert sum(own_per_bin) == rows and min(own_per_bin) >= 2
