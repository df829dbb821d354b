"""Paged attention: cascade decoding over shared blocks and the paged CPU kernel give plain attention over each
sequence, as a float64 reference computes it (tests/engine/model/test_kernel_reference.py).

The kernel's own tests plant a key whose score is SPIKE above every other at each position of a context: its
first, middle and partial last chunk (CHUNK slots), the two halves of a context shorter than a chunk, a chunk's
tail past its last 16 keys, a last chunk of one slot, a shared prefix's chunks (their size depends on the group)
and its last slot, the first own slot after it.
The spike's value is then the output, so a key, chunk or partial softmax that is dropped or misread changes it
by O(1), not by rounding, and so does a maximum that misses the spike (its exponential overflows)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import paged_decode_cpu, paged_decode_loops
from engine.model.attention import DecodeBatch, SharedPrefix, _attend, _attend_matmul, _decode_attention
from tests.engine.model.test_kernel_reference import BF16_EPS, assert_matches_fp64, attention_fp64

HEADS, KV_HEADS, DIM = 6, 2, 16
CHUNK = paged_decode_cpu.CHUNK
# a planted key's score over the others' (which stay within about +-10): past float32's exp range (88.7), so a
# softmax or merge whose maximum misses it overflows instead of cancelling out
SPIKE = 120.0
ALONG = 4.0  # every query's component along the spike's direction


def _padded(rests):
    """Slots, lengths and padding bias of a decode batch whose rows read `rests`."""
    slots = torch.nn.utils.rnn.pad_sequence(rests, batch_first=True)
    lengths = torch.tensor([len(r) for r in rests])
    padding = torch.arange(slots.shape[1])[None, :] >= lengths[:, None]
    return slots, lengths, torch.zeros(padding.shape).masked_fill(padding, float("-inf"))[:, None, None]


def _direction(dim: int, gen: torch.Generator) -> torch.Tensor:
    direction = torch.randn(dim, generator=gen)
    return direction / direction.norm()


def _queries(rows: int, dim: int, direction: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Queries ALONG `direction` plus noise across it: a key along `direction` gets the same score from all."""
    noise = torch.randn(rows, HEADS, dim, generator=gen)
    noise -= (noise @ direction)[..., None] * direction
    return ALONG * direction + noise


def _key_scoring(score: float, direction: torch.Tensor) -> torch.Tensor:
    """The key that every query of _queries scores `score`."""
    return direction * (score * direction.numel() ** 0.5 / ALONG)


@pytest.fixture(params=[True, False], ids=["paged kernel", "gather + sdpa"])
def decode_path(request) -> bool:
    """Runs a test through the paged CPU kernel (True: DecodeBatch.paged_kernel) and through the plain path."""
    return request.param


def test_cascade_decode_equals_plain_attention(decode_path):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    shared = torch.arange(0, 12)  # three blocks every sequence shares
    rests = [torch.arange(12, 15), torch.arange(20, 27), torch.arange(40, 41)]
    contexts = [torch.cat([shared, r]) for r in rests]
    q = torch.randn(3, HEADS, DIM)
    slots, lengths, mask = _padded(rests)
    batch = DecodeBatch(torch.arange(3), slots, lengths, mask, [SharedPrefix(torch.arange(3), shared)], decode_path)
    assert_matches_fp64(_decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5), q, k_cache, v_cache, contexts,
                        DIM ** -0.5)
    # the same sequences without a shared part take the plain path
    slots, lengths, mask = _padded(contexts)
    plain = DecodeBatch(torch.arange(3), slots, lengths, mask, [], decode_path)
    assert_matches_fp64(_decode_attention(q, k_cache, v_cache, plain, DIM ** -0.5), q, k_cache, v_cache, contexts,
                        DIM ** -0.5)


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
    assert_matches_fp64(_decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5), q, k_cache, v_cache, contexts,
                        DIM ** -0.5)


def test_fused_cpu_kernel_and_plain_matmuls_agree():
    """The CPU path (torch's fused kernel) and the path other devices take give the same output and lse."""
    torch.manual_seed(2)
    q, k, v = torch.randn(3, HEADS, 2, DIM), torch.randn(3, 5, KV_HEADS, DIM), torch.randn(3, 5, KV_HEADS, DIM)
    bias = torch.zeros(3, 1, 1, 5)
    bias[1, ..., 3:] = float("-inf")
    fused = _attend(q, k.transpose(1, 2), v.transpose(1, 2), bias, 0.3)
    plain = _attend_matmul(q, k.transpose(1, 2), v.transpose(1, 2), bias, 0.3)
    torch.testing.assert_close(fused, plain)


