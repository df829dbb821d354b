"""OpenAI response bodies and stream chunks for chat completions and (text) completions."""
from __future__ import annotations

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
                "logprobs": self.logprobs(choice, choice.logprobs, 0),
                "finish_reason": choice.finish_reason}

    def first_chunk(self, choices: list[Choice]) -> dict[str, Any] | None:
        return self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None} for c in choices])

    def delta_chunk(self, choice: Choice, out: RequestOutput, text_offset: int) -> dict[str, Any] | None:
        if not out.new_text and not out.new_logprobs:
            return None
        return self.chunk([{"index": choice.index, "delta": {"content": out.new_text},
                            "logprobs": self.logprobs(choice, out.new_logprobs, text_offset),
                            "finish_reason": None}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        return self.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                            "finish_reason": choice.finish_reason}])

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self._head(self.chunk_name), "choices": choices, "usage": usage}

    def logprobs(self, choice: Choice, tokens: list[SampledToken] | None,
                 text_offset: int) -> dict[str, Any] | None:
        if choice.params.logprobs is None or not tokens:
            return None
        return {"content": [{**self._token(t.token_id, t.logprob),
                             "top_logprobs": [self._token(i, lp) for i, lp in t.top_logprobs or ()]}
                            for t in tokens]}

    def _token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None}


class CompletionFormat(ChatFormat):
    object_name = "text_completion"
    chunk_name = "text_completion"

    def __init__(self, response_id: str, model: str, tokenizer: Any, echo_prompts: list[str] | None = None) -> None:
        super().__init__(response_id, model, tokenizer)
        self.echo_prompts = echo_prompts  # echo: each prompt's text, put before its choices' text

    def choice_body(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "text": self._echo(choice) + "".join(choice.text),
                "logprobs": self.logprobs(choice, choice.logprobs, 0),
                "finish_reason": choice.finish_reason}

    def first_chunk(self, choices: list[Choice]) -> dict[str, Any] | None:
        if self.echo_prompts is None:
            return None
        return self.chunk([{"index": c.index, "text": self._echo(c), "logprobs": None, "finish_reason": None}
                           for c in choices])

    def _echo(self, choice: Choice) -> str:
        return "" if self.echo_prompts is None else self.echo_prompts[choice.prompt_index]

    def delta_chunk(self, choice: Choice, out: RequestOutput, text_offset: int) -> dict[str, Any] | None:
        if not out.new_text and not out.new_logprobs:
            return None
        return self.chunk([{"index": choice.index, "text": out.new_text,
                            "logprobs": self.logprobs(choice, out.new_logprobs, text_offset),
                            "finish_reason": None}])

    def finish_chunk(self, choice: Choice) -> dict[str, Any]:
        return self.chunk([{"index": choice.index, "text": "", "logprobs": None,
                            "finish_reason": choice.finish_reason}])

    def logprobs(self, choice: Choice, tokens: list[SampledToken] | None,
                 text_offset: int) -> dict[str, Any] | None:
        if choice.params.logprobs is None or not tokens:
            return None
        texts = [self.tokenizer.token_text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(text_offset)
            text_offset += len(text)
        top = None
        if choice.params.logprobs > 0:
            top = [{self.tokenizer.token_text(i): lp for i, lp in t.top_logprobs or ()} for t in tokens]
        return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": top, "text_offset": offsets}
