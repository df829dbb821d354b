"""`python -m gateway serve`: every engine and gateway knob is a flag; flags override the YAML file."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import inspect
import logging
import re
import signal
import socket
import sys
import types
import typing
from typing import Any

from aiohttp import web

from engine.config import EngineConfig, settable
from gateway.app import ENGINE_GAVE_UP, IN_FLIGHT, InFlight, RequestIdFilter, create_app
from gateway.settings import DEFAULT_CONFIG_PATH, GatewaySettings, Settings, field_types, load_settings, parse_value

log = logging.getLogger("gateway")
_SPECIAL = {"api_keys_file"}  # gateway fields with a hand-written flag
_ENGINE_HELP = {  # engine fields without a comment in engine/config.py
    "model": "a .gguf file, a model directory (Hugging Face layout), or 'default' for SmolLM2-135M-Instruct",
    "block_size": "tokens per KV block (the prefix cache's unit)",
    "kv_cache_memory_mb": "KV pool size when num_kv_blocks is none",
    "max_num_seqs": "most sequences in one running batch",
    "enable_prefix_caching": "reuse cached KV blocks of earlier prompts",
    "hash_algo": "block hash function",
    "scheduling_policy": "order of waiting requests (lpm: cached prefixes first)",
    "seed": "engine seed for unseeded sampling",
    "num_kv_blocks": "KV blocks in the pool (none: size it from kv_cache_memory_mb)",
    "max_model_len": "context length (none: the model's own)",
    "threads": "CPU compute threads of decode-only steps (none: the fastest, timed at start-up)",
    "threads_batch": "CPU compute threads of steps with a prefill chunk (none: timed at start-up)",
    "model_cache_dir": "where the default model is converted to on first use",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="prefixgate: OpenAI-compatible server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI API")
    serve.add_argument("--config", default=None,
                       help=f"YAML settings file (default: {DEFAULT_CONFIG_PATH}, if it exists)")
    engine = serve.add_argument_group("engine (configs/default.yaml `engine:`)")
    _add_flags(engine, EngineConfig, set())
    gateway = serve.add_argument_group("gateway (configs/default.yaml `gateway:`)")
    _add_flags(gateway, GatewaySettings, {"api_keys"} | _SPECIAL)
    gateway.add_argument("--api-key", action="append", dest="api_key", default=argparse.SUPPRESS,
                         metavar="KEY[:TENANT]",
                         help="an accepted API key (repeatable). Keys that name the same TENANT share its cache; "
                              "a key without one is a tenant of its own, named key-<first 8 hex of sha256(KEY)>")
    gateway.add_argument("--api-keys-file", dest="gateway.api_keys_file", default=argparse.SUPPRESS,
                         metavar="PATH",
                         help="YAML: key -> {tenant, salt?, max_concurrent?, share_public_salt?, max_pinned_blocks?}")
    return parser


def _add_flags(group: argparse._ArgumentGroup, cls: type, skip: set[str]) -> None:
    """One flag per dataclass field; only flags given on the command line override the YAML."""
    section = "engine" if cls is EngineConfig else "gateway"
    types_ = field_types(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not settable(f):
            continue
        hint, flag = types_[f.name], "--" + f.name.replace("_", "-")
        base = _base_type(hint)
        help_text = f.metadata.get("help") or _ENGINE_HELP.get(f.name) or comments.get(f.name, "")
        common: dict[str, Any] = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                                      help=f"{help_text} (default: {_show(f.default)})".lstrip())
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif typing.get_origin(hint) is tuple:
            group.add_argument(flag, nargs="*", metavar="NAME", **common)
        else:
            choices = [m.value for m in base] if isinstance(base, type) and issubclass(base, enum.Enum) else None
            group.add_argument(flag, type=_converter(hint), choices=choices, metavar=_metavar(base, hint), **common)


def _field_comments(cls: type) -> dict[str, str]:
    """The `# ...` comment after each field in the class source, or else the comment lines right above it: the
    flag's help text."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        if match := re.match(r"\s+#\s*(.+)$", line):
            above.append(match.group(1))
            continue
        if match := re.match(r"\s+(\w+): [^#]*#\s*(.+)$", line):
            comments[match.group(1)] = match.group(2)
        elif (match := re.match(r"\s+(\w+): ", line)) and above:
            comments[match.group(1)] = " ".join(above)
        above = []
    return comments


