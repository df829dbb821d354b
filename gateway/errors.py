"""OpenAI error objects: one exception type, one middleware that renders every failure."""
from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger("gateway")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A failure the client sees as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        return error_body(self.message, _TYPE_BY_STATUS.get(self.status, default), self.param, self.code)


ENGINE_RETRY_AFTER_S = 2  # an engine restart takes 3-4 s: the openai SDK's two retries, this far apart, outlast it


def engine_down(message: str, code: str) -> APIError:
    """503 for a request the engine could not serve because it stopped (a restart follows), with Retry-After."""
    return APIError(503, message, code=code, headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> APIError:
    path = request.path if len(request.path) <= 200 else request.path[:200] + "..."
    if exc.status == 404:
        return APIError(404, f"no route {request.method} {path}; this server serves "
                             f"{', '.join(supported_routes(request.app))}", code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return APIError(405, f"{request.method} is not allowed on {path}; allowed: {allowed}",
                        code="method_not_allowed", headers={"Allow": allowed})
    if exc.status == 413:
        return APIError(413, "request body is too large", code="request_too_large")
    return APIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))


def supported_routes(app: web.Application) -> list[str]:
    """"METHOD /path" of every route the app serves (the chat page's files and CORS preflights aside)."""
    routes = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "OPTIONS", "*") and not path.startswith("/static/"):
            routes.append(f"{route.method} {path}")
    return sorted(set(routes), key=lambda r: (r.split()[1], r))


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turns every exception into an OpenAI error object; never a traceback."""
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through
            raise
        return error_response(_from_http_exception(exc, request))
    except web.RequestPayloadError:  # a body its Content-Encoding does not decode
        encoding = request.headers.get("Content-Encoding", "none")
        response = error_response(APIError(400, f"the request body could not be decoded (Content-Encoding: "
                                                f"{encoding[:40]})", code="invalid_body"))
        response.force_close()  # the rest of the body is unread: the connection cannot carry another request
        return response
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.rel_url.raw_path)
        return error_response(APIError(500, "internal server error", code="internal_error"))
