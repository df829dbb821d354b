"""API keys -> tenants, and each tenant's cache salt (set by the server, never by the client)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import APIError
from gateway.settings import ANONYMOUS_TENANT, GatewaySettings


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sent a request: the tenant (one cache salt, one concurrency limit) and the key it used."""

    name: str
    salt: str = ""  # NOTE: a secret; never logged, never returned
    max_concurrent: int | None = None  # the tenant's requests in flight, all its keys together
    key_id: str = ""  # which configured key (its position, not the key): per-key limits count by it
    key_max_concurrent: int | None = None  # requests in flight with this one key
    max_pinned_blocks: int | None = None  # KV blocks the tenant's pins may hold, by this key (None: no own cap)

    def cache_salt(self, body_salt: str | None) -> str:
        """The engine's salt: a body `cache_salt` can only narrow the tenant's own cache."""
        if not body_salt:
            return self.salt
        return hashlib.sha256(f"{self.salt}\0{body_salt}".encode()).hexdigest()


class Authenticator:
    """Maps a bearer key to its tenant in constant time; without keys everyone is anonymous."""

    def __init__(self, settings: GatewaySettings) -> None:
        secret = (settings.salt_secret or secrets.token_hex(32)).encode()
        public = set(settings.public_salt_tenants)
        derive = _SaltDeriver(secret)
        self._by_digest: list[tuple[bytes, Tenant]] = []
        salts: dict[str, str] = {}
        for i, key in enumerate(settings.api_keys):
            salt = key.salt or (derive.public() if key.share_public_salt or key.tenant in public
                                else derive.tenant(key.tenant))
            # the salt is the tenant's cache: its keys must agree on it (max_concurrent is per key)
            if salts.setdefault(key.tenant, salt) != salt:
                raise ValueError(f"the API keys of tenant {key.tenant!r} disagree on salt or share_public_salt; "
                                 "a tenant has one cache, so give them the same values (or different tenants)")
            tenant = Tenant(key.tenant, salt, settings.max_concurrent_per_tenant, f"#{i}", key.max_concurrent,
                            key.max_pinned_blocks)
            self._by_digest.append((_digest(key.key), tenant))
        anonymous_salt = derive.public() if ANONYMOUS_TENANT in public else derive.tenant(ANONYMOUS_TENANT)
        self._anonymous = Tenant(ANONYMOUS_TENANT, anonymous_salt, settings.max_concurrent_per_tenant)
        self.tenant_names = sorted(salts) if salts else [ANONYMOUS_TENANT]
        self.salt_fingerprint = derive.fingerprint()  # saved with pins: a start under another secret skips them
        # /metrics lists tenant names: with metrics_api_key it needs that key (and only that key)
        self._metrics_digest = _digest(settings.metrics_api_key) if settings.metrics_api_key else None

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, request: web.Request) -> Tenant:
        if not self._by_digest:
            return self._anonymous
        key = _bearer(request)
        tenant = self._lookup(key) if key is not None else None
        if tenant is None:
            raise _unauthorized("invalid or missing API key (send 'Authorization: Bearer KEY')")
        return tenant

    def check_metrics_key(self, request: web.Request) -> None:
        if self._metrics_digest is None:
            return
        key = _bearer(request)
        if key is None or not hmac.compare_digest(_digest(key), self._metrics_digest):
            raise _unauthorized("/metrics needs the metrics API key (send 'Authorization: Bearer KEY')")

    def _lookup(self, key: str) -> Tenant | None:
        # compare against every key, no early exit: the time does not depend on which key matched
        digest, found = _digest(key), None
        for candidate, tenant in self._by_digest:
            if hmac.compare_digest(digest, candidate):
                found = tenant
        return found


class _SaltDeriver:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def tenant(self, name: str) -> str:
        return hmac.new(self._secret, b"tenant\0" + name.encode(), hashlib.sha256).hexdigest()

    def public(self) -> str:
        return hmac.new(self._secret, b"public\0", hashlib.sha256).hexdigest()

    def fingerprint(self) -> str:
        return hmac.new(self._secret, b"pins\0", hashlib.sha256).hexdigest()[:16]


def _bearer(request: web.Request) -> str | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
