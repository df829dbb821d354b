"""Offline API for tests and notebooks: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import CacheDirectives
from engine.outputs import CompletionOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.stats import PrefixCacheStats


class LLM:
    def __init__(self, model: str = "default", **engine_overrides) -> None:
        self.core = EngineCore(EngineConfig(model=model, **engine_overrides))
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 cache_salt: str | None = None, tenant: str | None = None,
                 cache: CacheDirectives | None = None) -> list[CompletionOutput]:
        """Runs all prompts together (continuous batching) and returns their results in order. `cache`: the
        breakpoints to pin once each prompt is computed (for `tenant`'s quota and listing)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = []
        for prompt, p in zip(prompts, params_list, strict=True):
            token_ids = self._encode(prompt)
            request = Request(f"llm-{next(self._ids)}", token_ids, p, cache_salt=cache_salt, tenant=tenant,
                              cache=cache)
            self.core.add_request(request)
            requests.append(request)
        texts = {r.request_id: [] for r in requests}
        while self.core.has_unfinished():
            outputs, _ = self.core.step()
            for out in outputs:
                texts[out.request_id].append(out.new_text)
        return [CompletionOutput(r.request_id, r.prompt_token_ids, r.output_token_ids, "".join(texts[r.request_id]),
                                 r.num_cached_tokens or 0, r.finish_reason,
                                 r.logprobs if r.params.logprobs is not None else None, r.prompt_logprobs)
                for r in requests]

    def embed(self, prompts: list[str | list[int]], *, cache_salt: str | None = None) -> list[list[float]]:
        """One L2-normalized vector per prompt: the final hidden state of its last token (its prefill is
        computed, and cached, like any other; nothing is generated)."""
        requests = []
        for prompt in prompts:
            token_ids = self._encode(prompt)
            request = Request(f"llm-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1, pooling="last"),
                              cache_salt=cache_salt)
            self.core.add_request(request)
            requests.append(request)
        while self.core.has_unfinished():
            self.core.step()
        return [r.embedding for r in requests]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        """A text after the tokenizer's BOS (where it has one), as the server's completions encode it; token ids
        as they are."""
        if isinstance(prompt, str):
            return [*self.tokenizer.bos_token_ids, *self.tokenizer.encode(prompt)]
        return list(prompt)

    def close(self) -> None:
        """Flushes the cached blocks to the disk tier (if any), for a warm restart."""
        self.core.close()

    def stats(self) -> PrefixCacheStats:
        return self.core.prefix_cache_stats()
