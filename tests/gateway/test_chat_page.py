"""The chat page at / in a real browser: Debian's Chromium, headless, driven by Playwright (make test installs
both; Playwright's own browser download needs the internet). A message streams in, the second turn of a chat
reports cached tokens, the stop button ends the request on the server, the cache panel moves, a hostile
reply stays text, the keys work, a phone-width layout stacks, and no page logs an error."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from bench.engine_faults import set_step_hook
from bench.stub_server import InstantEngine
from gateway.settings import ApiKey
from tests.support.gateway_helpers import REPO, LiveServer, served, tiny_settings
from tests.support.machine import require_binary

# as the machine notes start it: without the background-networking flags Chromium dials hosts it cannot reach
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT = REPO / "docs" / "images" / "chat-page.png"
HOSTILE = '<img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script> **bold** [x](javascript:alert(1))'


@pytest.fixture(scope="module")
def browser():
    chromium = require_binary("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        yield live


class Opened:
    """A fresh page (its own localStorage) on `url`, recording console errors and uncaught exceptions."""

    def __init__(self, browser, url: str, **context) -> None:
        self.context = browser.new_context(**context)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def close(self) -> None:
        self.context.close()
        assert self.errors == [], self.errors


@pytest.fixture
def opened(browser, server):
    pages = []

    def open_page(url: str | None = None, **context) -> Opened:
        pages.append(Opened(browser, url or server.url + "/", **context))
        return pages[-1]
    yield open_page
    for page in pages:
        page.close()


def settings(page: Page, **values: str) -> None:
    """Opens the settings panel and fills its fields (#system, #temperature, #max_tokens, ...)."""
    if not page.locator("#settings").evaluate("el => el.open"):
        page.click("#settings summary")
    for field, value in values.items():
        page.fill(f"#{field}", value)


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def answer_stats(page: Page, turn: int) -> str:
    stats = page.locator(".message.assistant .stats").nth(turn)
    expect(stats).to_contain_text("prompt", timeout=30_000)
    return stats.inner_text()


def cached(stats: str) -> int:
    return int(re.search(r"cached (\d+)", stats).group(1))


def test_a_message_streams_in_and_the_second_turn_hits_the_cache(opened, server):
    set_step_hook(server.engine, lambda: time.sleep(0.01))  # slow enough to see the answer grow
    try:
        page = opened().page
        expect(page.locator("#model-name")).to_have_text(server.state.model_name)
        settings(page, temperature="0", max_tokens="24",
                 system="You are a helpful assistant. Answer the question about the capital of France. " * 3)
        send(page, "hello world")
        expect(page.locator("#stop")).to_be_visible()
        expect(page.locator(".message.assistant .body").first).not_to_be_empty()  # text while it streams
        first = answer_stats(page, 0)
        assert cached(first) == 0 and "TTFT" in first
        send(page, "and the cache?")
        second = answer_stats(page, 1)
        assert cached(second) > 0  # the system prompt, the question and the first answer
        expect(page.locator(".message")).to_have_count(4)
    finally:
        set_step_hook(server.engine, None)


def test_the_stop_button_ends_the_request_on_the_server(opened, server):
    set_step_hook(server.engine, lambda: time.sleep(0.05))
    try:
        page = opened().page
        settings(page, max_tokens="2000")
        send(page, "count to a thousand")
        expect(page.locator(".message.assistant .body").first).not_to_be_empty(timeout=30_000)
        page.click("#stop")
        expect(page.locator(".message.assistant .stats").first).to_contain_text("stopped")
        server.wait_idle(timeout=10)  # the engine aborted it and released its blocks
        metrics = server.call(_get(server.url + "/metrics"))
        assert re.search(r"^prefixgate_requests_running\{[^}]*\} 0\.0$", metrics, re.M)
    finally:
        set_step_hook(server.engine, None)


async def _get(url: str) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def test_the_cache_panel_moves_while_you_chat(opened):
    page = opened().page
    expect(page.locator("#cache-used")).to_contain_text("/")
    before = page.locator("#cache-tokens").inner_text()
    settings(page, max_tokens="4")
    send(page, "a question for the panel " * 4)
    answer_stats(page, 0)
    expect(page.locator("#cache-tokens")).not_to_have_text(before)
    expect(page.locator("#cache-hit-rate")).to_contain_text("%")


def test_enter_sends_shift_enter_breaks_the_line_and_chats_are_kept(opened, server):
    page = opened().page
    settings(page, max_tokens="4")
    page.fill("#input", "first line")
    page.press("#input", "Shift+Enter")
    page.type("#input", "second line")
    assert page.input_value("#input") == "first line\nsecond line"
    expect(page.locator(".message")).to_have_count(0)
    page.press("#input", "Enter")
    answer_stats(page, 0)
    expect(page.locator(".message.user .body")).to_have_text("first line\nsecond line")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#chats li")).to_have_count(2)
    page.reload()  # kept in localStorage
    expect(page.locator("#chats li")).to_have_count(2)
    page.locator("#chats li button.open", has_text="first line").click()
    expect(page.locator(".message")).to_have_count(2)


def test_a_hostile_reply_renders_as_text(browser, tiny_llama_dir):
    engine = InstantEngine(Path(tiny_llama_dir), reply=HOSTILE)
    with LiveServer(tiny_settings(tiny_llama_dir), engine=engine) as live:
        opened = Opened(browser, live.url + "/")
        page = opened.page
        send(page, "say something nasty")
        body = page.locator(".message.assistant .body").first
        expect(body).to_contain_text('<img src=x onerror="window.pwned = 1">')
        expect(body).to_contain_text("<script>window.pwned = 2</script>")
        assert body.locator("img, script").count() == 0 and body.locator("a").count() == 0
        expect(body.locator("strong")).to_have_text("bold")  # Markdown still renders
        assert page.evaluate("window.pwned") is None
        opened.close()


def test_a_server_with_keys_asks_for_one(browser, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-page", "pager"),))
    with LiveServer(settings) as live:
        opened = Opened(browser, live.url + "/")
        page = opened.page
        expect(page.locator("#key-dialog")).to_be_visible()
        opened.errors.clear()  # the browser logs the 401 that asked for the key
        page.fill("#key-input", "sk-page")
        page.press("#key-input", "Enter")
        expect(page.locator("#model-name")).to_have_text(live.state.model_name)
        expect(page.locator("#cache-tenant")).to_have_text("pager")
        opened.close()


def test_a_phone_width_layout_stacks_the_panels(opened):
    page = opened(viewport={"width": 390, "height": 844}).page
    expect(page.locator("#model-name")).not_to_be_empty()
    sidebar, composer = page.locator("#sidebar").bounding_box(), page.locator("#composer").bounding_box()
    assert sidebar["width"] == pytest.approx(390, abs=1) and composer["y"] > sidebar["y"] + sidebar["height"] - 1
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen


@pytest.mark.slow
def test_the_default_model_in_the_page_and_the_readme_screenshot(browser):
    """The page as a newcomer sees it after `make serve`: the real default model, its sampling defaults, two
    turns of one chat (the second hits the cache). Saves docs/images/chat-page.png, which the README shows."""
    with served("--model", "default", "--kv-cache-memory-mb", "256") as server:
        opened = Opened(browser, server.base_url.removesuffix("/v1") + "/", viewport={"width": 1200, "height": 720})
        page = opened.page
        expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct", timeout=30_000)
        settings(page, seed="1")  # the model's own sampling defaults, reproducibly
        page.click("#settings summary")  # closed again for the picture
        send(page, "What is the capital of France?")
        answer_stats(page, 0)
        assert "Paris" in page.locator(".message.assistant .body").first.inner_text()
        send(page, "And the capital of Italy?")
        assert cached(answer_stats(page, 1)) > 0
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))
        opened.close()
