"""Shared fixtures: tiny random-weight models built once per test session."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from bench.tiny_models import build_tiktoken_model, build_tiny_model

if not torch.cuda.is_available():  # Triton kernels (the CUDA decode path) run on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


# what holds a worker longest first (Ray's start, the default model, real processes, fuzzing, compiles)
HEAVIEST_FIRST = ("ray", "default_model", "server", "fuzz", "slow", "browser", "compat", "prometheus")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in the order pytest-xdist should hand them out (the Makefile turns its own reordering, by number of
    tests, off): files with the heaviest marker first, then files with more tests. A file of a few long tests
    handed out last would be the whole run's tail, one worker idle beside it. A file's tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[int, int]:
        marks = {mark.name for item in tests for mark in item.iter_markers()}
        return (min((HEAVIEST_FIRST.index(m) for m in marks & set(HEAVIEST_FIRST)), default=len(HEAVIEST_FIRST)),
                -len(tests))

    items[:] = [item for tests in sorted(files.values(), key=weight) for item in tests]
    for item in items:
        # fuzzing is volume, not reach: under coverage's line tracer (Python 3.11's sys.settrace) its thousands of
        # requests cost half again their CPU. Coverage is the example tests' (docs/development.md, "Line coverage")
        if item.get_closest_marker("fuzz"):
            item.add_marker(pytest.mark.no_cover)


@pytest.fixture(autouse=True)
def _drop_dead_log_handlers():
    """`gateway` main() (config-error tests) installs a root handler on the stderr pytest captured for that test;
    once pytest closes it, later tests' log lines would end in "--- Logging error ---". Such handlers go."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(getattr(handler, "stream", None), "closed", False):
            root.removeHandler(handler)


@pytest.fixture(scope="session", autouse=True)
def _responses_db_in_tmp(tmp_path_factory):
    """Apps built from settings that name no `responses_db` keep stored responses in this session's tmp folder,
    never in the user's cache folder."""
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.response_store.default_db_path", lambda: path)
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_tools_dir(tmp_path_factory):
    """A tiny Qwen2 whose chat template renders tools (Hermes <tool_call> format)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), "qwen2", tools=True)


@pytest.fixture(scope="session")
def tiny_tiktoken_dir(tmp_path_factory):
    return build_tiktoken_model(tmp_path_factory.mktemp("tiny-tiktoken"))
