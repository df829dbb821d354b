"""Sampling defaults from the model (vLLM's --generation-config): generation_config.json's sampling fields fill
what a request leaves out, --override-generation-config goes over them, and a request's own field wins."""
from __future__ import annotations

import json

import pytest

from gateway.generation_defaults import SAMPLING_FIELDS, parse_override, sampling_defaults
from gateway.protocol import parse_chat, parse_completion
from gateway.settings import GatewaySettings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_length": 99}))
    return tmp_path


def test_the_models_fields_fill_the_defaults_and_the_override_goes_over_them(model_dir):
    assert sampling_defaults(model_dir, "auto", {}) == {**SAMPLING_FIELDS, "temperature": 0.2, "top_p": 0.9,
                                                        "top_k": 40, "max_tokens": None}
    assert sampling_defaults(model_dir, "none", {}) == {**SAMPLING_FIELDS, "max_tokens": None}
    assert sampling_defaults(model_dir, "auto", {"temperature": 0.7})["temperature"] == 0.7
    assert sampling_defaults(model_dir / "absent", "auto", {}) == {**SAMPLING_FIELDS, "max_tokens": None}


def test_a_request_that_sets_a_field_wins(model_dir):
    defaults = sampling_defaults(model_dir, "auto", {"repetition_penalty": 1.1})
    plain = parse_chat(CHAT, GatewaySettings(), defaults)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (0.2, 0.9, 40, 1.1)
    own = parse_chat({**CHAT, "temperature": 1.0, "top_k": 0, "repetition_penalty": 1.0}, GatewaySettings(), defaults)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (1.0, 0.9, 0, 1.0)
    assert parse_completion({"model": "m", "prompt": "x"}, GatewaySettings(), defaults).temperature == 0.2


@pytest.mark.parametrize("text, message", [("{", "not JSON"), ("[1]", "JSON object"), ('{"seed": 1}', "unknown"),
                                           ('{"temperature": "hot"}', "finite number")])
def test_a_bad_override_is_refused_at_start_up(text, message):
    with pytest.raises(ValueError, match=message):
        parse_override(text)
    with pytest.raises(ValueError, match=message):
        GatewaySettings(override_generation_config=text)
