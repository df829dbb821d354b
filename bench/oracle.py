"""The oracle: an infinite prefix cache that computes every distinct block (hash chain) once."""
from __future__ import annotations

from collections.abc import Iterable

from engine.kv.hashing import hash_full_blocks


def oracle_prefill_tokens(prompts: Iterable[list[int]], block_size: int) -> int:
    """Prefill tokens an infinite cache computes for these prompts, in this order.

    Each prompt computes its full blocks whose hash chain no earlier prompt had, plus its tail.
    Like the engine, a hit covers at most len(prompt) - 1 tokens (the last token's logits give the
    first output token), so a prompt made only of known full blocks recomputes its last block.
    """
    seen: set[bytes] = set()
    total = 0
    for prompt in prompts:
        hashes = hash_full_blocks(prompt, block_size)
        max_hit = (len(prompt) - 1) // block_size
        hit = 0
        # chained hashes: a known block implies its whole prefix is known too
        while hit < min(len(hashes), max_hit) and hashes[hit] in seen:
            hit += 1
        total += len(prompt) - hit * block_size
        seen.update(hashes)
    return total
