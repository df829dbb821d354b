"""The runner's batch building: which chunks are decodes, and which decodes share leading blocks."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.kv.slot_table import SlotTable
from engine.request import Request
from engine.runner import _is_decode


def test_a_one_token_prefill_chunk_is_not_a_decode():
    request = Request("r", [1, 2, 3], SamplingParams())
    request.num_computed_tokens = 2  # the last prompt token is left: a prefill chunk of one token
    assert not _is_decode(request, 2, 3)
    request.num_computed_tokens = 3
    request.all_token_ids.append(7)
    request.output_token_ids.append(7)
    assert _is_decode(request, 3, 4)


def contexts(*seqs: tuple[list[int], int]) -> list:
    """Each (block ids, context length) as the runner reads it: the context's slots, blocks of 4."""
    slots = []
    for block_ids, end in seqs:
        table = SlotTable(4)
        table.append_blocks(block_ids)
        slots.append(table.slots[:end])
    return slots


def test_decodes_are_grouped_by_shared_prefix_and_an_outsider_keeps_cascade_on(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64)
    runner = llm.core.runner
    # block ids as the KV manager hands them out: rows 0 and 2 share blocks 10, 11; row 1 shares nothing
    seqs = contexts(([10, 11, 12], 11), ([20, 21], 6), ([10, 11, 13, 14], 15), ([30], 3))
    shared, rest_starts = runner._shared_prefixes(seqs)
    assert [(g.rows.tolist(), g.slots.tolist()) for g in shared] == [([0, 2], list(range(40, 48)))]
    assert rest_starts == [8, 0, 8, 0]


def test_shared_prefix_stops_before_each_sequences_newest_token(tiny_llama_dir):
    runner = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64).core.runner
    # the same three blocks, but the second sequence's newest token sits in block 2
    shared, rest_starts = runner._shared_prefixes(contexts(([1, 2, 3], 12), ([1, 2, 3], 9)))
    assert [g.slots.tolist() for g in shared] == [list(range(4, 12))]
    assert rest_starts == [8, 8]


def test_slots_of_a_chunk_that_starts_mid_block():
    """Positions 6..10 over blocks [5, 2, 8] of 4 slots: the rest of block 2, then block 8's first three."""
    table = SlotTable(4)
    table.append_blocks([5, 2, 8])
    assert table.slots[6:11].tolist() == [10, 11, 32, 33, 34]
    assert table.slots[0:5].tolist() == [20, 21, 22, 23, 8]


def test_a_slice_of_a_slot_table_keeps_its_slots_as_the_table_grows():
    table = SlotTable(2)
    table.append_blocks([3])
    before = table.slots
    for block_id in range(4, 40):  # past several doublings of its room
        table.append_blocks([block_id])
    assert before.tolist() == [6, 7]
    assert table.slots.tolist() == [s for b in range(3, 40) for s in (2 * b, 2 * b + 1)]
    table.append_blocks([])
    assert table.size == 74


def test_tensors_of_positions(tiny_llama_dir):
    runner = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=16, cpu_kernels="eager").core.runner
    assert runner._tensor([3, 1]).tolist() == [3, 1] and runner._tensor([]).tolist() == []
