"""Incremental detokenization with stop strings: text is released only once it cannot become a stop.

Each step decodes only a short window of the newest tokens (an offset window, as vLLM and TGI do):
tokens [prefix_offset, read_offset) are decoded again as context, so that a decoder that drops a
word's leading space at the start of a text still spaces the next token right; tokens from
read_offset on are new. The window moves on only at a clean boundary: while the new text ends in
U+FFFD (half a UTF-8 character, or bytes that may still become one) the tokens stay in the window.
"""
from __future__ import annotations

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """`include_stop`: the text ends after a stop string, not before it (vLLM's include_stop_str_in_output); nothing
    is then held back, since what precedes a stop string is sent either way. `skip_special_tokens` False: special
    tokens' text is part of the output."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._search_back = max((len(s) for s in self.stop), default=1) - 1  # where a stop string may start
        self.holdback = 0 if include_stop else self._search_back
        self.matched_stop: str | None = None  # the stop string found, once one is
        self._final = ""  # text of the tokens before read_offset: it never changes again
        self._tail = ""  # text of the tokens from read_offset on (may end in half a character)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_len = 0  # len(decode(tokens[prefix_offset:read_offset]))
        self.num_sent = 0  # characters of `text` already handed out

    @property
    def text(self) -> str:
        return self._final + self._tail

    def update(self, output_token_ids: list[int], stops: bool = True) -> bool:
        """Decode the newest tokens; True if the text now contains a stop string (the text is cut before it, or after
        it with include_stop). `stops` False: no stop string is looked for (a stop token ended the answer first)."""
        window = self._decode(output_token_ids[self._prefix_offset:])
        self._tail = window[self._prefix_len:]
        if stops and self.stop and self._cut_at_stop():
            return True
        if not self._tail.endswith("\ufffd"):  # a clean boundary: the window moves on
            self._final += self._tail
            self._tail = ""
            self._move_window(output_token_ids, window)
        return False

    def _move_window(self, token_ids: list[int], window: str) -> None:
        """The new tokens become the context of the next ones; while they show no text (a special token,
        a lone leading space) the older context stays, or the next word would lose its space."""
        context = self._decode(token_ids[self._read_offset:])
        if context:
            self._prefix_offset, self._prefix_len = self._read_offset, len(context)
        else:
            self._prefix_len = len(window)
        self._read_offset = len(token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _cut_at_stop(self) -> bool:
        search_from = max(0, self.num_sent - self._search_back)  # earlier text cannot start a stop string
        recent = self._text_from(search_from)
        hits = [(i, s) for i, s in ((recent.find(s), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        at, self.matched_stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
        end = search_from + at + (len(self.matched_stop) if self.include_stop else 0)
        self._final, self._tail = self.text[:end], ""
        return True

    def _text_from(self, start: int) -> str:
        """text[start:], without copying the whole text."""
        num_final = len(self._final)
        return self._final[start:] + self._tail if start < num_final else self._tail[start - num_final:]

    def take(self, finished: bool) -> str:
        """Text not handed out yet; while running, keep back what may be a stop string or half a character."""
        end = len(self._final) + len(self._tail)
        if not finished:
            end -= self.holdback
            if self._tail.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
                end = min(end, len(self._final) + len(self._tail) - 1)
        if end <= self.num_sent:
            return ""
        new = self._text_from(self.num_sent)[:end - self.num_sent]
        self.num_sent = end
        return new
