"""Chained block hashes: determinism, chaining, the cache salt, canonical encoding, cross-tenant isolation."""
from __future__ import annotations

import hashlib

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import HashAlgo
from engine.kv.hashing import ROOT_PARENT, hash_block, hash_full_blocks

BS = 16
TOKENS = list(range(100, 164))  # 4 full blocks


def reference_hash(parent: bytes, token_ids, extra_keys=(), algo: HashAlgo = HashAlgo.SHA256) -> bytes:
    """The documented canonical encoding, written out independently of engine/kv/hashing.py: three
    little-endian uint32 counts (parent bytes, tokens, extra keys), the parent hash, each token as a
    signed little-endian int64, then each extra key as a uint32 length (in characters) and its UTF-8 bytes."""
    data = b"".join(n.to_bytes(4, "little") for n in (len(parent), len(token_ids), len(extra_keys))) + parent
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    data += b"".join(len(k).to_bytes(4, "little") + k.encode("utf-8") for k in extra_keys)
    return xxhash.xxh3_128(data).digest() if algo is HashAlgo.XXHASH else hashlib.sha256(data).digest()


def reference_chain(tokens: list[int], salt: str | None = None, algo: HashAlgo = HashAlgo.SHA256) -> list[bytes]:
    hashes, parent = [], b""
    for i in range(len(tokens) // BS):
        extras = (salt,) if i == 0 and salt else ()
        parent = reference_hash(parent, tokens[i * BS:(i + 1) * BS], extras, algo)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("salt", [None, "tenant-a", "é-ünïcode-salt"])
def test_block_hashes_follow_the_canonical_encoding(algo, salt):
    hashes = hash_full_blocks(TOKENS, BS, cache_salt=salt, algo=algo)
    assert hashes == reference_chain(TOKENS, salt, algo)
    assert len(set(hashes)) == 4  # the four blocks differ from each other


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("parent, tokens, extras", [
    (b"", (1, 2, 3), ()), (b"parent", (-1, 2**63 - 1, 0), ()), (b"\x00" * 32, (5,), ("a", "", "bc")),
])
def test_hash_block_follows_the_canonical_encoding(algo, parent, tokens, extras):
    assert hash_block(parent, tokens, extras, algo) == reference_hash(parent, tokens, extras, algo)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_each_hash_chains_on_its_parent(algo):
    hashes = hash_full_blocks(TOKENS, BS, algo=algo)
    parent = ROOT_PARENT
    for i, block_hash in enumerate(hashes):
        assert block_hash == reference_hash(parent, TOKENS[i * BS:(i + 1) * BS], (), algo)
        parent = block_hash
    # the same tokens under another parent hash differently
    assert hash_block(hashes[0], tuple(TOKENS[BS:2 * BS]), (), algo) != hash_block(
        hashes[1], tuple(TOKENS[BS:2 * BS]), (), algo)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_a_changed_block_changes_it_and_every_later_hash(algo):
    changed = list(TOKENS)
    changed[BS + 3] += 1  # inside block 1
    a, b = hash_full_blocks(TOKENS, BS, algo=algo), hash_full_blocks(changed, BS, algo=algo)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_start_block_and_parent_continue_the_chain(algo):
    full = hash_full_blocks(TOKENS, BS, cache_salt="s", algo=algo)
    rest = hash_full_blocks(TOKENS, BS, start_block=2, parent=full[1], cache_salt="s", algo=algo)
    assert rest == full[2:]


def test_partial_blocks_are_not_hashed():
    assert hash_full_blocks(TOKENS[:15], BS) == []
    assert len(hash_full_blocks(TOKENS[:16], BS)) == 1
    assert len(hash_full_blocks(TOKENS[:47], BS)) == 2
    assert hash_full_blocks(TOKENS[:47], BS) == hash_full_blocks(TOKENS[:32], BS)


def test_a_different_salt_changes_every_block():
    plain = hash_full_blocks(TOKENS, BS)
    a = hash_full_blocks(TOKENS, BS, cache_salt="tenant-a")
    b = hash_full_blocks(TOKENS, BS, cache_salt="tenant-b")
    for i in range(4):
        assert len({plain[i], a[i], b[i]}) == 3


def test_the_salt_enters_block_zero_only_and_the_chain_carries_it():
    salted = hash_full_blocks(TOKENS, BS, cache_salt="tenant-a")
    assert salted[0] == reference_hash(ROOT_PARENT, TOKENS[:BS], ("tenant-a",))
    for i in range(1, 4):  # later blocks have no extra keys of their own: only the parent carries the salt
        assert salted[i] == reference_hash(salted[i - 1], TOKENS[i * BS:(i + 1) * BS], ())


@pytest.mark.parametrize("extras, algo, pinned", [
    ((), HashAlgo.SHA256, "e850be1400f5de8cdc5334d06914d1bd7c57e943e285c8e32eef9c7f8824d48a"),
    (("tenant-a",), HashAlgo.SHA256, "f20f6d46315ca02b09082762b67479da7ccd947174a010d7382ae7f257f8a35e"),
    ((), HashAlgo.XXHASH, "3dc8993d370d36cc9213ce9bc35ff8ae"),
])
def test_pinned_hashes_are_those_of_the_canonical_encoding(extras, algo, pinned):
    # the encoding must not change silently (hashes are exported for prefix-aware routing)
    assert reference_hash(b"", (1, 2, 3), extras, algo).hex() == pinned
    assert hash_block(b"", (1, 2, 3), extras, algo).hex() == pinned


def test_sha256_and_xxhash_differ():
    assert hash_full_blocks(TOKENS, BS) != hash_full_blocks(TOKENS, BS, algo=HashAlgo.XXHASH)


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("a, b", [
    ((b"", (1, 23), ()), (b"", (12, 3), ())),  # digits do not run together
    ((b"", (1, 2), ()), (b"", (1, 2, 0), ())),  # a trailing zero token counts
    ((b"", (256,), ()), (b"", (0, 1), ())),  # fixed-width tokens: no byte-level aliasing
    ((b"", (-1,), ()), (b"", (2**63 - 1,), ())),  # signed: -1 is not the largest token
    ((b"", (1,), ("ab",)), (b"", (1,), ("a", "b"))),  # extra keys are length-prefixed
    ((b"", (1,), ("",)), (b"", (1,), ())),
    ((b"\x01", (2,), ()), (b"", (1, 2), ())),  # the parent cannot be confused with tokens
    ((b"ab", (1,), ()), (b"a", (1,), ("b",))),
])
def test_canonical_encoding_keeps_distinct_inputs_apart(algo, a, b):
    assert hash_block(*a, algo) != hash_block(*b, algo)


salts = st.text(min_size=1, max_size=12)
token_lists = st.lists(st.integers(min_value=0, max_value=200_000), min_size=BS, max_size=6 * BS)


@pytest.mark.fuzz
@settings(max_examples=150, deadline=None)
@given(tokens_a=token_lists, tokens_b=token_lists, salt_a=salts, salt_b=salts | st.none(),
       algo=st.sampled_from(list(HashAlgo)))
def test_different_salts_never_share_a_block_hash(tokens_a, tokens_b, salt_a, salt_b, algo):
    if salt_a == salt_b:
        salt_b = salt_a + "x"
    a = hash_full_blocks(tokens_a, BS, cache_salt=salt_a, algo=algo)
    b = hash_full_blocks(tokens_b, BS, cache_salt=salt_b, algo=algo)
    b_same_tokens = hash_full_blocks(tokens_a, BS, cache_salt=salt_b, algo=algo)
    assert not set(a) & set(b)
    assert not set(a) & set(b_same_tokens)


@settings(max_examples=100, deadline=None)
@given(tokens=token_lists, extra=st.lists(st.integers(0, 1000), max_size=3 * BS), salt=salts | st.none())
def test_a_longer_prompt_extends_the_chain_of_its_prefix(tokens, extra, salt):
    aligned = tokens[:len(tokens) // BS * BS]
    assert hash_full_blocks(aligned + extra, BS, cache_salt=salt)[:len(aligned) // BS] == hash_full_blocks(
        aligned, BS, cache_salt=salt)
