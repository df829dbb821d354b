"""Small OpenAI API gaps, through the real SDK (or plain HTTP) against the real server on a tiny model:
GET /v1/models/{id}, completion_tokens_details, system_fingerprint, stream_options needs stream, CORS,
and the `prefixgate` console command."""
from __future__ import annotations

import tomllib
from pathlib import Path

import openai
import pytest
import requests

from gateway.__main__ import build_parser, main, settings_from_args
from gateway.fingerprint import system_fingerprint
from gateway.settings import ApiKey
from tests.support.gateway_helpers import LiveServer, is_error_body, sdk_client, tiny_settings

REPO = Path(__file__).resolve().parents[2]
ORIGIN = "http://chat-ui.example:3000"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with sdk_client(server) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


def chat(client, model, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello world"}],
                                          max_tokens=3, **kwargs)


def test_models_retrieve(server, client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.owned_by == "prefixgate"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    assert client.models.retrieve(server.settings.engine.model).id == model  # the --model path, slashes and all
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-0")
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_usage_reports_completion_tokens_details(client, model):
    details = chat(client, model).usage.completion_tokens_details
    assert (details.reasoning_tokens, details.audio_tokens, details.accepted_prediction_tokens,
            details.rejected_prediction_tokens) == (0, 0, 0, 0)
    chunks = list(chat(client, model, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0


def test_system_fingerprint_is_stable_per_model_and_config(server, client, model):
    fingerprint = chat(client, model).system_fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13
    assert chat(client, model).system_fingerprint == fingerprint
    assert {c.system_fingerprint for c in chat(client, model, stream=True)} == {fingerprint}
    assert client.completions.create(model=model, prompt="hello", max_tokens=2).system_fingerprint == fingerprint
    config = server.settings.engine
    assert system_fingerprint(config.replace(), model) == fingerprint  # an equal config, not the same object
    assert system_fingerprint(config.replace(block_size=32), model) != fingerprint
    assert system_fingerprint(config, "other-model") != fingerprint


@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_400(client, model, stream):
    extra = {} if stream is None else {"stream": stream}
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, model, stream_options={"include_usage": True}, **extra)
    assert err.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi", stream_options={"include_usage": False}, **extra)
    assert err.value.param == "stream_options"


# ---- CORS

@pytest.fixture(scope="module")
def cors_server(tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, keys=(ApiKey("sk-ui", "ui"),), allowed_origins=(ORIGIN,))
    with LiveServer(settings) as live:
        yield live


def preflight(url: str, origin: str) -> requests.Response:
    return requests.options(url + "/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_and_responses_from_an_allowed_origin(cors_server):
    resp = preflight(cors_server.url, ORIGIN)  # browsers send no credentials here: no key needed
    assert resp.status_code == 204
    assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    body = {"model": cors_server.state.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Origin": ORIGIN, "Authorization": "Bearer sk-ui"}
    for stream in (False, True):
        resp = requests.post(cors_server.url + "/v1/chat/completions", json={**body, "stream": stream},
                             headers=headers, timeout=30)
        assert resp.status_code == 200 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"] and resp.headers["Vary"] == "Origin"
    # an error is readable by the page too
    resp = requests.post(cors_server.url + "/v1/chat/completions", json=body, headers={"Origin": ORIGIN}, timeout=10)
    assert resp.status_code == 401 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_cors_refuses_other_origins(cors_server):
    resp = preflight(cors_server.url, "http://evil.example")
    assert resp.status_code == 400 and is_error_body(resp.json())
    assert "Access-Control-Allow-Origin" not in resp.headers
    resp = requests.get(cors_server.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                                "Authorization": "Bearer sk-ui"}, timeout=10)
    assert resp.status_code == 200 and "Access-Control-Allow-Origin" not in resp.headers


def test_cors_is_off_by_default(server):
    resp = preflight(server.url, ORIGIN)
    assert resp.status_code == 405 and "Access-Control-Allow-Origin" not in resp.headers
    resp = requests.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert resp.status_code == 200 and "Access-Control-Allow-Origin" not in resp.headers


def test_cors_any_origin(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, allowed_origins=("*",))) as live:
        resp = preflight(live.url, "http://anywhere.example")
        assert resp.status_code == 204 and resp.headers["Access-Control-Allow-Origin"] == "*"
        assert "Vary" not in resp.headers


# ---- the console command and the new flags

def test_prefixgate_console_command_runs_the_cli(capsys):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["prefixgate"].partition(":")
    assert (module, function) == ("gateway.__main__", "main")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--tool-call-parser" in out and "--allowed-origins" in out


def test_new_flags_reach_the_settings():
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json",
                                      "--allowed-origins", ORIGIN, "http://localhost:5173"])
    gateway = settings_from_args(args).gateway
    assert gateway.tool_call_parser == "llama3_json"
    assert gateway.allowed_origins == (ORIGIN, "http://localhost:5173")
    assert settings_from_args(build_parser().parse_args(["serve"])).gateway.allowed_origins == ()
    with pytest.raises(ValueError, match="tool_call_parser"):
        settings_from_args(build_parser().parse_args(["serve", "--tool-call-parser", "mistral"]))
