"""What this machine has for the tests: CI or not, where Triton kernels run, real server parts."""
from __future__ import annotations

import importlib
import os
import shutil

import pytest
import torch

IN_CI = bool(os.environ.get("CI"))
# where the Triton kernels' tests run them: the GPU, or Triton's interpreter on CPU tensors (conftest.py sets
# TRITON_INTERPRET there)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
