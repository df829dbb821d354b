"""Weights and the KV pool in mappings advised for huge pages: the same values, the mapping kept alive by its
tensors, and (where Linux grants transparent huge pages on madvise) a mapping the kernel may back with them."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from engine import LLM, SamplingParams
from engine.model import huge_pages
from tests.support.tiny_gguf import write_gguf_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")


def _mapping_of(tensor: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds the tensor's first byte."""
    address, fields, found = tensor.data_ptr(), {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if found:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            found = start <= address < end
            fields = {"range": head}
        elif found:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert found, "no mapping holds the tensor"
    return fields


def _huge_pages_on_madvise() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def test_copies_hold_the_same_values_in_one_mapping_that_outlives_the_originals():
    originals = [torch.randn(3, 5), torch.arange(10, dtype=torch.int16), torch.randn(4, 4).bfloat16(),
                 torch.empty(0, 3, dtype=torch.int16), torch.randint(0, 255, (7, 3, 16), dtype=torch.uint8)]
    expected = [t.clone() for t in originals]
    arena = huge_pages.Arena(originals)
    copies = [arena.place(t) for t in originals]
    del originals, arena
    gc.collect()
    for copy, want in zip(copies, expected):
        assert copy.dtype == want.dtype and copy.shape == want.shape and torch.equal(copy, want)
    filled = [c for c in copies if c.numel()]
    assert all(c.data_ptr() % huge_pages.ALIGN == 0 for c in filled)
    assert len({_mapping_of(c)["range"] for c in filled}) == 1
    copies[0].add_(1)  # writable, and its own memory
    assert torch.equal(copies[0], expected[0] + 1)


def test_the_mapping_is_advised_for_huge_pages():
    zeros = huge_pages.zeros((3, 2 << 20), torch.bfloat16)  # 12 MB
    assert zeros.shape == (3, 2 << 20) and zeros.dtype == torch.bfloat16 and not zeros.any()
    fields = _mapping_of(zeros)
    assert int(fields["Rss"].split()[0]) >= 12 << 10  # every page written at once, as torch.zeros does
    if _huge_pages_on_madvise():
        assert fields["THPeligible"] == "1"


def test_a_quantized_models_tiles_and_kv_pool_live_in_advised_mappings(tiny_llama_dir, tmp_path):
    """The loader moves every quantized tile into one mapping (a tied embedding keeps sharing the lm_head's), and
    the engine's CPU KV pool has a mapping of its own."""
    gguf_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType.Q8_0 if "embd" in name
                                else QType.Q4_1)
    llm = LLM(str(gguf_dir), block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
    model = llm.core.model
    tiles = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    assert tiles and model.lm_head.quant is model.model.embed_tokens.quant
    assert len({_mapping_of(t)["range"] for q in tiles for t in (q.data, q.scales, q.mins) if t.numel()}) == 1
    if _huge_pages_on_madvise():
        assert _mapping_of(tiles[0].data)["THPeligible"] == "1"
        assert _mapping_of(llm.core.runner.kv_slots)["THPeligible"] == "1"
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))[0].token_ids) == 4


def test_an_arena_refuses_more_than_it_was_sized_for():
    arena = huge_pages.Arena([torch.zeros(10)])
    arena.place(torch.ones(10))
    with pytest.raises(ValueError, match="holds"):
        arena.place(torch.ones(1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_models_packed_tiles_live_in_one_advised_mapping(dtype, tiny_llama_dir):
    """The packed float tiles move as the quantized ones do; the tied embedding reads its rows from the
    lm_head's moved tiles."""
    llm = LLM(str(tiny_llama_dir), dtype=dtype, block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
    model = llm.core.model
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert packed and model.model.embed_tokens.tiles is model.lm_head.packed
    assert len({_mapping_of(t)["range"] for t in packed}) == 1
    if _huge_pages_on_madvise():
        assert _mapping_of(packed[0])["THPeligible"] == "1"
