"""A reasoning model's thinking apart from its answer (vLLM's --reasoning-parser): the text between <think> and
</think> goes to the chat message's `reasoning` (vLLM's name; DeepSeek's and llama.cpp's `reasoning_content` too),
the rest to its content, whole or streamed by the same splitter, so both read the same.

The answer thinks first when it opens with <think>, or when the prompt already did (DeepSeek-R1's and Qwen3
thinking models' templates end the prompt with it); Qwen3's `enable_thinking: false` closes it in the prompt, so
the answer is all content. Thinking cut short (max_tokens) stays thinking."""
from __future__ import annotations

from typing import Any

START, END = "<think>", "</think>"
PARSER_NAMES = ("auto", "none", "deepseek_r1", "qwen3")  # the last two: vLLM's names, one splitter here
_PROMPT_TAIL_TOKENS = 64  # the generation prompt's end, where a template opens the thinking


def template_thinks(tokenizer: Any, setting: str) -> bool:
    """Whether answers are split: `setting` "auto" when the model's chat template writes <think> or </think>."""
    if setting == "none":
        return False
    if setting != "auto":
        return True
    template = tokenizer.info().get("chat_template") or ""
    return START in template or END in template


def prompt_opens_thinking(tokenizer: Any, prompt: list[int]) -> bool:
    """The prompt ends inside an open <think> (the answer starts in its thinking)."""
    tail = tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rfind(START) > tail.rfind(END)


class ThinkingSplit:
    """Text as it comes -> (reasoning, content) pieces; a piece that may still become a tag waits for the next."""

    def __init__(self, thinking: bool) -> None:
        self._state = "thinking" if thinking else "start"  # start: the answer may yet open with <think>
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self._state == "start":
            opening = text.lstrip()
            if opening.startswith(START):
                self._state, text = "thinking", opening[len(START):]
            elif START.startswith(opening):  # (whitespace, or part of the tag so far)
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "content":
            return "", text
        if END in text:
            reasoning, content = text.split(END, 1)
            self._state = "content"
            return reasoning, content
        keep = _partial_suffix(text, END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back: thinking that never closed stays thinking; a lone start is content."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held)


def split_whole(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole answer, as a stream of it splits them."""
    splitter = ThinkingSplit(thinking)
    reasoning, content = splitter.feed(text)
    rest_reasoning, rest_content = splitter.finish()
    return reasoning + rest_reasoning, content + rest_content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
