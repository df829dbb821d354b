"""Helpers shared by the reliability tests: settings for a tiny engine, and a gateway served on a
real loopback port from a thread of its own (for synchronous clients such as schemathesis)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import openai
from aiohttp import web

from bench.engine_faults import assert_blocks_released
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.settings import ApiKey, GatewaySettings, Settings
from gateway.state import STATE, GatewayState

ERROR_KEYS = {"message", "type", "param", "code"}
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def served(*args: str, start_timeout_s: float = 120, module: str = "gateway") -> Iterator[subprocess.Popen]:
    """`python -m MODULE serve --port 0 ARGS` as a real process (the gateway's engine in a process of its own,
    or `cluster`: a gateway in front of Ray Serve replicas): yields the Popen with `base_url`, `log_lines`
    (stderr's lines so far, growing) and `log_text()` (all of stderr once the process has exited); killed
    afterwards if alive."""
    if "--responses-db" not in args:  # never the user's cache folder
        args = (*args, "--responses-db", ":memory:")
    cmd = [sys.executable, "-m", module, "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    listening = threading.Event()

    def drain() -> None:  # for the whole life of the process: a full pipe would block the server's logging
        for line in proc.stderr:
            lines.append(line)
            if not listening.is_set() and (match := re.search(r"listening on (http://\S+/v1)", line)):
                proc.base_url = match.group(1)
                listening.set()
        listening.set()  # exited: no more lines

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def log_text() -> str:
        reader.join(30)
        return "".join(lines)

    proc.log_lines, proc.log_text = lines, log_text
    try:
        if not listening.wait(start_timeout_s):
            raise AssertionError("server did not start:\n" + "".join(lines))
        if not hasattr(proc, "base_url"):
            raise AssertionError("server exited before listening:\n" + "".join(lines))
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        reader.join(10)
        proc.stderr.close()


def sdk_client(server: "LiveServer", timeout: float = 30) -> openai.OpenAI:
    """The real openai SDK pointed at a live server (no retries: a test sees every failure)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def ask(text: str) -> list[dict]:
    """A chat with a system prompt of its own, so no earlier test's cache hits it."""
    return [{"role": "system", "content": f"[{uuid.uuid4().hex}] You are a helpful assistant."},
            {"role": "user", "content": text}]


def tiny_settings(model_dir: Path, keys: tuple[ApiKey, ...] = (), engine: dict | None = None,
                  **gateway: Any) -> Settings:
    config = EngineConfig(**{"model": str(model_dir), "block_size": 16, "num_kv_blocks": 128, **(engine or {})})
    # in process: these tests inject faults into the engine and read its pool (test_engine_process.py
    # covers the engine process)
    gateway = {"engine_process": False, "responses_db": ":memory:", **gateway}
    return Settings(config, GatewaySettings(api_keys=keys, salt_secret="test", **gateway))


def is_error_body(body: Any) -> bool:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}, a non-empty message."""
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == ERROR_KEYS and isinstance(body["error"]["message"], str)
            and bool(body["error"]["message"]) and "Traceback" not in body["error"]["message"])


class LiveServer:
    """`with LiveServer(settings) as server:` the gateway at `server.url`, its event loop on a thread."""

    def __init__(self, settings: Settings, engine: Any = None) -> None:
        self.settings = settings
        self._engine = engine  # None: built from settings by create_app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-gateway", daemon=True)
        self._runner: web.AppRunner | None = None
        self.app: web.Application | None = None
        self.url = ""

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        self.call(self._start(), timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._runner is not None:
                self.call(self._runner.cleanup(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]

    @property
    def engine(self) -> Any:
        return self.state.engine

    def call(self, coro: Coroutine, timeout: float = 30) -> Any:
        """Runs `coro` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Every request finished and every KV block back in the free queue (or AssertionError)."""
        self.call(self._wait_idle(timeout), timeout=timeout + 5)

    async def _start(self) -> None:
        self.app = create_app(self.settings, self._engine)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _wait_idle(self, timeout: float) -> None:
        deadline = self.loop.time() + timeout
        while True:
            try:
                assert self.state.admission.in_flight == 0, f"admission counts {self.state.admission.in_flight}"
                assert self.engine.num_unfinished() == 0
                assert_blocks_released(self.engine)
                return
            except AssertionError:
                if self.loop.time() > deadline:
                    raise
                await asyncio.sleep(0.02)