@pytest.mark.slow
def test_cascade_decode_in_bfloat16_keeps_the_dtype(decode_path):
    torch.manual_seed(3)
    k_cache = torch.randn(32, KV_HEADS, DIM).bfloat16()
    v_cache = torch.randn(32, KV_HEADS, DIM).bfloat16()
    q = torch.randn(2, HEADS, DIM).bfloat16()
    rests = [torch.arange(8, 10), torch.arange(12, 15)]
    slots, lengths, bias = _padded(rests)
    batch = DecodeBatch(torch.arange(2), slots, lengths, bias.bfloat16(),
                        [SharedPrefix(torch.arange(2), torch.arange(0, 8))], decode_path)
    out = _decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    contexts = [torch.cat([torch.arange(0, 8), r]) for r in rests]
    if decode_path:
        assert_matches_fp64(out, q, k_cache, v_cache, contexts, DIM ** -0.5)
    else:  # torch computes in bfloat16: each partial output and their merge are rounded, by up to BF16_EPS of |V|
        expected, _ = attention_fp64(q, k_cache, v_cache, contexts, DIM ** -0.5)
        atol = 3 * BF16_EPS * float(v_cache.abs().max())
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)


def _scattered(lengths: list[int], num_blocks: int, block_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Slots of contexts of these lengths over random blocks of the cache, each ending mid-block."""
    contexts = []
    for length in lengths:
        blocks = torch.randperm(num_blocks, generator=gen)[:-(-length // block_size)]
        contexts.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length])
    return contexts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("dim", [DIM, 64, 128])  # 64 and 128 have their own compiled copies of a chunk
def test_paged_kernel_over_long_ragged_contexts(batch_size, dtype, dim):
    """Contexts over scattered blocks, split over several chunks, with every key weighing in (scores within
    about +-10)."""
    gen = torch.Generator().manual_seed(4)
    k_cache = (torch.randn(1024, KV_HEADS, dim, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(1024, KV_HEADS, dim, generator=gen).to(dtype)
    lengths = torch.randint(1, 3 * CHUNK, (batch_size,), generator=gen).tolist()
    contexts = _scattered(lengths, 64, 16, gen)
    slots, lengths, _ = _padded(contexts)
    q = torch.randn(batch_size, HEADS, dim, generator=gen).to(dtype)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5)
    assert out.dtype == dtype
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64])
def test_paged_kernel_cascade_over_long_shared_prefixes(dtype, dim):
    """Two cascade groups whose shared prefixes span several chunks, and a row in no group: each row gets
    plain attention over its whole context."""
    gen = torch.Generator().manual_seed(5)
    k_cache = (torch.randn(2048, KV_HEADS, dim, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(2048, KV_HEADS, dim, generator=gen).to(dtype)
    prefix_a = torch.arange(0, 2 * CHUNK + 16)
    prefix_b = torch.arange(600, 600 + CHUNK)
    rests = [torch.arange(1000, 1003), torch.arange(1100, 1400), torch.arange(1500, 1501), torch.arange(1600, 1620),
             torch.arange(1700, 1710)]
    groups = [SharedPrefix(torch.tensor([0, 1, 4]), prefix_a), SharedPrefix(torch.tensor([3, 2]), prefix_b)]
    contexts = [torch.cat([prefix_a, rests[0]]), torch.cat([prefix_a, rests[1]]), torch.cat([prefix_b, rests[2]]),
                torch.cat([prefix_b, rests[3]]), torch.cat([prefix_a, rests[4]])]
    contexts.append(torch.arange(1800, 2000))  # in no group
    rests.append(contexts[-1])
    q = torch.randn(len(rests), HEADS, dim, generator=gen).to(dtype)
    slots, lengths, _ = _padded(rests)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5, groups)
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64, 128])
def test_a_spike_anywhere_in_a_rows_context_is_its_output(dim, dtype):
    """Contexts of 37 slots (one chunk with a tail past its last 16 keys), 2 * MIN_OWN_CHUNK + 37 (shorter than a
    chunk, split in two halves of 83 and 82), CHUNK + 1 (two chunks, 129 + 128) and 2 * CHUNK + 37 (a first, a
    middle and a last chunk of 183, each with a tail), one row for every position of each, whose key there scores
    SPIKE. Each row's spike has a value of its own, so rows that swap outputs differ too."""
    gen = torch.Generator().manual_seed(10)
    lengths = [37, 2 * paged_decode_cpu.MIN_OWN_CHUNK + 37, CHUNK + 1, 2 * CHUNK + 37]
    pool, rows = sum(lengths), sum(lengths)  # base slots (each length its own), then one spike slot per row
    direction = _direction(dim, gen)
    k_cache = torch.randn(pool + rows, KV_HEADS, dim, generator=gen)
    k_cache[pool:] = _key_scoring(SPIKE, direction)
    v_cache = torch.randn(pool + rows, KV_HEADS, dim, generator=gen)
    bases = torch.randperm(pool, generator=gen).split(lengths)
    contexts = []
    for base in bases:
        for position in range(len(base)):
            context = base.clone()
            context[position] = pool + len(contexts)
            contexts.append(context)
    q, k_cache, v_cache = _queries(rows, dim, direction, gen).to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    slots, lengths, _ = _padded(contexts)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5)
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64, 128])
@pytest.mark.parametrize("members", [2, 3, 4])
def test_a_spike_anywhere_in_a_cascade_context_is_its_output(members, dim, dtype):
    """Cascade groups of `members` rows: a shared prefix of 172 slots, then 21 of each row's own (16 keys and a
    tail). The prefix's chunks are CHUNK // members slots, 64 at the least: 128 + 44, 85 + 85 + 2, 64 + 64 + 44;
    at head size 64 and 128 a group of 4 (12 queries a kv head) takes the matmul form, whose tiles are 32 keys.
    One group for each position of prefix + own slots, the key there scoring SPIKE: the prefix's last slot, the
    first own slot after it and every chunk and tile edge among them."""
    gen = torch.Generator().manual_seed(11)
    prefix_length, own_length = 172, 21
    positions = prefix_length + own_length
    # base slots: the prefix, each member's own; then one spike slot per group
    pool = prefix_length + members * own_length
    direction = _direction(dim, gen)
    k_cache = torch.randn(pool + positions, KV_HEADS, dim, generator=gen)
    k_cache[pool:] = _key_scoring(SPIKE, direction)
    v_cache = torch.randn(pool + positions, KV_HEADS, dim, generator=gen)
    base_prefix, *base_own = torch.randperm(pool, generator=gen).split([prefix_length] + [own_length] * members)
    groups, rests, contexts = [], [], []
    for position in range(positions):
        prefix, own = base_prefix.clone(), [rest.clone() for rest in base_own]
        if position < prefix_length:
            prefix[position] = pool + position
        else:
            for rest in own:
                rest[position - prefix_length] = pool + position
        groups.append(SharedPrefix(torch.arange(len(rests), len(rests) + members), prefix))
        rests += own
        contexts += [torch.cat([prefix, rest]) for rest in own]
    q = _queries(len(rests), dim, direction, gen).to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    slots, lengths, _ = _padded(rests)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5, groups)
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64, 128])
@pytest.mark.parametrize("scores", ["spread over hundreds", "all near -1000"])
def test_scores_of_large_magnitude(scores, dim, dtype):
    """Keys 30 times larger, so that scores spread over hundreds and chunk maxima lie far apart everywhere; or
    every score near -1,000, where a maximum started from 0 rather than from a score loses every exponential.
    A group in the matmul form (5 rows), one in the plain loops (2 rows), rows of their own over several chunks."""
    gen = torch.Generator().manual_seed(12)
    direction = _direction(dim, gen)
    q = _queries(9, dim, direction, gen)
    k_cache = torch.randn(2048, KV_HEADS, dim, generator=gen)
    if scores == "spread over hundreds":
        k_cache *= 30
    else:
        k_cache += _key_scoring(-1000.0, direction)
    v_cache = torch.randn(2048, KV_HEADS, dim, generator=gen)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    prefixes = _scattered([300, 200], 32, 16, gen)
    rests = [torch.arange(600, 600 + n) for n in (1, 17, 40, 300, 5, 2, 33)]
    rests += [torch.arange(1000, 1000 + CHUNK + 1), torch.arange(1300, 1300 + 2 * CHUNK + 37)]
    groups = [SharedPrefix(torch.arange(0, 5), prefixes[0]), SharedPrefix(torch.arange(5, 7), prefixes[1])]
    contexts = [torch.cat([prefixes[0], r]) for r in rests[:5]] + [torch.cat([prefixes[1], r]) for r in rests[5:7]]
    contexts += rests[7:]
    slots, lengths, _ = _padded(rests)
    out = paged_decode_cpu.paged_decode(q, k_cache, v_cache, slots, lengths, dim ** -0.5, groups)
    assert torch.all(torch.isfinite(out))
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


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
    slots, lengths, mask = _padded(rests)
    batch = DecodeBatch(torch.arange(3), slots, lengths, mask, [SharedPrefix(torch.tensor([0, 1]), shared)],
                        decode_path)
    out = _decode_attention(q, k_cache, v_cache, batch, DIM ** -0.5)
    assert out.dtype == torch.float32
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, DIM ** -0.5)


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
            out[i] = paged_decode_loops.fast_exp(xs[i])
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
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads, members", [(6, 2, 4), (6, 2, 11), (4, 4, 12), (8, 2, 5), (12, 1, 2)])
def test_large_cascade_groups_take_the_matmul_path_and_agree(heads, kv_heads, members, dim, dtype):
    """A group with at least CASCADE_QUERIES queries per kv head is scored and weighted as two matmuls per
    chunk (_cascade): several row groups of the microkernel, chunks whose length is no multiple of 16 or 32,
    a prefix of scattered blocks, a row outside the group, and K/V in float32 and bfloat16."""
    assert members * heads // kv_heads >= paged_decode_loops.CASCADE_QUERIES
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
    assert_matches_fp64(out, q, k_cache, v_cache, contexts, dim ** -0.5)


