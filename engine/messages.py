"""What crosses between a client and the engine's step loop: plain data, pickled over the engine process's
sockets (and handed over as objects in process). No torch: the API process imports it."""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class AddRequest:
    """Start a request."""

    request_id: str  # the engine's id (unique per generate() call)
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time: float | None = None  # time.monotonic(), one clock for every process on the machine


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class EngineInfo:
    """What the API process learns once the engine process is up (its `ready` message)."""

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    eos_token_ids: list[int]
    threads: int | None  # compute threads of decode steps and of steps with a prefill (None: not CPU)
    threads_batch: int | None
    pid: int
