"""Prompts tokenized piece by piece between added tokens, the pieces' ids remembered: the same ids as the
tokenizer's own whole-text encode (a property over random texts of added tokens, their fragments, spaces,
newlines and composed and decomposed characters), which tokenizers qualify, and the LRU's bound."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from bench.tiny_models import build_tokenizer
from engine.piece_encoder import PieceEncoder, independent_pieces
from engine.tokenizer import HFTokenizer

FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|im_", "|>", "<",
             "tool_call>", " ", "  ", "\n", "\n\n", "\t", "hello", "world", "the capital", "é", "e\u0301", "你好", "😀",
             "'s", "123", "assistant", "user"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    """A byte-level BPE with special tokens and added non-special ones (Qwen's tool tags)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path, tools=True)
    return json.loads((path / "tokenizer.json").read_text())


def _pair(spec: dict) -> tuple[PieceEncoder, Tokenizer]:
    backend = Tokenizer.from_str(json.dumps(spec))
    whole = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    return PieceEncoder(spec, whole, max_chars=200), backend


@pytest.mark.parametrize("normalizer", [None, {"type": "NFC"}, {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}])
@settings(max_examples=50, deadline=None)
@given(batch=st.lists(texts, min_size=1, max_size=6))
def test_pieces_give_the_whole_texts_ids(spec, normalizer, batch):
    """Texts encoded one after another through one small LRU (hits, misses and evictions mixed): each the ids
    of the whole-text encode, under no normalizer and under Unicode-form normalizers (run on each piece)."""
    as_written = [dict(t, normalized=False) for t in spec["added_tokens"]]  # as Qwen2's tokenizer.json has them
    spec = {**spec, "normalizer": normalizer, "added_tokens": as_written if normalizer else spec["added_tokens"]}
    assert independent_pieces(spec)
    pieces, backend = _pair(spec)
    for text in batch + batch:
        assert pieces.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert pieces._chars <= pieces.max_chars


def test_tokenizers_whose_pieces_depend_on_their_place_encode_whole_texts(spec):
    assert independent_pieces(spec)
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}
    assert not independent_pieces({**spec, "pre_tokenizer": metaspace})
    assert not independent_pieces({**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [metaspace]}})
    assert not independent_pieces({**spec, "normalizer": {"type": "Lowercase"}})
    assert not independent_pieces({**spec, "normalizer": {"type": "Prepend", "prepend": "\u2581"}})
    stripped = [dict(t, lstrip=t["content"] == "<|im_end|>") for t in spec["added_tokens"]]
    assert not independent_pieces({**spec, "added_tokens": stripped})
    normalized = [dict(t, normalized=True) for t in spec["added_tokens"]]
    assert independent_pieces({**spec, "added_tokens": normalized})  # no normalizer: matched as written anyway
    assert not independent_pieces({**spec, "added_tokens": normalized, "normalizer": {"type": "NFC"}})


def test_a_chats_earlier_turns_are_looked_up_not_encoded_again(tmp_path):
    """The second turn of a chat (its history sent again) encodes only its new pieces: the system prompt and
    the first exchange are hits; the ids are the whole text's."""
    build_tokenizer(tmp_path)  # ChatML
    tokenizer = HFTokenizer(tmp_path, set())
    system = {"role": "system", "content": "You answer about caches. " * 200}
    first = [system, {"role": "user", "content": "What is a block?"}]
    second = first + [{"role": "assistant", "content": "A run of tokens."}, {"role": "user", "content": "A hit?"}]
    for messages in (first, second):
        text = tokenizer.apply_chat_template(messages)
        ids = tokenizer.encode(text)
        assert ids == tokenizer._encode_whole(text)
    pieces = tokenizer._pieces
    # first turn: the system and user pieces, the "\n" between messages (twice: a hit), "assistant\n"
    # second: those five again, two "\n" more and the new assistant and user pieces (the two misses)
    assert (pieces.misses, pieces.hits) == (6, 8)


def test_the_lru_keeps_the_recent_pieces_within_its_bound(spec):
    pieces, backend = _pair(spec)
    pieces.max_chars = 30
    for word in ("alpha " * 3, "beta " * 3, "gamma " * 3):  # 18, 15, 18 characters
        pieces.encode(word)
    assert list(pieces._cache) == ["gamma " * 3] and pieces._chars == 18
    assert pieces.encode("x" * 40) == backend.encode("x" * 40, add_special_tokens=False).ids  # longer than the bound
    assert "x" * 40 not in pieces._cache and pieces._chars == 18
