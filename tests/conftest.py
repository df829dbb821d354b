"""Shared fixtures: tiny random-weight models built once per test session."""
from __future__ import annotations

import importlib
import logging
import os
import shutil

import pytest
import torch

from bench.tiny_models import build_tiktoken_model, build_tiny_model

IN_CI = bool(os.environ.get("CI"))
if not torch.cuda.is_available():  # Triton kernels (the CUDA decode path) run on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
# where the Triton kernels' tests run them: the GPU, or Triton's interpreter on CPU tensors
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _drop_dead_log_handlers():
    """`gateway` main() (config-error tests) installs a root handler on the stderr pytest captured for that test;
    once pytest closes it, later tests' log lines would end in "--- Logging error ---". Such handlers go."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(getattr(handler, "stream", None), "closed", False):
            root.removeHandler(handler)


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


def require_binary(name: str) -> str:
    """Path of a real server part; fails under CI when it is missing, skips elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (make test installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def triton_module(name: str):
    """engine.model.<name>, a module of Triton kernels: fails under CI when Triton is missing (the test extra
    installs it), skips the calling test module elsewhere."""
    try:
        return importlib.import_module(f"engine.model.{name}")
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("triton is not installed", allow_module_level=True)
