"""CORS, off unless origins are configured: lets a browser chat UI on another origin call the API.

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before auth: browsers
send it without credentials. Every other response from an allowed origin gets the allow headers
when it is prepared, so streamed responses carry them too.
"""
from __future__ import annotations

from aiohttp import web

from gateway.errors import error_response, invalid

ALLOWED_METHODS = "GET, POST, OPTIONS"
EXPOSED_HEADERS = "X-Request-Id, Retry-After"
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    def __init__(self, allowed_origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self.preflight_middleware)
        app.on_response_prepare.append(self.add_headers)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any_origin or origin in self.origins)

    @web.middleware
    async def preflight_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            return error_response(invalid(f"origin {origin!r} is not allowed (allowed_origins)", None,
                                          "cors_origin_not_allowed"))
        headers = {"Access-Control-Allow-Methods": ALLOWED_METHODS,
                   "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}
        if requested := request.headers.get("Access-Control-Request-Headers"):
            headers["Access-Control-Allow-Headers"] = requested
        return web.Response(status=204, headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.any_origin else origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        if not self.any_origin:
            response.headers["Vary"] = "Origin"
