"""Grammars compiled against the vocabulary: llguidance matchers that mask each decode step.

A validated, ready matcher is cached per (kind, spec) and each request gets its own copy, which fills a
token bitmask before every step and advances with each sampled token. llguidance is imported lazily: most
processes never use it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.structured import StructuredOutput, build_grammar

if TYPE_CHECKING:
    import llguidance

    from engine.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 64


class GrammarError(RuntimeError):
    """A request's grammar gave up while its answer ran (llguidance builds its lexer lazily, so a regex too complex
    for its limits shows only at some token): the request's own failure, not the engine's."""


class StructuredMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: "llguidance.LLMatcher") -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        if self._matcher.is_error():  # its mask would then allow only EOS: an answer that ignores the grammar
            raise GrammarError(f"the output constraint failed: {self._matcher.get_error()}")

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"the output constraint failed at token {token_id}: {self._matcher.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (EOS aside): the request is done."""
        return self._matcher.is_stopped()


class GrammarCache:
    """A fresh matcher per (kind, spec), least recently used dropped first; one cache per engine."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, max_entries: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.max_entries = max_entries
        self._fresh: OrderedDict[StructuredOutput, "llguidance.LLMatcher"] = OrderedDict()
        self._ll_tokenizer: "llguidance.LLTokenizer | None" = None  # built on first use: slow (docs/speed.md#start-up)
        self._lock = threading.Lock()

    def matcher(self, so: StructuredOutput) -> StructuredMatcher:
        """A matcher at the start of `so`'s grammar; ValueError if the spec is invalid."""
        with self._lock:
            fresh = self._fresh.get(so)
            if fresh is None:
                fresh = self._compile(so)
                self._fresh[so] = fresh
                if len(self._fresh) > self.max_entries:
                    self._fresh.popitem(last=False)
            self._fresh.move_to_end(so)
            return StructuredMatcher(fresh.deep_copy())

    def __len__(self) -> int:
        return len(self._fresh)

    def _compile(self, so: StructuredOutput) -> "llguidance.LLMatcher":
        import llguidance
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self.tokenizer.llguidance_tokenizer(self.vocab_size)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, build_grammar(so), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {so.kind}: {matcher.get_error()}")
        return matcher


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# a bit -> what it adds to the logit: a branch-free add, measured faster than masked_fill with the same mask
_BIT_TO_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Tokens whose bit is 0 in their row's mask get -inf (in place); token t is bit t % 32 of word t // 32."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[-1]]
    bias = torch.from_numpy(np.take(_BIT_TO_BIAS, bits)).to(logits.device, logits.dtype)
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, bias)
