"""OpenAI response bodies and stream chunks for chat completions and (text) completions."""
from __future__ import annotations

import codecs
import time
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling import SampledToken
from gateway.generate import Choice


class ChatFormat:
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, tokenizer: Any) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer

    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self.object_name), "choices": [self.choice_body(c) for c in choices],
                "usage": usage}

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index,
                "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": self.logprobs(choice, choice.logprobs),
                "finish_reason": choice.finish_reason}

    def first_chunk(self, choices: list[Choice]) -> dict[str, Any] | None:
        return self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None} for c in choices])

    def delta_chunk(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not out.new_text and not out.new_logprobs:
            return None
        return self.chunk([{"index": choice.index, "delta": {"content": out.new_text},
                            "logprobs": self.logprobs(choice, out.new_logprobs),
                            "finish_reason": None}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        return self.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                            "finish_reason": choice.finish_reason}])

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self._head(self.chunk_name), "choices": choices, "usage": usage}

    def logprobs(self, choice: Choice, tokens: list[SampledToken] | None) -> dict[str, Any] | None:
        if choice.params.logprobs is None or not tokens:
            return None
        return {"content": [{**self._token(t.token_id, t.logprob),
                             "top_logprobs": [self._token(i, lp) for i, lp in t.top_logprobs or ()]}
                            for t in tokens]}

    def _token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        data = self.tokenizer.token_bytes(token_id)
        return {"token": token_string(data), "logprob": logprob, "bytes": list(data)}

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None}


class CompletionFormat(ChatFormat):
    object_name = "text_completion"
    chunk_name = "text_completion"

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "text": "".join(choice.text),
                "logprobs": self._completion_logprobs(choice, choice.logprobs, TextOffsets()),
                "finish_reason": choice.finish_reason}

    def first_chunk(self, choices: list[Choice]) -> dict[str, Any] | None:
        return None

    def delta_chunk(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not out.new_text and not out.new_logprobs:
            return None
        offsets = self._offsets.setdefault(choice.index, TextOffsets())  # carried across the stream's chunks
        return self.chunk([{"index": choice.index, "text": out.new_text,
                            "logprobs": self._completion_logprobs(choice, out.new_logprobs, offsets),
                            "finish_reason": None}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        return self.chunk([{"index": choice.index, "text": "", "logprobs": None,
                            "finish_reason": choice.finish_reason}])

    def __init__(self, response_id: str, model: str, tokenizer: Any) -> None:
        super().__init__(response_id, model, tokenizer)
        self._offsets: dict[int, TextOffsets] = {}

    def _completion_logprobs(self, choice: Choice, tokens: list[SampledToken] | None,
                             offsets: "TextOffsets") -> dict[str, Any] | None:
        if choice.params.logprobs is None or not tokens:
            return None
        tok = self.tokenizer
        data = [tok.token_bytes(t.token_id) for t in tokens]
        starts = [offsets.start(d, t.token_id in tok.special_token_ids) for d, t in zip(data, tokens)]
        top = None
        if choice.params.logprobs > 0:
            top = [{token_string(tok.token_bytes(i)): lp for i, lp in t.top_logprobs or ()} for t in tokens]
        return {"tokens": [token_string(d) for d in data], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": top, "text_offset": starts}


def token_string(data: bytes) -> str:
    """A token as text; a token holding part of a UTF-8 character is spelled `bytes:\\xe4\\xbd` (as
    OpenAI does), so two such tokens never look alike."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextOffsets:
    """Where each output token starts in the output text, counted over the tokens' raw bytes: a token
    that continues a character starts where that character does; special tokens add no text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def start(self, data: bytes, special: bool) -> int:
        offset = self._chars
        if not special:
            self._chars += len(self._decoder.decode(data))
        return offset