def test_tasks_are_dealt_so_both_threads_get_own_chunks_beside_the_cascade():
    """8 rows sharing 960 slots (15 cascade tasks of 64 slots, the matmul form) and 40 own slots each
    (8 plain tasks): a plain row-slot is dealt as PLAIN_COST cascade ones, so the own chunks do not all
    land on one thread. Every task is dealt once."""
    rows, per_kv, dim = 8, 3, 64
    plan = paged_decode_cpu.plan(np.full(rows, 40, np.int64), np.zeros(rows, np.int64), np.array([960], np.int64),
                                 2, per_kv, dim)
    source, by_bin, bin_first = plan[1], plan[7], plan[8]
    assert sorted(by_bin) == list(range(len(source)))
    own_per_bin = [int((source[by_bin[bin_first[b]:bin_first[b + 1]]] < rows).sum()) for b in range(2)]
    assert sum(own_per_bin) == rows and min(own_per_bin) >= 2


@pytest.mark.parametrize("length, chunks", [
    (2 * paged_decode_cpu.MIN_OWN_CHUNK - 1, [(0, 127)]),
    (2 * paged_decode_cpu.MIN_OWN_CHUNK, [(0, 64), (64, 128)]),
    (201, [(0, 101), (101, 201)]),
    (CHUNK + 1, [(0, 129), (129, 257)]),
    (968, [(0, 242), (242, 484), (484, 726), (726, 968)]),
    (4 * CHUNK - 1, [(0, 256), (256, 512), (512, 768), (768, 1023)]),
])
def test_a_short_context_is_attended_in_two_halves(length, chunks):
    """A batch-1 row's own context shorter than a chunk, from 2 * MIN_OWN_CHUNK slots on, makes two tasks, one
    for each thread; longer contexts make as many tasks as chunks of CHUNK slots would, of equal size. The split
    depends on the length alone: the same with one thread or a batch beside it."""
    for rows, threads in [(1, 2), (1, 1), (3, 2)]:
        plan = paged_decode_cpu.plan(np.full(rows, length, np.int64), np.full(rows, -1, np.int64),
                                     np.zeros(0, np.int64), threads, 3, 64)
        source, chunk_start, chunk_end = plan[1], plan[2], plan[3]
        assert [(int(s), int(e)) for s, e in zip(chunk_start[source == 0], chunk_end[source == 0])] == chunks
