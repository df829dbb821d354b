"""`system_fingerprint`: names the model and engine configuration behind an answer, as OpenAI's does;
it changes when anything that may change outputs changes (weights path, dtype, block size, ...)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

from engine.config import EngineConfig, settable


@functools.cache
def system_fingerprint(config: EngineConfig, model_name: str) -> str:
    # (the pin scope the gateway fills in changes no output)
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if settable(f)}
    described = {"served_model": model_name, **settings}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()
    return "fp_" + digest[:10]
