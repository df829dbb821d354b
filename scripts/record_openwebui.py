"""Records what a real Open WebUI sends to prefixgate and what it makes of the answers, as the openwebui-*
fixtures of tests/gateway/test_replay.py (docs/clients.md, "Re-recording Open WebUI").

Three steps, with Open WebUI (a venv of its own, not a project dependency) started in between:

    .venv/bin/python scripts/record_openwebui.py serve /tmp/owui.jsonl     # prefixgate :8767 behind a proxy :8765
    OPENAI_API_BASE_URL=http://127.0.0.1:8765/v1 OPENAI_API_KEY=sk-replay ... open-webui serve --port 3000
    .venv/bin/python scripts/record_openwebui.py drive http://127.0.0.1:3000 /tmp/owui.jsonl
    .venv/bin/python scripts/record_openwebui.py fixtures /tmp/owui.jsonl

`serve` runs the replay suite's tiny random-weight model (built as tests/conftest.py's tiny_tools_dir) with the
suite's default cap, behind scripts/record_client_traffic.py's recording proxy; each exchange is appended to the
log as one JSON line (the API key redacted, cookies dropped). `drive` runs Open WebUI in Chromium: a new chat of
two turns with the model's default capabilities (Builtin Tools on, so its own tools go with each turn), then,
with the Usage capability ticked, a new chat of one turn; it waits for the background tasks (title, tags,
follow-ups) after each turn and saves the chats Open WebUI stored beside the log. `fixtures` sorts the
exchanges into flows and writes them with what Open WebUI parsed and the answer fields it reads.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from aiohttp import ClientSession, ClientTimeout, web  # noqa: E402

from record_client_traffic import API_KEY, DEFAULT_MAX_TOKENS, FIXTURES, Recorder, reads_of, write_fixture  # noqa: E402

VERSION = "0.12.4"  # the Open WebUI recorded; drive checks it
MODEL = "tiny-tools"
GATEWAY_PORT, PROXY_PORT = 8767, 8765
TURNS = ["What is the capital of France?", "And what is it famous for?"]
# the editor's default capabilities (Admin Panel > Settings > Models > edit), with Usage ticked
USAGE_CAPABILITIES = dict.fromkeys(["vision", "file_context", "file_upload", "web_search", "image_generation",
                                    "code_interpreter", "terminal", "citations", "status_updates", "usage",
                                    "memory", "builtin_tools"], True)
# what Open WebUI reads of an answer (open_webui/utils/middleware.py: the stream handler, the background tasks;
# open_webui/utils/response.py normalize_usage), kept where our answer carries it
CHUNK_READS = ["choices", "choices.0.finish_reason", "choices.0.delta.content", "choices.0.delta.tool_calls",
               "usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens",
               "usage.prompt_tokens_details.cached_tokens"]
TASK_READS = ["choices", "choices.0.message.content"]
MODELS_READS = ["data", "data.0.id"]
TASKS = {"### Task:\nGenerate a concise title": "title", "### Task:\nGenerate 1-3 broad tags": "tags",
         "### Task:\nPredict 3-5 useful messages": "follow-ups"}


# --- serve: prefixgate behind the recording proxy ---------------------------------------------------------------

class LoggingRecorder(Recorder):
    """The recording proxy, each exchange appended to `log` as it ends."""

    def __init__(self, upstream: str, log: Path) -> None:
        super().__init__(upstream)
        self.log = log

    async def handle(self, request: web.Request) -> web.StreamResponse:
        response = await super().handle(request)
        exchange = self.exchanges[-1]
        headers = exchange["request"]["headers"]
        headers.pop("cookie", None)
        if "authorization" in headers:
            headers["authorization"] = f"Bearer {API_KEY}"
        with self.log.open("a") as f:
            f.write(json.dumps(exchange) + "\n")
        print(request.method, request.path, exchange["response"]["status"], flush=True)
        return response


async def listen(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def serve(log: Path, model_dir: Path) -> None:
    from bench.tiny_models import build_tiny_model
    from engine.config import EngineConfig
    from gateway.app import create_app
    from gateway.settings import GatewaySettings, Settings
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, "qwen2", tools=True)
    # Open WebUI's tools make a prompt of about 20k tokens in the tiny tokenizer: a context and pool to hold it
    settings = Settings(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=2048, max_model_len=32768),
                        GatewaySettings(salt_secret="replay", engine_process=False, responses_db=":memory:",
                                        default_max_tokens=DEFAULT_MAX_TOKENS))
    gateway = await listen(create_app(settings), GATEWAY_PORT)
    recorder = LoggingRecorder(f"http://127.0.0.1:{GATEWAY_PORT}", log)
    proxy = web.Application(client_max_size=50 * 2**20)
    proxy.router.add_route("*", "/{tail:.*}", recorder.handle)
    proxy_runner = await listen(proxy, PROXY_PORT)
    print(f"recording http://127.0.0.1:{PROXY_PORT}/v1 -> prefixgate :{GATEWAY_PORT} into {log}", flush=True)
    try:
        async with ClientSession(auto_decompress=False, timeout=ClientTimeout(total=None)) as recorder.session:
            await asyncio.Event().wait()
    finally:
        await proxy_runner.cleanup()
        await gateway.cleanup()


# --- drive: Open WebUI in Chromium ------------------------------------------------------------------------------

def drive(owui: str, log: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    def exchanges() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    def send(page, text: str, quiet_s: float = 25, limit_s: float = 600) -> None:
        """Sends a turn; returns once the log has grown and then stayed still for `quiet_s` (tasks done)."""
        before = exchanges()
        page.locator("#chat-input").click()
        page.keyboard.type(text)
        page.keyboard.press("Enter")
        start = last = time.time()
        count = before
        while (now := exchanges()) == before or now != count or time.time() - last < quiet_s:
            if now != count:
                count, last = now, time.time()
            if time.time() - start > limit_s:
                raise TimeoutError(f"{text!r}: the log still grows after {limit_s} s")
            time.sleep(1)
        print(f"{text!r}: exchanges {before} to {count}", flush=True)

    def new_chat(page) -> None:
        page.goto(owui, wait_until="domcontentloaded", timeout=300_000)
        page.wait_for_selector("#chat-input", timeout=300_000)
        page.wait_for_timeout(3000)
        page.keyboard.press("Escape")  # the "what's new" modal shown on a first start

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 860})
        version = page.request.get(owui + "/api/version").json()["version"]
        assert version == VERSION, f"Open WebUI {version}; the fixtures name {VERSION}: change VERSION"
        new_chat(page)
        auth = {"Authorization": f"Bearer {page.evaluate('localStorage.token')}"}
        # a model entry left by an earlier run: gone, so that the first chat has the default capabilities (the
        # page's reload makes Open WebUI read the models again)
        page.request.post(owui + "/api/v1/models/model/delete", headers=auth, data={"id": MODEL})
        new_chat(page)
        for text in TURNS:
            send(page, text)
        created = page.request.post(owui + "/api/v1/models/create", headers=auth, data={
            "id": MODEL, "base_model_id": None, "name": MODEL, "meta": {"capabilities": USAGE_CAPABILITIES},
            "params": {}})
        assert created.ok, created.text()
        new_chat(page)
        usage_chat_from = exchanges()
        send(page, TURNS[0])
        chats = page.request.get(owui + "/api/v1/chats/?page=1", headers=auth).json()[:2]  # newest first
        stored = [page.request.get(f"{owui}/api/v1/chats/{c['id']}", headers=auth).json() for c in reversed(chats)]
        for chat in stored:
            chat["tags"] = page.request.get(f"{owui}/api/v1/chats/{chat['id']}/tags", headers=auth).json()
        chats_file(log).write_text(json.dumps({"chats": stored, "usage_chat_from": usage_chat_from}, indent=1,
                                              ensure_ascii=False))
        browser.close()


def chats_file(log: Path) -> Path:
    return log.with_suffix(".chats.json")


# --- fixtures: the log sorted into flows ------------------------------------------------------------------------

def kind(exchange: dict) -> str:
    body = exchange["request"]["body"]
    if body is None:
        return "models"
    first = body["messages"][0]["content"]
    return next((task for prefix, task in TASKS.items() if first.startswith(prefix)),
                "chat-usage" if "stream_options" in body else "chat")


def parsed_chat(chat: dict) -> dict:
    """What Open WebUI made of one chat: its title and tags, and per answer the text, usage and follow-ups."""
    messages = chat["chat"]["history"]["messages"].values()
    return {"title": chat["title"], "tags": [t["name"] for t in chat["tags"]],
            "answers": [{key: m[key] for key in ("content", "usage", "followUps") if key in m}
                        for m in sorted(messages, key=lambda m: m["timestamp"]) if m["role"] == "assistant"]}


FLOWS = {  # flow -> (exchange kinds, reads, what the fixture is)
    "openwebui-chat": (("models", "chat"), CHUNK_READS,
                       "A new chat's two turns with the model's default capabilities: Builtin Tools on, so each "
                       "turn carries Open WebUI's own tools; no max_tokens (the server's default cap ends the "
                       "answer), no stream_options."),
    "openwebui-chat-usage": (("chat-usage",), CHUNK_READS,
                             "A new chat's first turn once the model's Usage capability is ticked: Open WebUI then "
                             "asks for stream_options.include_usage and shows the usage chunk's counts."),
    "openwebui-title": (("title",), TASK_READS,
                        "The title task, sent as the chat starts (the answer not yet in its history), with "
                        "max_tokens 1000. Open WebUI takes the JSON object in choices[0].message.content; from the "
                        "random model's text it finds none and names the chat after the question."),
    "openwebui-tags": (("tags",), TASK_READS,
                       "The tags task after the first answer, with no max_tokens: the server's default cap ends it."),
    "openwebui-follow-ups": (("follow-ups",), TASK_READS,
                             "The follow-up task after each answer, with no max_tokens."),
}


def fixtures(log: Path) -> None:
    recorded = [json.loads(line) for line in log.read_text().splitlines()]
    stored = json.loads(chats_file(log).read_text())
    chat, usage_chat = stored["chats"]
    parsed = {"openwebui-chat": parsed_chat(chat), "openwebui-chat-usage": parsed_chat(usage_chat)}
    parsed["openwebui-title"] = {"title": chat["title"]}
    parsed["openwebui-tags"] = {"tags": parsed["openwebui-chat"]["tags"]}
    parsed["openwebui-follow-ups"] = {"follow_ups": [a["followUps"] for a in parsed["openwebui-chat"]["answers"]]}
    recorded_on = next(datetime.fromtimestamp(e["response"]["body"]["created"], timezone.utc).date()
                       for e in recorded if "created" in (e["response"].get("body") or {}))
    for flow, (kinds, paths, note) in FLOWS.items():
        # the first chat's exchanges (one GET of the models list), or the usage chat's turn
        chosen = [e for i, e in enumerate(recorded) if kind(e) in kinds
                  and (i < stored["usage_chat_from"]) != (flow == "openwebui-chat-usage")]
        chosen = [e for i, e in enumerate(chosen) if kind(e) != "models" or i == 0]
        write_fixture(flow, {
            "flow": flow, "client": "open-webui", "version": VERSION, "api": "chat completions",
            "source": f"recorded from Open WebUI {VERSION} (driven in Chromium) through a pass-through proxy by "
                      f"scripts/record_openwebui.py on {recorded_on}, against prefixgate on a tiny random-weight "
                      f"model (default max_tokens {DEFAULT_MAX_TOKENS})",
            "note": note, "model": MODEL, "client_parsed": parsed[flow],
            "exchanges": [{**e, "reads": reads_of(e["response"], MODELS_READS if kind(e) == "models" else paths)}
                          for e in chosen]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    step = steps.add_parser("serve", help="prefixgate behind the recording proxy")
    step.add_argument("log", type=Path)
    step.add_argument("--model-dir", type=Path, default=Path("/tmp/record-openwebui") / MODEL)
    step = steps.add_parser("drive", help="Open WebUI's flows in Chromium")
    step.add_argument("owui")
    step.add_argument("log", type=Path)
    step.add_argument("--chromium", default="/usr/bin/chromium")
    step = steps.add_parser("fixtures", help=f"write {FIXTURES.relative_to(REPO)}/openwebui-*.json")
    step.add_argument("log", type=Path)
    args = parser.parse_args()
    if args.step == "serve":
        asyncio.run(serve(args.log, args.model_dir))
    elif args.step == "drive":
        drive(args.owui, args.log, args.chromium)
    else:
        fixtures(args.log)


if __name__ == "__main__":
    main()
