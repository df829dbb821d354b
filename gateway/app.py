"""The aiohttp application: routes, middlewares, and the engine's life in cleanup_ctx."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from engine.client import EngineClient
from gateway import cache_routes, routes, tokenize
from gateway.admission import Admission
from gateway.auth import Authenticator
from gateway.cache_stats import CACHE_STATS, CacheStats
from gateway.cors import Cors
from gateway import responses
from gateway.embeddings import embeddings
from gateway.response_store import open_store
from gateway.response_store_pending import PendingPuts
from gateway.responses import RESPONSE_STORE
from gateway.salt_secret import SaltSecret, resolve_salt_secret
from gateway.errors import APIError, error_middleware, error_response
from gateway.generate import Shutdown
from gateway.generation_defaults import parse_override, sampling_defaults
from gateway.reasoning import template_thinks
from gateway.settings import Settings
from gateway.state import STATE, GatewayState, api_model_name
from gateway.tool_prompt import TOOL_TEMPLATE, detect_tool_template

log = logging.getLogger("gateway")

REQUEST_ID = contextvars.ContextVar("request_id", default="-")  # for log lines (see RequestIdFilter)
REQUEST_ID_KEY = web.RequestKey("request_id", str)


class InFlight:
    """The handler tasks now running, so shutdown can wait for them, then end the rest."""

    def __init__(self, retry_after_s: int) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.draining = False
        self.shutdown = Shutdown(retry_after_s)
        self.ending = asyncio.Event()  # set by a second signal: the drain stops waiting at once

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (/health: 503 `draining`), wait up to `timeout` for running ones (less once
        `ending` is set: a second signal), then end
        the rest with their terminal event (a 503 with Retry-After; a stream's error event and its end) and
        abort their engine requests; a handler still not done GOODBYE_S later is cancelled. Returns how
        many were still running at the deadline."""
        self.draining = True
        pending = {task for task in self.tasks if not task.done()}
        loop = asyncio.get_running_loop()
        deadline, ending = loop.time() + timeout, asyncio.ensure_future(self.ending.wait())
        while pending and not ending.done() and (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait({*pending, ending}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
        ending.cancel()
        if pending:
            self.shutdown.cut_off()
            _, stuck = await asyncio.wait(pending, timeout=GOODBYE_S)
            for task in stuck:  # not waiting on the engine (a client that reads nothing, say)
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=5)
        return len(pending)


IN_FLIGHT = web.AppKey("in_flight", InFlight)
_CLIENT_REQUEST_ID = re.compile(r"[\w.:/+=@-]{1,128}")
GOODBYE_S = 5.0  # after the drain: how long a request cut off has to send its terminal event
BODILESS_METHODS = frozenset({"GET", "HEAD", "DELETE"})
_QUIET_ROUTES = frozenset({"/health", "/metrics"})  # probes and scrapes: access lines at DEBUG only


class EngineGaveUp:
    """Set when the engine died more often than --engine-restarts allows: `serve` then stops and exits 1."""

    def __init__(self) -> None:
        self.event = asyncio.Event()


ENGINE_GAVE_UP = web.AppKey("engine_gave_up", EngineGaveUp)

# every route: (method, path, handler)
_ROUTES = (
    ("POST", "/v1/chat/completions", routes.chat_completions), ("POST", "/v1/completions", routes.completions),
    ("GET", "/v1/models", routes.models), ("GET", "/v1/models/{model_id:.+}", routes.model),
    ("GET", "/health", routes.health), ("GET", "/ping", routes.ping), ("POST", "/ping", routes.ping),
    ("GET", "/version", routes.version), ("GET", "/metrics", routes.metrics), ("GET", "/openapi.json", routes.openapi),
    ("GET", "/v1/cache/stats", routes.cache_stats), ("GET", "/v1/cache", cache_routes.list_pins),
    ("DELETE", "/v1/cache", cache_routes.erase), ("POST", "/v1/cache/warm", cache_routes.warm),
    ("POST", "/v1/embeddings", embeddings),
    ("POST", "/v1/responses", responses.create), ("POST", "/v1/responses/input_tokens", responses.input_tokens),
    ("GET", "/v1/responses/{response_id}", responses.retrieve),
    ("DELETE", "/v1/responses/{response_id}", responses.delete),
    ("GET", "/v1/responses/{response_id}/input_items", responses.input_items),
    ("POST", "/v1/responses/{response_id}/cancel", responses.cancel),
    ("POST", "/tokenize", tokenize.tokenize), ("POST", "/detokenize", tokenize.detokenize),
    ("GET", "/tokenizer_info", tokenize.tokenizer_info),
    ("GET", "/", routes.chat_page), ("GET", "/static/{name}", routes.static_file),
)


def scoped_settings(settings: Settings) -> tuple[Settings, Authenticator, SaltSecret]:
    """The salt secret resolved (kept in the settings), the keys' authenticator, and the engine's pin scope: the
    secret's fingerprint and the tenants, so an engine restores only the saved pins someone can still hit, list
    and erase. Bad key settings fail here, before any model loads. The cluster scopes its replicas' settings
    with it before it deploys them."""
    secret = resolve_salt_secret(settings.gateway.salt_secret)
    settings = dataclasses.replace(settings, gateway=settings.gateway.replace(salt_secret=secret.value))
    auth = Authenticator(settings.gateway)
    settings = dataclasses.replace(settings, engine=settings.engine.replace(salt_fingerprint=auth.salt_fingerprint,
                                                                            tenants=tuple(auth.tenant_names)))
    return settings, auth, secret


def create_app(settings: Settings, engine: EngineClient | None = None) -> web.Application:
    """`engine`: an engine client not yet started (tests); None launches one from settings: the engine
    process (default), or an in-process engine with `engine_process` off. Either way the app starts it on
    startup and shuts it down on cleanup."""
    settings, auth, secret = scoped_settings(settings)
    app = web.Application(client_max_size=settings.gateway.max_body_bytes,
                          middlewares=[observe_middleware, error_middleware, bodiless_middleware])
    app[IN_FLIGHT] = InFlight(settings.gateway.retry_after_s)
    app[ENGINE_GAVE_UP] = EngineGaveUp()
    app.on_response_prepare.append(_add_request_id)
    if settings.gateway.allowed_origins:
        Cors(settings.gateway.allowed_origins).install(app)
    app.cleanup_ctx.append(partial(_engine_ctx, settings, engine, auth, secret))
    gw = settings.gateway
    app[RESPONSE_STORE] = PendingPuts(open_store(gw.responses_store_max, gw.responses_db, gw.responses_ttl_days))
    app.on_cleanup.append(_close_response_store)
    app.router.add_routes([web.route(method, path, handler) for method, path, handler in _ROUTES])
    return app


async def _close_response_store(app: web.Application) -> None:
    await app[RESPONSE_STORE].aclose()


async def _launch_engine(settings: Settings, gave_up: EngineGaveUp) -> EngineClient:
    if settings.gateway.engine_process:
        from engine.process_client import ProcessClient

        return await ProcessClient.launch(settings.engine, max_restarts=settings.gateway.engine_restarts,
                                          on_fatal=gave_up.event.set)
    from engine.async_engine import AsyncEngine  # loads torch into this process

    log.info("loading model %s", settings.engine.model)
    return await asyncio.to_thread(AsyncEngine.from_config, settings.engine)


async def _engine_ctx(settings: Settings, engine: EngineClient | None, auth: Authenticator, salt_secret: SaltSecret,
                      app: web.Application) -> AsyncIterator[None]:
    from metrics.prometheus import Metrics

    salt_secret.log()  # (logging is set up by now)
    if engine is None:
        engine = await _launch_engine(settings, app[ENGINE_GAVE_UP])
    served = settings.gateway.served_model_name
    metrics = Metrics(api_model_name(settings, engine), auth.tenant_names, vllm_names=settings.gateway.vllm_metrics)
    engine.add_stats_listener(metrics.on_step)
    app[CACHE_STATS] = CacheStats()
    engine.add_stats_listener(app[CACHE_STATS].on_step)
    metrics.set_threads(engine.threads)
    if hasattr(engine, "register_metrics"):  # the cluster client: per-replica series
        engine.register_metrics(metrics.registry)
    admission = Admission(engine.config.max_num_seqs, settings.gateway.max_waiting_requests,
                          settings.gateway.retry_after_s)
    metrics.admission.watch(lambda: admission.in_flight, admission.capacity)
    store = app[RESPONSE_STORE]
    metrics.responses.watch(store)  # its counts as of the last call: a scrape never reads the database
    names = frozenset(served or {engine.model_name, settings.engine.model})
    gw = settings.gateway
    defaults = sampling_defaults(engine.model_path, gw.generation_config, parse_override(gw.override_generation_config),
                                 gw.default_max_tokens)
    # the cap a request without max_tokens really gets (check_lengths), so a client may send it as it is
    caps = [cap for cap in (defaults["max_tokens"], gw.max_tokens_limit) if cap is not None]
    defaults["max_tokens"] = min(caps, default=None)
    app[STATE] = GatewayState(settings, engine, auth, admission, metrics, names, app[IN_FLIGHT].shutdown, defaults)
    app[TOOL_TEMPLATE] = detect_tool_template(engine.tokenizer, settings.gateway.tool_call_parser,
                                              settings.gateway.exclude_tools_when_tool_choice_none)
    app[STATE].splits_thinking = template_thinks(engine.tokenizer, settings.gateway.reasoning_parser)
    engine.start()
    log.info("serving model %s (context %d tokens)", app[STATE].model_name, engine.max_model_len)
    yield
    # `serve` has already drained the HTTP requests (InFlight.drain); this lets whatever the
    # engine still holds finish or aborts it, then stops the engine thread
    await engine.shutdown(timeout=settings.gateway.shutdown_timeout_s)


@web.middleware
async def observe_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Request id (echoed or generated), one access log line, and the HTTP metrics."""
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    request[REQUEST_ID_KEY] = request_id
    REQUEST_ID.set(request_id)
    start = time.perf_counter()
    status = 499  # stays so if the client goes away and the handler is cancelled
    in_flight = request.app[IN_FLIGHT]
    task = asyncio.current_task()
    in_flight.tasks.add(task)
    try:
        if in_flight.draining:
            response = error_response(_refused_while_draining(request.path, in_flight.shutdown.retry_after_s))
        else:
            response = await handler(request)
        status = response.status
        return response
    finally:
        in_flight.tasks.discard(task)
        seconds = time.perf_counter() - start
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"  # bounded label set
        request.app[STATE].metrics.on_http(route, request.method, status, seconds)
        level = logging.DEBUG if route in _QUIET_ROUTES and status < 400 else logging.INFO
        # the path as sent, still percent-encoded: a decoded %0A or %00 would forge or break log lines
        log.log(level, "%s %s %d %.3fs", request.method, request.rel_url.raw_path, status, seconds)


def _refused_while_draining(path: str, retry_after_s: int) -> APIError:
    headers = {"Connection": "close", "Retry-After": str(retry_after_s)}
    if path == "/health":  # a load balancer's probe: send nothing more here
        return APIError(503, "the server is draining: it finishes the requests it has, then stops",
                        code="draining", headers=headers)
    return APIError(503, "the server is shutting down", code="shutting_down", headers=headers)


@web.middleware
async def bodiless_middleware(request: web.Request, handler) -> web.StreamResponse:
    """GET, HEAD and DELETE take no body: one sent anyway is refused unread (413 past max_body_bytes)."""
    if request.method in BODILESS_METHODS and request.body_exists:
        if (request.content_length or 0) > request.app[STATE].settings.gateway.max_body_bytes:
            raise APIError(413, "request body is too large", code="request_too_large")
        raise APIError(400, f"{request.method} {request.path[:200]} takes no request body", code="unexpected_body")
    return await handler(request)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(REQUEST_ID_KEY)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (from the handler's context; "-" elsewhere)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True
