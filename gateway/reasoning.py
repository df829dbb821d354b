"""A reasoning model's thinking apart from its answer (vLLM's --reasoning-parser): the text between <think> and
</think> goes to the chat message's `reasoning` (vLLM's name; DeepSeek's and llama.cpp's `reasoning_content` too),
the rest to its content, whole or streamed by the same splitter, so both read the same.

The answer thinks first when it opens with <think>, or when the template's generation prompt already did
(DeepSeek-R1's, QwQ's and Qwen3 thinking models' end with it; a <think> the model writes again is dropped); Qwen3's
`enable_thinking: false` closes it there, so the answer is all content. Thinking cut short (max_tokens) stays
thinking. An answer under an output constraint has no thinking: its grammar holds from the first token."""
from __future__ import annotations

import functools
import json
from typing import Any

from gateway.tool_parsers import partial_tag_length

START, END = "<think>", "</think>"
PARSER_NAMES = ("auto", "none", "deepseek_r1", "qwen3")  # the last two: vLLM's names, one splitter here
_PROBE = [{"role": "user", "content": "x"}]


def template_thinks(tokenizer: Any, setting: str) -> bool:
    """Whether answers are split: `setting` "auto" when the model's chat template writes <think> or </think>."""
    if setting == "none":
        return False
    if setting != "auto":
        return True
    template = tokenizer.info().get("chat_template") or ""
    return START in template or END in template


def generation_opens_thinking(tokenizer: Any, variables: dict[str, Any]) -> bool:
    """The template's generation prompt (with these template variables) leaves a <think> open: told from what
    add_generation_prompt adds to a one-message chat, so no message's text can make it so (a question about the
    <think> tag, a tool result that quotes one)."""
    return _generation_opens_thinking(tokenizer, json.dumps(variables, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)  # (two renders a request otherwise; the variables, as JSON, are the key)
def _generation_opens_thinking(tokenizer: Any, variables_json: str) -> bool:
    variables = json.loads(variables_json)
    try:
        with_prompt = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, variables=variables)
        without = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False, variables=variables)
    except Exception:  # (a template that wants other messages: the request's own render says what is wrong)
        return False
    return opens_thinking(with_prompt.removeprefix(without))


def opens_thinking(text: str) -> bool:
    """`text` leaves a <think> open."""
    return text.rfind(START) > text.rfind(END)


def answer_starts_thinking(tokenizer: Any, chat: Any) -> bool:
    """Whether a chat request's answer (gateway/protocol.py's ChatRequest) starts inside its thinking: where the
    generation prompt opens it, or the final message it continues does (echoed, that message is split first, from
    its start); never under an output constraint (a grammar, a forced tool call)."""
    if chat.structured is not None or (chat.tools is not None and chat.tools.forced):
        return False
    if chat.continue_final_message:
        return not chat.echo and opens_thinking(chat.messages[-1]["content"])
    return chat.add_generation_prompt and generation_opens_thinking(tokenizer, chat.template_variables)


class ThinkingSplit:
    """Text as it comes -> (reasoning, content) pieces; a piece that may still become a tag waits for the next."""

    def __init__(self, thinking: bool) -> None:
        # start: the answer may yet open with <think>; opened: the prompt opened it, the model may write it again
        self._state = "opened" if thinking else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self._state in ("start", "opened"):
            opening = text.lstrip()
            if opening.startswith(START):
                self._state, text = "thinking", opening[len(START):]
            elif START.startswith(opening):  # (whitespace, or part of the tag so far)
                self._held = text
                return "", ""
            else:
                self._state = "thinking" if self._state == "opened" else "content"
        if self._state == "content":
            return "", text
        if END in text:
            reasoning, content = text.split(END, 1)
            self._state = "content"
            return reasoning, content
        keep = partial_tag_length(text, END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def thinks_next(self, text: str) -> bool:
        """Whether `text`, fed next, is (or begins with) thinking, an empty one included."""
        return self._state in ("opened", "thinking") or (
            self._state == "start" and (self._held + text).lstrip().startswith(START))

    def finish(self) -> tuple[str, str]:
        """What was held back: thinking that never closed stays thinking; a lone start is content."""
        held, self._held = self._held, ""
        return (held, "") if self._state in ("thinking", "opened") else ("", held)

