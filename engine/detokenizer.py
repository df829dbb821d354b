"""Incremental detokenization with stop strings: text is released only once it cannot become a stop."""
from __future__ import annotations

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_sent = 0  # characters of `text` already handed out

    def update(self, output_token_ids: list[int]) -> bool:
        """Decode the output so far; True if it now contains a stop string (the text is cut before it)."""
        text = self.tokenizer.decode(output_token_ids)
        search_from = max(0, self.num_sent - self.holdback)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[:min(hits)]
            return True
        self.text = text
        return False

    def take(self, finished: bool) -> str:
        """Text not handed out yet; while running, keep back what may be a stop string or half a character."""
        end = len(self.text)
        if not finished:
            end -= self.holdback
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
                end = min(end, len(self.text) - 1)
        if end <= self.num_sent:
            return ""
        new = self.text[self.num_sent:end]
        self.num_sent = end
        return new
