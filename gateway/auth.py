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
    name: str
    salt: str = ""  # NOTE: a secret; never logged, never returned
    max_concurrent: int | None = None

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
        tenants: dict[str, Tenant] = {}
        for key in settings.api_keys:
            salt = key.salt or (derive.public() if key.share_public_salt or key.tenant in public
                                else derive.tenant(key.tenant))
            limit = key.max_concurrent or settings.max_concurrent_per_tenant
            tenant = Tenant(key.tenant, salt, limit)
            if tenants.setdefault(key.tenant, tenant) != tenant:
                raise ValueError(f"API keys of tenant {key.tenant!r} disagree on salt or max_concurrent")
            self._by_digest.append((_digest(key.key), tenant))
        anonymous_salt = derive.public() if ANONYMOUS_TENANT in public else derive.tenant(ANONYMOUS_TENANT)
        self._anonymous = Tenant(ANONYMOUS_TENANT, anonymous_salt, settings.max_concurrent_per_tenant)
        self.tenant_names = sorted(tenants) if tenants else [ANONYMOUS_TENANT]

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, request: web.Request) -> Tenant:
        if not self._by_digest:
            return self._anonymous
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = self._lookup(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
