"""The float64 reference the CPU attention kernels are tested against, and checks of the reference itself
against closed forms. Plain PyTorch (gather by slots, scores, softmax, weighted sum): no numba, no SDPA,
nothing the kernels share."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP32_EPS = 2.0 ** -23
BF16_EPS = 2.0 ** -8  # bfloat16 keeps 8 significant bits: its rounding moves a value by up to this, relative
ROWS_AT_ONCE = 64  # rows the reference gathers at once (bounds its memory at long contexts)


def attention_fp64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   contexts: Sequence[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention in float64 of q [B, H, D] over the K/V [num_slots, KVH, D] at each row's slots
    contexts[b] (in order; query head h reads kv head h // (H // KVH)). Returns the output [B, H, D] (zeros for
    an empty context) and each row's largest score magnitude [B]."""
    rows, heads, dim = q.shape
    per_kv = heads // k_cache.shape[1]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    largest = torch.zeros(rows, dtype=torch.float64)
    lengths = torch.tensor([len(c) for c in contexts])
    for first in range(0, rows, ROWS_AT_ONCE):
        batch = range(first, min(first + ROWS_AT_ONCE, rows))
        longest = int(lengths[first:batch.stop].max())
        if longest == 0:
            continue
        slots = torch.zeros(len(batch), longest, dtype=torch.long)
        for i, b in enumerate(batch):
            slots[i, :len(contexts[b])] = contexts[b]
        padding = torch.arange(longest)[None, :] >= lengths[first:batch.stop, None]  # [rows, S]
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # [rows, S, KVH, D]
        grouped = q[first:batch.stop].double().view(len(batch), -1, per_kv, dim)  # [rows, KVH, per_kv, D]
        scores = torch.einsum("bgpd,bsgd->bgps", grouped, keys).flatten(1, 2) * scale  # [rows, H, S]
        largest[first:batch.stop] = scores.abs().masked_fill(padding[:, None], 0).amax(dim=(1, 2))
        scores = scores.masked_fill(padding[:, None], -math.inf)
        top = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # (a row with no slots: all -inf)
        weights = torch.exp(scores - top)
        summed = weights.sum(dim=-1, keepdim=True)
        weights = (weights / summed.clamp(min=1e-300)).view(len(batch), -1, per_kv, longest)
        out[first:batch.stop] = torch.einsum("bgps,bsgd->bgpd", weights, values).flatten(1, 2)
    return out, largest


def fp32_atol(values: torch.Tensor, largest_score: torch.Tensor) -> torch.Tensor:
    """What float32 arithmetic honestly owes the float64 reference, per row: 4e-6 of the values' scale for the
    weighted sum over up to ~1,000 keys and the exponentials (fast_exp: 1e-6 at worst), plus the rounding of the
    scores, which moves every softmax weight by as much, relative, as a score is off: about 2 eps |s| after the
    scaling and the D products (measured here: at most 0.44 eps |s|, and 9e-7 of the values' scale in all at
    scores within +-15)."""
    return values.abs().max() * (4e-6 + 2 * FP32_EPS * largest_score)


def assert_matches_fp64(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        contexts: Sequence[torch.Tensor], scale: float) -> None:
    """out (float32 or bfloat16) against attention_fp64 of the very inputs it was computed from (bfloat16
    inputs are exact in float64): float32 to fp32_atol; bfloat16 also to the one rounding of the output to
    bfloat16 (the kernel computes in float32), by up to BF16_EPS of its magnitude."""
    expected, largest = attention_fp64(q, k_cache, v_cache, contexts, scale)
    atol = fp32_atol(v_cache.double(), largest)[:, None, None]
    if out.dtype == torch.bfloat16:
        atol = atol + BF16_EPS * expected.abs()
    error = (out.double() - expected).abs()
    worst = int((error - atol).flatten(1).amax(dim=1).argmax())
    assert torch.all(error <= atol), (f"row {worst}: off by {float(error[worst].max()):.3g} against a tolerance of "
                                      f"{float(atol[worst].min()):.3g} (largest score {float(largest[worst]):.1f})")


def test_one_key_gives_its_value_and_no_key_gives_zeros():
    v_cache = torch.randn(4, 2, 8)
    q, k_cache = torch.randn(2, 4, 8), torch.randn(4, 2, 8)
    out, _ = attention_fp64(q, k_cache, v_cache, [torch.tensor([3]), torch.tensor([], dtype=torch.long)], 0.5)
    assert torch.equal(out[0], v_cache[3].double().repeat_interleave(2, dim=0))
    assert torch.equal(out[1], torch.zeros(4, 8, dtype=torch.float64))


def test_two_keys_are_weighted_by_the_softmax_of_their_scores_per_kv_head():
    """Query heads 0 and 1 read kv head 0, heads 2 and 3 kv head 1 (h // per_kv, not h % KVH)."""
    k_cache = torch.zeros(2, 2, 2)
    k_cache[0, 0, 0], k_cache[1, 0, 0] = 1.0, -1.0  # kv head 0: q . k = +-q[0]
    k_cache[:, 1, 1] = 1.0  # kv head 1: both keys alike
    v_cache = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 3.0]]])
    q = torch.tensor([[[3.0, 0.0], [-50.0, 0.0], [0.0, 7.0], [0.0, -7.0]]])
    out, largest = attention_fp64(q, k_cache, v_cache, [torch.tensor([0, 1])], 0.5)
    first = 1 / (1 + math.exp(-3.0))  # head 0: the weight of slot 0, softmax of (1.5, -1.5)
    assert torch.allclose(out[0, 0], torch.tensor([2 - first, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(out[0, 1], torch.tensor([2.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)  # -25, 25
    assert torch.equal(out[0, 2], torch.tensor([0.0, 2.0], dtype=torch.float64)) and torch.equal(out[0, 3], out[0, 2])
    assert largest[0] == 25.0


def test_scores_far_past_float32s_exp_range_stay_finite():
    q = torch.full((1, 1, 4), 100.0)
    k_cache = torch.stack([torch.full((1, 4), 10.0), torch.full((1, 4), -10.0), torch.full((1, 4), 9.0)])
    v_cache = torch.arange(1.0, 4.0)[:, None, None].expand(3, 1, 4).contiguous()
    out, largest = attention_fp64(q, k_cache, v_cache, [torch.tensor([0, 1, 2])], 1.0)
    assert largest[0] == 4000.0  # scores 4000, -4000, 3600: slot 0 alone counts (e^-400 of slot 2)
    assert torch.allclose(out[0, 0], torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-150)
