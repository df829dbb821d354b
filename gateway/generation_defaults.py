"""Default sampling from the model, as vLLM's `--generation-config`: the sampling fields of the model
directory's generation_config.json (`auto`) or none (`none`), then `--override-generation-config`. They fill
the fields a request leaves out; a field the request sets always wins.

The same goes for the answer's length: a request without max_tokens (max_completion_tokens,
max_output_tokens) gets the model's `max_new_tokens`, else `--default-max-tokens`, never more than the
context leaves; so a client that sends no limit still gets an answer that ends."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from engine.structured import load_json_object

log = logging.getLogger("gateway")

# the fields that may come from the model, with OpenAI's defaults for when nothing says otherwise
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
LENGTH_FIELD = "max_new_tokens"  # generation_config.json's name; in the defaults it is max_tokens, as vLLM maps it


def parse_override(text: str | None) -> dict[str, float]:
    """The `--override-generation-config` JSON object; ValueError naming what is wrong."""
    if not text:
        return {}
    value = load_json_object(text, "override_generation_config")
    known = [*SAMPLING_FIELDS, LENGTH_FIELD]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"override_generation_config: unknown fields {unknown}; known: {sorted(known)}")
    for name, field_value in value.items():
        if isinstance(field_value, bool) or not isinstance(field_value, (int, float)) or not math.isfinite(field_value):
            raise ValueError(f"override_generation_config: {name} must be a finite number")
    if LENGTH_FIELD in value and not _is_length(value[LENGTH_FIELD]):
        raise ValueError(f"override_generation_config: {LENGTH_FIELD} must be an integer >= 1")
    return value


def sampling_defaults(model_path: Path, mode: str, override: dict[str, float],
                      default_max_tokens: int | None = None) -> dict[str, Any]:
    """The request defaults in force: OpenAI's, then the model's (mode `auto`), then the override; and
    `max_tokens`, the cap on a request that sets none (`default_max_tokens` when neither the model nor the
    override names one; None: the rest of the context)."""
    found: dict[str, Any] = {}
    path = model_path / "generation_config.json"
    if mode == "auto" and path.is_file():
        config = json.loads(path.read_text())
        found.update({name: config[name] for name in SAMPLING_FIELDS if isinstance(config.get(name), (int, float))})
        if _is_length(config.get(LENGTH_FIELD)):
            found[LENGTH_FIELD] = config[LENGTH_FIELD]
    chosen = {**found, **override}
    defaults = {**SAMPLING_FIELDS, **{k: v for k, v in chosen.items() if k in SAMPLING_FIELDS},
                "max_tokens": chosen.get(LENGTH_FIELD, default_max_tokens)}
    sources = " and ".join(w for w, on in (("generation_config.json", found), ("the override", override)) if on)
    length_source = ("the override" if LENGTH_FIELD in override else
                     f"generation_config.json's {LENGTH_FIELD}" if LENGTH_FIELD in found else "default_max_tokens")
    log.info("sampling defaults for requests that leave them out: %s (%s); max_tokens=%s (%s)",
             ", ".join(f"{k}={v}" for k, v in defaults.items() if k in SAMPLING_FIELDS), sources or "OpenAI's",
             defaults["max_tokens"] or "the rest of the context", length_source)
    return defaults


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
