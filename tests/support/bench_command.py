"""A benchmark's command run at a test's tiny scale."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench.__main__ import main


def run_quick(bench: ModuleType, name: str, scale: Any, model_dir: Path, out: Path) -> tuple[dict, str]:
    """`python -m bench NAME --quick` with the benchmark's QUICK scale replaced by `scale`: the results it wrote
    (out/NAME.json) and what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(bench, "QUICK", scale)
        assert main([name, "--quick", "--model", str(model_dir), "--out", str(out)]) == 0
    return json.loads((out / f"{name}.json").read_text()), printed.getvalue()
