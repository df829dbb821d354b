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
    first = start_block
    if first == 0 and cache_salt and len(token_ids) >= block_size:
        # NOTE: the salt enters block 0 only; the chain carries it to every later block.
        parent = hash_block(parent, tuple(token_ids[:block_size]), (cache_salt,), algo)
        hashes.append(parent)
        first = 1
    # the hot path (every admitted request): _encode inlined for blocks without extra keys
    digest = xxhash.xxh3_128_digest if algo is HashAlgo.XXHASH else _sha256_digest
    pack_tokens = _tokens_struct(block_size).pack
    for i in range(first, len(token_ids) // block_size):
        tokens = pack_tokens(*token_ids[i * block_size:(i + 1) * block_size])
        parent = BlockHash(digest(_HEADER.pack(len(parent), block_size, 0) + parent + tokens))
        hashes.append(parent)
    return hashes


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@lru_cache(maxsize=4096)
def tenant_tag(tenant: str | None) -> bytes:
    """8 bytes naming the tenant whose cache a block is (in RAM and in its file): a hash, so a block file does not
    spell out who it belongs to."""
    return bytes(8) if tenant is None else hashlib.blake2b(tenant.encode(), digest_size=8).digest()
