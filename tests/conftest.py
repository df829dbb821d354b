"""Shared fixtures: tiny random-weight models built once per test session."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from bench.tiny_models import build_tiktoken_model, build_tiny_model

if not torch.cuda.is_available():  # Triton kernels (the CUDA decode path) run on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
