"""The benchmarks' tests run with coverage paused, their fixtures' set-up and teardown included (pytest-cov's
`no_cover` pauses only a test's call, and a module fixture here runs whole benchmarks). Their subject is bench/,
which coverage does not measure; the engine/ and gateway/ lines they run, other tests reach too (a `make test`
with `--cov-context=test` found no line that only tests/bench covers), and under coverage's line tracer
(Python 3.11's sys.settrace) the benchmarks' engine steps cost most of their CPU again."""
from __future__ import annotations

from collections.abc import Iterator

import pytest


def _paused(item: pytest.Item) -> Iterator[None]:
    plugin = item.config.pluginmanager.getplugin("_cov")  # pytest-cov, when installed
    controller = getattr(plugin, "cov_controller", None)  # None without --cov
    if controller is None or not getattr(controller, "started", False):
        yield
        return
    controller.pause()
    try:
        yield
    finally:
        controller.resume()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _paused(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _paused(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield from _paused(item)
