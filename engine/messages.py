"""What crosses between a client and the engine's step loop: plain data, pickled over the engine process's
sockets (and handed over as objects in process). No torch: the API process imports it.

In (API process -> engine): AddRequest, AbortRequest, CacheCommand. Out (engine -> API process): EngineInfo
or StartFailed once, then StepOutputs per step and a CommandReply per CacheCommand. Exceptions never cross
as objects: an EngineError carries the type's name and the message, as strings."""
from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StepStats


@dataclass(slots=True)
class AddRequest:
    """Start a request."""

    request_id: str  # the engine's id (unique per generate() call)
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time: float | None = None  # time.monotonic(), one clock for every process on the machine
    cache: "CacheDirectives | None" = None  # cache_control breakpoints and the tenant's pin quota


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


@dataclass(slots=True)
class StartFailed:
    """The engine process could not start with its settings (instead of EngineInfo)."""

    reason: str  # one line for the operator


@dataclass(slots=True)
class StepOutputs:
    """One step's outputs and stats (or, from an idle loop, stats alone)."""

    outputs: list[RequestOutput]
    stats: StepStats


@dataclass(frozen=True, slots=True)
class EngineError:
    """An exception raised in the engine, as it crosses to the API process."""

    type: str  # the exception's class name, e.g. "ValueError"
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "EngineError":
        return cls(type(exc).__name__, str(exc))


@dataclass(slots=True)
class CommandReply:
    """What a CacheCommand returned (`result`), or the error it raised."""

    command_id: int
    result: PinList | CacheErased | None = None
    error: EngineError | None = None


# ---- prompt caching: pins (engine/kv/pins.py)

@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """Pin the full blocks of the prompt's first `num_tokens` tokens for `ttl_s` seconds (renewed by hits)."""

    num_tokens: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class CacheDirectives:
    """What a request asks of the prefix cache beyond the automatic: its breakpoints, and the quota of
    pinned blocks its tenant's key allows (None: only the server's cap)."""

    breakpoints: tuple[CacheBreakpoint, ...] = ()
    max_pinned_blocks: int | None = None


@dataclass(slots=True)
class CacheCommand:
    """A tenant's cache, by the API: `op` "list" (its pins) or "erase" (its cached blocks, RAM and disk)."""

    command_id: int
    op: str
    tenant: str


@dataclass(slots=True)
class PinInfo:
    """One pinned prefix, as GET /v1/cache lists it."""

    pin_id: str  # the hex of the prefix's last block hash (salted: says nothing of the tokens)
    num_tokens: int
    num_blocks: int
    ttl_s: float
    created_at: float  # time.time()
    expires_at: float  # time.time(); renewed by every hit
    hits: int


@dataclass(slots=True)
class PinList:
    """A tenant's pins and the distinct blocks they hold (pins on one prefix share its leading blocks, which
    count once, as in `prefixgate_tenant_pinned_blocks`)."""

    pins: list[PinInfo]
    num_blocks: int


@dataclass(slots=True)
class CacheErased:
    """What DELETE /v1/cache removed."""

    blocks: int = 0  # cached blocks dropped from RAM
    disk_blocks: int = 0  # block files deleted from the disk tier
    disk_blocks_kept: int = 0  # block files of the tenant's the disk tier's folder would not let it delete
    pins: int = 0  # pins released


Inbound = AddRequest | AbortRequest | CacheCommand  # what a client sends the step loop
Outbound = EngineInfo | StartFailed | StepOutputs | CommandReply  # what the engine process sends back
