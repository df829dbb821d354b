"""What a request asks of sampling (SamplingParams), what one sampled token carries, and the prompt checks:
plain data, no torch, so the API process can build and check requests without loading the model code."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured import StructuredOutput

# below this temperature sampling is greedy: dividing float32 logits by less overflows them to inf
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, not part of the output
    stop_token_ids: list[int] = field(default_factory=list)  # their text, as EOS's, not part of the output
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) ends the output
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text is part of the output
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the top k
    # each prompt token's logprob given the tokens before it (None: none; k: also the top k); such a request hits
    # no cached block but those of tokens it scored before a preemption: a hit's tokens never run through the model
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and generated tokens; 1 disables
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be sampled (None: any)
    structured: StructuredOutput | None = None  # a grammar every output token must follow
    # "last": generate nothing; the output is the prompt's last final hidden state, L2-normalized (an embedding);
    # "none": generate nothing, only compute (and cache) the prompt (POST /v1/cache/warm)
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # NaN passes every range check below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")
        if self.pooling not in (None, "last", "none"):
            raise ValueError(f"unknown pooling {self.pooling!r}; expected 'last' or 'none'")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0")
        self._check_processing_fields()

    def _check_processing_fields(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.01 <= self.repetition_penalty <= 10:  # dividing by less overflows a logit to inf
            raise ValueError("repetition_penalty must be in [0.01, 10]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token_id!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1.0 or self.structured is not None
                    or self.allowed_token_ids is not None)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # 1 + the tokens more likely than it (prompt logprobs: vLLM's rank)


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                    max_model_len: int, eos_token_ids: frozenset[int] | set[int] = frozenset()) -> None:
    """Raises ValueError for a request no engine of this model could serve."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # (loops in C: every request, both processes)
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    generated = 0 if params.pooling else params.max_tokens  # a pooling request (embedding, warm) generates none
    if len(prompt_token_ids) + generated > max_model_len:
        raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds the context length ({max_model_len})")
    check_token_ids(params, vocab_size, eos_token_ids)


class ParamError(ValueError):
    """A request field no engine of this model could serve; `param` names it (the API's 400 says which)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(params: SamplingParams, vocab_size: int, eos_token_ids: frozenset[int] | set[int]) -> None:
    """The token ids the params name are in the vocabulary, and allowed_token_ids leave a token to sample before
    min_tokens."""
    for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
        if any(not 0 <= t < vocab_size for t in getattr(params, name) or ()):
            raise ParamError(f"{name} token ids must be in [0, {vocab_size})", name)
    allowed = params.allowed_token_ids
    if params.min_tokens and allowed is not None and stop_ids(params, eos_token_ids).issuperset(allowed):
        raise ParamError("every allowed token ends the answer (EOS or a stop token id), so none may come before "
                         "min_tokens", "allowed_token_ids")


def stop_ids(params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> set[int]:
    """The token ids that end this request's answer (masked before its min_tokens)."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
