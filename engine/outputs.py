"""What the engine hands back: one delta per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SampledToken


class FinishReason:
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # the engine step that ran this request failed


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[SampledToken] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # all tokens generated so far
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id it ended at; None for EOS
    error: str | None = None
    error_is_request: bool = False  # the error is the request's own (its grammar gave up), not the engine's
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)
    num_disk_cached_tokens: int = 0  # the part of num_cached_tokens read back from the disk tier
    num_cache_write_tokens: int = 0  # prompt tokens this request computed and wrote to the cache (full blocks)
    num_pinned_tokens: int = 0  # the longest pinned prefix of the prompt this request made or renewed
    pinned_until: float | None = None  # its expiry, time.time()
    pin_refused: str | None = None  # why a breakpoint of this request was not pinned (a quota), if one was not
    # SamplingParams.prompt_logprobs: one per prompt token (the first without a logprob), in the first output
    # after the prompt is computed
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one request (offline API)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None
    logprobs: list[SampledToken] | None = field(default=None)
    prompt_logprobs: list[SampledToken] | None = None  # SamplingParams.prompt_logprobs