def _converter(hint: Any):
    def convert(text: str) -> Any:
        try:
            return parse_value(hint, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(_base_type(hint), "__name__", "value")
    return convert


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def _metavar(base: Any, hint: Any) -> str:
    enum_ = isinstance(base, type) and issubclass(base, enum.Enum)
    name = "|".join(m.value for m in base) if enum_ else base.__name__.upper()  # the choices, where there are few
    return f"{name}|none" if base is not hint else name


def _show(default: Any) -> Any:
    if default is None:
        return "none"
    if isinstance(default, tuple):
        return " ".join(default) or "[]"
    return default.value if isinstance(default, enum.Enum) else default


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = vars(args)
    engine = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("engine.")}
    gateway = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("gateway.")}
    config = args.config or (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None)
    return load_settings(config, engine, gateway, given.get("api_key", []))


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class StartupError(Exception):
    """A setting the server could not start with (a model that does not load, a port in use)."""


def _bound_sockets(host: str, port: int) -> list[socket.socket]:
    """A socket bound to each address the host resolves to, as asyncio's create_server binds them (SO_REUSEADDR,
    IPv6 sockets v6-only), for the sites to listen on once the engine is up: bound before the model loads, a port
    in use fails at once (a first start compiles kernels for a minute and more), and nobody takes the port
    meanwhile. Not listening yet: a client that comes early is refused, not left waiting."""
    sockets = []
    try:
        try:
            addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as exc:  # (the resolver's own words name neither the host nor the flag)
            raise OSError(exc.errno, f"--host {host!r} does not resolve: {exc.strerror}") from None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def serve(settings: Settings, app: web.Application) -> int:
    """Stops accepting on SIGTERM/SIGINT, lets in-flight requests finish within shutdown_timeout_s,
    cancels the rest (their engine requests are aborted), then shuts the engine down. Returns the exit
    code: 0, or 1 when the engine died more often than engine_restarts allows."""
    gw = settings.gateway
    try:
        sockets = _bound_sockets(gw.host, gw.port)
    except OSError as exc:
        raise StartupError(str(exc)) from None
    # in-flight requests get shutdown_timeout_s from InFlight.drain; aiohttp's own wait is a backstop
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0,
                           handler_cancellation=True)
    sites = []
    try:
        await runner.setup()  # loads the model and starts the engine
        for sock in sockets:
            sites.append(web.SockSite(runner, sock))
            await sites[-1].start()
    except Exception as exc:  # the engine's own checks, a missing model, a device torch lacks, a conversion failed
        log.debug("start-up failed", exc_info=True)  # (one line, as in the engine process, which catches all)
        await runner.cleanup()
        for sock in sockets:
            sock.close()
        raise StartupError(str(exc) or type(exc).__name__) from None  # (an empty message: "error: " said nothing)
    if settings.gateway.api_keys and not settings.gateway.metrics_api_key:
        log.warning("/metrics is open and lists tenant names; set --metrics-api-key to require a key")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, port = runner.addresses[0][:2]  # the real port when --port 0
    log.info("listening on http://%s:%d/v1 (auth %s); the chat page is at http://%s:%d/", host, port,
             "on" if gw.api_keys else "off", host, port)
    gave_up = app[ENGINE_GAVE_UP].event
    await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(gave_up.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down: waiting up to %.1fs for in-flight requests (a second Ctrl-C ends them now)",
             gw.shutdown_timeout_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _end_now, app[IN_FLIGHT])
    for site in sites:
        await site.stop()  # stop accepting; kept-alive connections get 503 while draining
    cancelled = await app[IN_FLIGHT].drain(gw.shutdown_timeout_s)
    if cancelled:
        log.info("aborted %d requests still running after %.1fs", cancelled, gw.shutdown_timeout_s)
    await runner.cleanup()  # closes connections, then the engine shuts down (cleanup_ctx)
    if gave_up.is_set():
        log.error("stopped: the engine kept dying")
        return 1
    log.info("stopped")
    return 0


def _end_now(in_flight: InFlight) -> None:
    """A second signal during the drain: the drain's deadline comes at once, so the requests still running end
    with their terminal event (a handler not waiting on the engine is cancelled GOODBYE_S later), and the
    server stops without waiting out shutdown_timeout_s."""
    if not in_flight.ending.is_set():
        log.info("second signal: ending the requests still running now")
        in_flight.ending.set()


def main(argv: list[str] | None = None) -> int:
    """0 after a clean shutdown; 2 with `error: ...` on stderr for any setting it cannot start with; 1 when
    the engine kept dying."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        setup_logging(settings.gateway.log_level)  # (before create_app: its warnings, a store kept in memory, too)
        app = create_app(settings)  # key and tenant settings are checked here, before the model loads
    except (ValueError, OSError) as exc:
        return _config_error(exc)
    import uvloop

    try:
        return uvloop.run(serve(settings, app))
    except StartupError as exc:
        return _config_error(exc)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (the signal handlers come once it serves)
        print("interrupted while starting", file=sys.stderr)
        return 130


def _config_error(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
