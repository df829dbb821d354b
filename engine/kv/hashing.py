"""Chained block hashes: hash(block i) = H(hash(block i-1), tokens of block i, extra keys)."""
from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from typing import NewType

import xxhash

from engine.config import HashAlgo

BlockHash = NewType("BlockHash", bytes)

ROOT_PARENT = b""  # parent of block 0


_HEADER = struct.Struct("<III")


@lru_cache(maxsize=64)
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")  # compiled once per block size: parsing the format dominated


def _encode(parent: bytes, token_ids: tuple[int, ...], extra_keys: tuple[str, ...]) -> bytes:
    # canonical bytes: lengths first, so no two inputs share an encoding
    header = _HEADER.pack(len(parent), len(token_ids), len(extra_keys))
    tokens = _tokens_struct(len(token_ids)).pack(*token_ids)
    extras = b"".join(struct.pack("<I", len(k)) + k.encode() for k in extra_keys)
    return header + parent + tokens + extras


def hash_block(parent: bytes, token_ids: tuple[int, ...], extra_keys: tuple[str, ...],
               algo: HashAlgo = HashAlgo.SHA256) -> BlockHash:
    data = _encode(parent, token_ids, extra_keys)
    if algo is HashAlgo.XXHASH:
        return BlockHash(xxhash.xxh3_128_digest(data))
    return BlockHash(hashlib.sha256(data).digest())


def hash_full_blocks(token_ids: list[int], block_size: int, *, start_block: int = 0,
                     parent: bytes = ROOT_PARENT, cache_salt: str | None = None,
                     algo: HashAlgo = HashAlgo.SHA256) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`."""
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        # NOTE: the salt enters block 0 only; the chain carries it to every later block.
        extra = (cache_salt,) if i == 0 and cache_salt else ()
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra, algo)
        hashes.append(parent)
    return hashes
