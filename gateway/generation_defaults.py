"""Default sampling from the model, as vLLM's `--generation-config`: the sampling fields of the model
directory's generation_config.json (`auto`) or none (`none`), then `--override-generation-config`. They fill
the fields a request leaves out; a field the request sets always wins."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway")

# the fields that may come from the model, with OpenAI's defaults for when nothing says otherwise
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def parse_override(text: str | None) -> dict[str, float]:
    """The `--override-generation-config` JSON object; ValueError naming what is wrong."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"override_generation_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("override_generation_config must be a JSON object")
    unknown = sorted(set(value) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown fields {unknown}; known: {sorted(SAMPLING_FIELDS)}")
    for name, field_value in value.items():
        if isinstance(field_value, bool) or not isinstance(field_value, (int, float)) or not math.isfinite(field_value):
            raise ValueError(f"override_generation_config: {name} must be a finite number")
    return value


def sampling_defaults(model_path: Path, mode: str, override: dict[str, float]) -> dict[str, Any]:
    """The request defaults in force: OpenAI's, then the model's (mode `auto`), then the override."""
    found: dict[str, Any] = {}
    path = model_path / "generation_config.json"
    if mode == "auto" and path.is_file():
        config = json.loads(path.read_text())
        found.update({name: config[name] for name in SAMPLING_FIELDS if isinstance(config.get(name), (int, float))})
    defaults = {**SAMPLING_FIELDS, **found, **override}
    if found or override:
        log.info("sampling defaults for requests that leave them out: %s (from %s)",
                 ", ".join(f"{k}={v}" for k, v in defaults.items()),
                 " and ".join(w for w, on in (("generation_config.json", found), ("the override", override)) if on))
    return defaults
