"""Admission: a bounded number of sequences in flight, and per-tenant concurrency; beyond either, 429."""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from gateway.auth import Tenant
from gateway.errors import APIError


class Admission:
    """Counts what the gateway has handed to the engine; refuses fast instead of queueing without bound.

    NOTE: the engine runs `max_num_seqs` sequences and queues the rest (reordered for cache hits);
    `capacity` = max_num_seqs + max_waiting_requests bounds that queue.
    """

    def __init__(self, max_num_seqs: int, max_waiting_requests: int, retry_after_s: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.capacity = max_num_seqs + max_waiting_requests
        self.in_flight = 0  # engine sequences (a request with n choices counts n)
        self._per_tenant: Counter[str] = Counter()  # HTTP requests per tenant
        self._per_key: Counter[str] = Counter()  # HTTP requests per API key (Tenant.key_id)
        self._retry_after = str(retry_after_s)

    @contextlib.contextmanager
    def admit(self, tenant: Tenant, num_seqs: int) -> Iterator[None]:
        self._check(tenant, num_seqs)
        self.in_flight += num_seqs
        self._per_tenant[tenant.name] += 1
        self._per_key[tenant.key_id] += 1
        try:
            yield
        finally:
            self.in_flight -= num_seqs
            _release(self._per_tenant, tenant.name)
            _release(self._per_key, tenant.key_id)

    def tenant_in_flight(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def _check(self, tenant: Tenant, num_seqs: int) -> None:
        if num_seqs > self.capacity:  # retrying would never help
            raise APIError(400, f"this request needs {num_seqs} sequences (prompts x n); the server runs at most "
                           f"{self.capacity}", param="n", code="too_many_sequences")
        if self.in_flight + num_seqs > self.capacity:
            raise self._too_many(
                f"the server is at capacity: {self.in_flight} sequences in flight, limit max_num_seqs "
                f"({self.max_num_seqs}) + max_waiting_requests ({self.max_waiting_requests}); retry later")
        if tenant.max_concurrent is not None and self._per_tenant[tenant.name] >= tenant.max_concurrent:
            raise self._too_many(
                f"tenant {tenant.name!r} has {self._per_tenant[tenant.name]} requests in flight, "
                f"its limit max_concurrent_per_tenant is {tenant.max_concurrent}; retry later")
        if tenant.key_max_concurrent is not None and self._per_key[tenant.key_id] >= tenant.key_max_concurrent:
            raise self._too_many(
                f"this API key of tenant {tenant.name!r} has {self._per_key[tenant.key_id]} requests in flight, "
                f"its limit max_concurrent is {tenant.key_max_concurrent}; retry later")

    def _too_many(self, message: str) -> APIError:
        # OpenAI's code for every 429; the message names the limit that was hit
        return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": self._retry_after})


def _release(counts: Counter[str], name: str) -> None:
    counts[name] -= 1
    if not counts[name]:
        del counts[name]
