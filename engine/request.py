"""A request's state inside the engine: its tokens, progress, block hashes and timings."""
from __future__ import annotations

import enum
import time

import torch

from engine.config import HashAlgo
from engine.kv.hashing import BlockHash, hash_full_blocks
from engine.messages import CacheDirectives
from engine.sampling_params import SampledToken, SamplingParams
from engine.grammar import StructuredMatcher


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 cache_salt: str | None = None, tenant: str | None = None,
                 arrival_time: float | None = None, cache: CacheDirectives | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.tenant = tenant
        self.all_token_ids = list(prompt_token_ids)  # prompt + output
        self.output_token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        # prompt_logprobs: one per prompt token so far, the first without a logprob (nothing comes before it)
        self.prompt_logprobs: list[SampledToken] | None = (
            None if params.prompt_logprobs is None else [SampledToken(t) for t in self.prompt_token_ids[:1]])
        self.prompt_logprobs_sent = False  # handed out in an output (once, complete)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache; None until admitted
        self.num_disk_cached_tokens = 0  # the part of them loaded from the disk tier
        self.num_preemptions = 0
        self.cache = cache  # breakpoints to pin once the prompt is computed (engine/kv/pins.py)
        self.num_pinned_tokens = 0  # the longest pinned prefix of the prompt this request made or renewed
        self.pinned_until: float | None = None  # its expiry, time.time()
        self.pin_refused: str | None = None  # why a breakpoint was not pinned (a quota), if one was not
        self.block_hashes: list[BlockHash] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id it ended at (not EOS)
        self.embedding: list[float] | None = None  # set when a pooling request's prompt is computed
        self.matcher: StructuredMatcher | None = None  # set by the engine when params.structured is
        self._generator: torch.Generator | None = None  # built on the logits' device at the first sampled token
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.inter_token_latencies: list[float] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is still to compute: the newest one alone in a decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_catching_up(self) -> bool:
        """More than the newest token left to compute: a prefill, or a preempted request recomputing its output."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The seeded generator of this request, on `device` (a CPU generator cannot sample CUDA logits)."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self._generator

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.all_token_ids[index * block_size:(index + 1) * block_size])

    def update_block_hashes(self, block_size: int, algo: HashAlgo) -> None:
        """Hash every full block not hashed yet (prompt and generated tokens alike)."""
        if len(self.all_token_ids) // block_size == len(self.block_hashes):
            return  # the common case in a waiting queue that is ordered every step
        parent = self.block_hashes[-1] if self.block_hashes else b""
        self.block_hashes += hash_full_blocks(self.all_token_ids, block_size, start_block=len(self.block_hashes),
                                              parent=parent, cache_salt=self.cache_salt, algo=algo)

    def append_token(self, sampled: SampledToken, now: float) -> None:
        self.output_token_ids.append(sampled.token_id)
        self.all_token_ids.append(sampled.token_id)
        if self.matcher is not None:
            self.matcher.accept(sampled.token_id)
        if self.params.logprobs is not None:
            self.logprobs.append(sampled)
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
