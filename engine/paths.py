"""Where prefixgate keeps its files by default (no torch: the API process reads it too)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$PREFIXGATE_CACHE, else ~/.cache/prefixgate: the converted default model, the kept salt secret."""
    env = os.environ.get("PREFIXGATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "prefixgate"
