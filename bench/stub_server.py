"""The real gateway over an instant engine stub, for measuring the gateway alone (benchmark use only).

`python -m bench.stub_server MODEL_DIR` prints `READY <port>` once it listens on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

from engine.config import EngineConfig
from engine.messages import CacheErased, PinInfo
from engine.outputs import FinishReason, RequestOutput
from engine.stats import SchedulerStats
from engine.tokenizer import load_tokenizer
from gateway.app import create_app
from gateway.settings import GatewaySettings, Settings


class InstantEngine:
    """An EngineClient (engine/client.py) whose every request gets `reply` as one token at once (the chat
    page's tests use it for a hostile reply)."""

    def __init__(self, model_path: Path, reply: str = "ok") -> None:
        self.config = EngineConfig(model=str(model_path), max_num_seqs=256)
        self.tokenizer = load_tokenizer(model_path, set())
        self.model_name = "stub"
        self.model_path = model_path
        self.max_model_len = 8192
        self.threads = None
        self.reply = reply

    def start(self) -> None:
        pass

    def health_details(self) -> dict:
        return {}

    def request_ids(self) -> list[str]:
        return []

    async def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    async def generate(self, request_id, prompt_token_ids, params, *, cache_salt=None, tenant=None, cache=None,
                       stream=True):
        yield RequestOutput(request_id, [0], self.reply, None, len(prompt_token_ids), 0, 1, finished=True,
                            finish_reason=FinishReason.LENGTH)

    async def list_pins(self, tenant: str) -> list[PinInfo]:
        return []  # it caches nothing

    async def erase_cache(self, tenant: str) -> CacheErased:
        return CacheErased()

    def abort(self, request_id: str) -> None:
        pass

    def add_stats_listener(self, fn) -> None:
        pass

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats()

    def num_unfinished(self) -> int:
        return 0


async def serve(model_path: Path) -> None:
    settings = Settings(engine=EngineConfig(model=str(model_path)),
                        gateway=GatewaySettings(port=0, log_level="warning", max_waiting_requests=1024))
    runner = web.AppRunner(create_app(settings, engine=InstantEngine(model_path)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print("READY", runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.run(serve(Path(sys.argv[1])))
    except KeyboardInterrupt:
        pass
