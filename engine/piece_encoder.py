"""A prompt tokenized piece by piece, each piece's ids remembered: the text between two added tokens (a chat
message's body, the template's role headers) encodes the same wherever it stands, so a chat's system prompt and
earlier turns, sent again with every turn, are tokenized once and then looked up.

Hugging Face's `tokenizers` cuts a text at its added tokens first and runs the normalizer, the pre-tokenizer and
the model on each piece alone, so encoding the pieces one by one and joining them gives the same ids as encoding
the whole text, as long as no step looks past its piece. `independent_pieces` admits the tokenizers where that
holds: added tokens matched as written (no lstrip, rstrip, single_word, or normalized matching under a
normalizer), a normalizer of Unicode forms only, and no Metaspace (whose "first" scheme prefixes only the
piece at the text's start). Others encode whole texts, as before.
"""
from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _types(node: Any) -> set[str]:
    """Every component type named anywhere in a tokenizer.json subtree."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        return found.union(*(_types(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node))
    return set()


def independent_pieces(spec: dict) -> bool:
    """Whether a tokenizer.json (parsed) encodes the pieces between its added tokens each on its own."""
    normalizer = _types(spec.get("normalizer")) - {"Sequence"}
    added = spec.get("added_tokens") or []
    return (normalizer <= _UNICODE_FORMS
            and "Metaspace" not in _types(spec.get("pre_tokenizer")) | normalizer
            and not any(t.get("lstrip") or t.get("rstrip") or t.get("single_word")
                        or (t.get("normalized", True) and normalizer) for t in added))


class PieceEncoder:
    """encode(text) by pieces, with an LRU of the pieces' ids bounded by their texts' total length (the ids
    are kept as 32-bit arrays: about 4 bytes a token beside the text's bytes). Not thread-safe: the caller
    holds its tokenizer's lock."""

    def __init__(self, spec: dict, encode_piece: Callable[[str], list[int]], max_chars: int = 4_000_000) -> None:
        self._ids = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        # longest first: at the leftmost match the longest added token wins, as in `tokenizers`
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._encode_piece = encode_piece
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self._piece(text))
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            if match.start() > start:
                ids += self._piece(text[start:match.start()])
            ids.append(self._ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def _piece(self, piece: str) -> array:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            self.hits += 1
            return ids
        self.misses += 1
        ids = array("i", self._encode_piece(piece))
        if len(piece) <= self.max_chars:
            self._cache[piece] = ids
            self._chars += len(piece)
            while self._chars > self.max_chars:
                evicted, _ = self._cache.popitem(last=False)
                self._chars -= len(evicted)
        return ids
