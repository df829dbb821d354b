"""Gateway pieces without a model: settings and CLI, keys and salts, admission, request parsing."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import socket

import pytest
import yaml

import gateway.__main__
import gateway.settings

from engine.config import EngineConfig, HashAlgo, settable
from gateway.__main__ import build_parser, main, settings_from_args
from gateway.admission import Admission
from gateway.auth import Authenticator, Tenant
from gateway.errors import APIError
from gateway.jsonbody import parse_body
from gateway.protocol import parse_chat, parse_completion
from gateway.settings import DEFAULT_CONFIG_PATH, ApiKey, GatewaySettings, load_settings


# ---- settings and CLI

def field_names(cls) -> list[str]:
    """The settings a flag or the YAML sets (api_keys comes from --api-key / --api-keys-file; the gateway fills
    in the engine's pin scope)."""
    return [f.name for f in dataclasses.fields(cls) if f.name != "api_keys" and settable(f)]


def test_default_yaml_lists_every_field_with_its_default():
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    assert list(data) == ["engine", "gateway"]
    assert set(data["engine"]) == set(field_names(EngineConfig))
    assert set(data["gateway"]) == set(field_names(GatewaySettings))
    settings = load_settings(DEFAULT_CONFIG_PATH)
    assert settings.engine == EngineConfig()
    assert settings.gateway == GatewaySettings()


def test_default_yaml_comments_every_key():
    for line in DEFAULT_CONFIG_PATH.read_text().splitlines():
        if line.startswith("  ") and ":" in line:
            assert "#" in line, f"no comment: {line!r}"


@pytest.mark.parametrize("text, message", [
    ("engine:\n  block_sise: 16\n", "block_sise"),
    ("gateway:\n  prot: 1\n", "prot"),
    ("engines: {}\n", "engines"),
    ("engine:\n  block_size: sixteen\n", "engine.block_size"),
    ("gateway:\n  max_n: true\n", "gateway.max_n"),
])
def test_bad_yaml_is_an_error_at_startup(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_settings(path)


def test_every_engine_field_is_a_flag():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for name in field_names(EngineConfig) + field_names(GatewaySettings):
        assert "--" + name.replace("_", "-") in flags
    assert {"--no-enable-prefix-caching", "--api-key", "--api-keys-file", "--config"} <= flags


def test_every_flag_says_what_it_does():
    """Each field's help comes from its comment in the dataclass, on its line or on the lines above it."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            assert not action.help.startswith("(default:"), action.option_strings
    flag = {opt: action for action in serve._actions for opt in action.option_strings}
    assert flag["--quantized-activations"].help.startswith("CPU quantized matmuls: float32 (exact")


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("engine:\n  block_size: 32\n  max_num_seqs: 4\ngateway:\n  port: 9000\n  max_n: 2\n")
    args = build_parser().parse_args([
        "serve", "--config", str(config), "--block-size", "8", "--no-enable-prefix-caching",
        "--num-kv-blocks", "64", "--hash-algo", "xxhash", "--max-model-len", "none", "--port", "9100",
        "--public-salt-tenants", "a", "b", "--max-concurrent-per-tenant", "3", "--model", "/m"])
    settings = settings_from_args(args)
    assert settings.engine == EngineConfig(model="/m", block_size=8, max_num_seqs=4, num_kv_blocks=64,
                                           enable_prefix_caching=False, hash_algo=HashAlgo.XXHASH)
    assert settings.gateway == GatewaySettings(port=9100, max_n=2, public_salt_tenants=("a", "b"),
                                               max_concurrent_per_tenant=3)


def test_bad_flag_value_exits(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--block-size", "x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hash-algo", "md5"])


def test_main_reports_a_bad_config_and_exits_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("gateway:\n  nope: 1\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "nope" in capsys.readouterr().err


README_KEYS = """\
sk-alice: {tenant: alice, max_concurrent: 4}
sk-alice-ci: {tenant: alice}            # two keys, one tenant: one cache
sk-bob: {tenant: bob}
sk-demo: {tenant: demo, share_public_salt: true}
"""


def test_the_readme_keys_file_starts(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(README_KEYS)
    settings = load_settings(None, {}, {"api_keys_file": str(keys)})
    auth = Authenticator(settings.gateway)  # two keys of alice, one with its own max_concurrent
    alice, alice_ci = auth._lookup("sk-alice"), auth._lookup("sk-alice-ci")
    assert alice.salt == alice_ci.salt and (alice.key_max_concurrent, alice_ci.key_max_concurrent) == (4, None)


@pytest.mark.parametrize("files, flags, message", [
    ({"c.yaml": "engine:\n  block_size: [1\n"}, ["--config", "c.yaml"], "c.yaml: not valid YAML at line 3"),
    ({"c.yaml": "engine:\n\tblock_size: 1\n"}, ["--config", "c.yaml"], "not valid YAML at line 2"),
    ({}, ["--config", "missing.yaml"], "missing.yaml"),
    ({"k.yaml": "sk-secret-1: [alice\n"}, ["--api-keys-file", "k.yaml"], "k.yaml: not valid YAML"),
    ({}, ["--api-keys-file", "missing.yaml"], "missing.yaml"),
    ({"k.yaml": "0777: alice\n"}, ["--api-keys-file", "k.yaml"], "the key 511 is not a string"),
    ({"k.yaml": "on: alice\n"}, ["--api-keys-file", "k.yaml"], "the key True is not a string"),
    ({"k.yaml": "sk-secret-1: {tenant: 0777}\n"}, ["--api-keys-file", "k.yaml"], "tenant must be a string"),
    ({"k.yaml": "sk-secret-1: {tenant: a, salt: x}\nsk-secret-2: {tenant: a, salt: y}\n"},
     ["--api-keys-file", "k.yaml"], "tenant 'a' disagree on salt"),
    ({"k.yaml": "sk-secret-1: {tenant: a}\nsk-secret-2: {tenant: a, share_public_salt: true}\n"},
     ["--api-keys-file", "k.yaml"], "tenant 'a' disagree on salt"),
    ({}, ["--block-size", "0"], "block_size must be >= 1"),
    ({}, ["--host", "nosuchhost.invalid", "--port", "0"], "--host 'nosuchhost.invalid' does not resolve"),
    ({}, ["--responses-db", "mysql://db/x"], "not a mysql: URL"),  # (it made a file named mysql:/db/x, in silence)
    ({}, ["--responses-db", "sqlite:///x.db"], "not a sqlite: URL"),
    # the model loads on a thread of this process, or in the engine process (its error crosses the seam)
    ({}, ["--model", "no-such-model-dir", "--port", "0", "--no-engine-process"], "not a model directory"),
    pytest.param({}, ["--model", "no-such-model-dir", "--port", "0"], "not a model directory",
                 marks=pytest.mark.server),
    ({"m/config.json": "{"}, ["--model", "m", "--port", "0", "--no-engine-process"], "not a valid JSON"),
    pytest.param({"m/config.json": "{"}, ["--model", "m", "--port", "0"], "not a valid JSON",
                 marks=pytest.mark.server),  # a ValueError from loading
])
def test_every_configuration_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, files, flags, message):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the log lines of a start-up that got as far as loading the model
    assert last.startswith("error: ") and message in last and "Traceback" not in err
    assert "sk-secret" not in err  # never a key, not even from a YAML snippet


def test_a_port_in_use_is_refused_before_the_engine_starts(monkeypatch, capsys):
    """The port is checked before the model loads (a first start compiles kernels for a minute and more)."""
    def started(self):
        raise AssertionError("the engine started before the port was checked")
    monkeypatch.setattr(gateway.__main__.web.AppRunner, "setup", started)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--no-engine-process"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: ") and f"cannot listen on 127.0.0.1:{port}" in last


@pytest.mark.parametrize("raised, code, said", [
    (RuntimeError("Torch not compiled with CUDA enabled"), 2, "error: Torch not compiled with CUDA enabled"),
    (KeyboardInterrupt(), 130, "interrupted while starting"),  # Ctrl-C while the model loads
])
def test_a_start_that_fails_in_this_process_is_one_line(monkeypatch, capsys, raised, code, said):
    """Without the engine process (which turns any error into one line), a device torch lacks or a failed
    conversion was a traceback, exit 1; Ctrl-C while the model loads a 62-line traceback."""
    def setup(self):
        raise raised
    monkeypatch.setattr(gateway.__main__.web.AppRunner, "setup", setup)
    assert main(["serve", "--port", "0", "--no-engine-process"]) == code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == said and "Traceback" not in err


def test_what_create_app_logs_is_formatted_as_the_rest(monkeypatch, capsys):
    """Logging is set up before the app is made: a warning there (a response store kept in memory) came out bare,
    with no time or level, and an info line not at all."""
    def create_app(settings):
        logging.getLogger("gateway.response_store").warning("stored responses: cannot open the file")
        raise ValueError("stop here")
    monkeypatch.setattr(gateway.__main__, "create_app", create_app)
    assert main(["serve"]) == 2
    warning, error = capsys.readouterr().err.splitlines()[-2:]
    assert " WARNING gateway.response_store " in warning and error == "error: stop here"


def test_none_empties_a_list_setting(tmp_path):
    """As the help ("none: its own name", "none: off") and the YAML header ("null means none") say: it named a
    model "none" and allowed the CORS origin "none"; null in YAML was refused."""
    args = build_parser().parse_args(["serve", "--served-model-name", "none", "--allowed-origins", "none"])
    gw = settings_from_args(args).gateway
    assert (gw.served_model_name, gw.allowed_origins) == ((), ())
    config = tmp_path / "c.yaml"
    config.write_text("gateway:\n  served_model_name: null\n  public_salt_tenants: [a]\n")
    gw = settings_from_args(build_parser().parse_args(["serve", "--config", str(config)])).gateway
    assert (gw.served_model_name, gw.public_salt_tenants) == ((), ("a",))


def test_the_cluster_command_helps_with_its_own_flags_and_checks_them(capsys):
    import cluster.__main__ as cluster_main  # (Ray is imported only to serve)
    assert cluster_main.main(["serve", "--help"]) == 0
    assert "--replicas" in capsys.readouterr().out  # (`serve --help` printed the gateway's help alone)
    assert cluster_main.main(["serve", "--replicas", "0"]) == 2  # (a ZeroDivisionError once Ray had started)
    assert capsys.readouterr().err == "error: --replicas must be >= 1\n"


def test_bare_keys_whose_fingerprints_collide_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(gateway.settings, "key_fingerprint", lambda key: "00000000")
    assert main(["serve", "--api-key", "sk-one", "--api-key", "sk-two"]) == 2
    assert "would share tenant 'key-00000000'" in capsys.readouterr().err
    keys = load_settings(None, {}, {}, ["sk-one", "sk-two:key-00000000"]).gateway.api_keys
    assert {k.tenant for k in keys} == {"key-00000000"}  # naming the tenant is on purpose


def test_api_keys_from_flags_and_file(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("k-alice: {tenant: alice, max_concurrent: 2}\n"
                    "k-bob: {tenant: bob, salt: bobsalt, share_public_salt: false}\n"
                    "k-carol: carol\n")
    settings = load_settings(None, {}, {"api_keys_file": str(keys)}, ["k-dan:dan", "k-anon", "k-anon2"])
    anon, anon2 = (f"key-{hashlib.sha256(k.encode()).hexdigest()[:8]}" for k in ("k-anon", "k-anon2"))
    assert {(k.key, k.tenant) for k in settings.gateway.api_keys} == {
        ("k-alice", "alice"), ("k-bob", "bob"), ("k-carol", "carol"), ("k-dan", "dan"), ("k-anon", anon),
        ("k-anon2", anon2)}
    assert anon != anon2  # keys without a tenant never share one (nor a cache)
    assert "k-alice" not in repr(settings)  # keys and salts never end up in logs of the settings


@pytest.mark.parametrize("text", ["k: {tenant: a, colour: red}\n", "k: {salt: x}\n", "k: {tenant: a, max_concurrent: 0}\n",
                                  "- a\n"])
def test_bad_keys_file_is_an_error(tmp_path, text):
    keys = tmp_path / "keys.yaml"
    keys.write_text(text)
    with pytest.raises(ValueError):
        load_settings(None, {}, {"api_keys_file": str(keys)})


# ---- tenants and salts

def _auth(*keys: ApiKey, **settings) -> Authenticator:
    return Authenticator(GatewaySettings(api_keys=keys, salt_secret="s3cret", **settings))


def test_each_tenant_gets_its_own_salt_and_public_tenants_share_one():
    auth = _auth(ApiKey("ka", "alice"), ApiKey("ka2", "alice"), ApiKey("kb", "bob"), ApiKey("kp", "pub1"),
                 ApiKey("kq", "pub2"), ApiKey("kr", "pub3", share_public_salt=True), ApiKey("ks", "sam", salt="fixed"),
                 public_salt_tenants=("pub1", "pub2"))
    t = {key: auth._lookup(key) for key in ("ka", "ka2", "kb", "kp", "kq", "kr", "ks")}
    assert t["ka"].name == t["ka2"].name == "alice" and t["ka"].salt == t["ka2"].salt
    assert t["ka"].salt != t["kb"].salt
    assert t["kp"].salt == t["kq"].salt == t["kr"].salt != t["ka"].salt
    assert t["ks"].salt == "fixed"
    assert auth._lookup("nope") is None and auth._lookup("") is None
    assert auth.tenant_names == ["alice", "bob", "pub1", "pub2", "pub3", "sam"]


def test_salts_are_stable_for_one_secret_and_differ_across_secrets():
    a1 = Authenticator(GatewaySettings(api_keys=(ApiKey("k", "alice"),), salt_secret="x"))._lookup("k")
    a2 = Authenticator(GatewaySettings(api_keys=(ApiKey("k", "alice"),), salt_secret="x"))._lookup("k")
    a3 = Authenticator(GatewaySettings(api_keys=(ApiKey("k", "alice"),), salt_secret="y"))._lookup("k")
    assert a1.salt == a2.salt != a3.salt


def test_body_salt_only_narrows():
    alice, bob = Tenant("alice", "sa"), Tenant("bob", "sb")
    assert alice.cache_salt(None) == alice.cache_salt("") == "sa"
    assert alice.cache_salt("x") == hashlib.sha256(b"sa\0x").hexdigest()
    assert alice.cache_salt("x") != bob.cache_salt("x")
    assert bob.cache_salt("sa") != alice.cache_salt(None)  # copying the salt value gets nowhere


def test_conflicting_salts_of_one_tenant_fail_at_startup():
    with pytest.raises(ValueError, match="alice"):
        _auth(ApiKey("k1", "alice", salt="x"), ApiKey("k2", "alice", salt="y"))
    with pytest.raises(ValueError, match="alice"):
        _auth(ApiKey("k1", "alice"), ApiKey("k2", "alice", share_public_salt=True))


def test_max_concurrent_is_per_key_and_per_tenant():
    auth = _auth(ApiKey("k1", "alice", max_concurrent=1), ApiKey("k2", "alice", max_concurrent=2),
                 ApiKey("k3", "alice"), max_concurrent_per_tenant=3)
    k1, k2, k3 = (auth._lookup(k) for k in ("k1", "k2", "k3"))
    assert k1.salt == k2.salt == k3.salt
    adm = Admission(max_num_seqs=8, max_waiting_requests=0, retry_after_s=1)
    with adm.admit(k1, 1):
        with pytest.raises(APIError) as err:
            with adm.admit(k1, 1):
                pass
        assert err.value.code == "rate_limit_exceeded" and "k1" not in err.value.message
        with adm.admit(k2, 1), adm.admit(k3, 1):  # other keys of the tenant have their own limits...
            with pytest.raises(APIError) as err:
                with adm.admit(k2, 1):  # ...and the tenant's, all its keys together
                    pass
            assert err.value.code == "rate_limit_exceeded" and "max_concurrent_per_tenant" in err.value.message
    assert adm.tenant_in_flight("alice") == 0


def test_without_keys_everyone_is_anonymous():
    auth = Authenticator(GatewaySettings())
    assert not auth.enabled and auth.tenant_names == ["anonymous"]


# ---- admission

def test_admission_bounds_sequences_and_tenants():
    adm = Admission(max_num_seqs=2, max_waiting_requests=1, retry_after_s=3)
    alice, bob = Tenant("alice", max_concurrent=1, key_id="#0"), Tenant("bob", key_id="#1")
    with adm.admit(bob, 2):
        with pytest.raises(APIError) as err:
            with adm.admit(bob, 2):
                pass
        assert err.value.status == 429 and err.value.headers == {"Retry-After": "3"}
        assert "max_waiting_requests" in err.value.message and err.value.code == "rate_limit_exceeded"
        with adm.admit(alice, 1):
            with pytest.raises(APIError) as err:
                with adm.admit(alice, 0):
                    pass
            assert err.value.code == "rate_limit_exceeded" and "max_concurrent_per_tenant" in err.value.message
            assert "alice" in err.value.message
    assert adm.in_flight == 0 and adm.tenant_in_flight("alice") == 0


def test_admission_refuses_what_could_never_fit_with_400():
    with pytest.raises(APIError) as err:
        with Admission(2, 1, 1).admit(Tenant("a"), 4):
            pass
    assert err.value.status == 400 and err.value.param == "n"


def test_admission_releases_on_error():
    adm = Admission(1, 0, 1)
    with pytest.raises(RuntimeError):
        with adm.admit(Tenant("a"), 1):
            raise RuntimeError
    assert adm.in_flight == 0


# ---- request parsing

LIMITS = GatewaySettings(max_n=4, max_stop_sequences=2, max_messages=3, max_tokens_limit=100)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_and_fields():
    req = parse_chat({**CHAT, "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0, "top_p": 0.5,
                      "top_k": 3, "seed": 7, "stop": "x", "n": 2, "logprobs": True, "top_logprobs": 2,
                      "stream": True, "stream_options": {"include_usage": True}, "user": "u",
                      "cache_salt": "s", "ignore_eos": True, "frequency_penalty": 0.0, "whatever": [1]}, LIMITS)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.n) == (
        5, 0.0, 0.5, 3, 7, ("x",), 2)
    assert (req.logprobs, req.stream, req.include_usage, req.cache_salt, req.ignore_eos) == (2, True, True, "s", True)
    # int64, as vLLM takes it, where -1 is no seed (UIs send it for "random")
    assert [parse_chat({**CHAT, "seed": seed}, LIMITS).seed for seed in (-1, -2, 2**63 - 1)] == [None, -2, 2**63 - 1]
    plain = parse_chat({**CHAT, "temperature": None}, LIMITS)
    assert (plain.max_tokens, plain.temperature, plain.n, plain.logprobs, plain.stop) == (None, 1.0, 1, None, ())
    assert parse_chat({**CHAT, "logprobs": True}, LIMITS).logprobs == 0


def test_chat_content_parts_and_roles():
    req = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]}, LIMITS)
    assert req.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("change, param", [
    ({"model": 3}, "model"), ({"model": ["m"]}, "model"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}] * 4}, "messages"),
    ({"messages": [{"role": "function", "content": "a"}]}, "messages[0].name"),  # a legacy answer names its function
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": True}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"n": 0}, "n"), ({"n": 5}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 101}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"seed": "1"}, "seed"), ({"echo": "yes"}, "echo"),
    ({"continue_final_message": True}, "continue_final_message"),  # (with add_generation_prompt's default, true)
    ({"stop": 3}, "stop"), ({"stop": ["a", "b", "c"]}, "stop"), ({"stop": [""]}, "stop"),
    ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream": "yes"}, "stream"), ({"stream_options": 1}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"user": 1}, "user"), ({"cache_salt": 1}, "cache_salt"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"messages": [{"role": ["user"], "content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": {"x": 1}, "content": "a"}]}, "messages[0].role"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("inf")}, "top_p"),
])
def test_chat_rejects_wrong_fields_naming_them(change, param):
    with pytest.raises(APIError) as err:
        parse_chat({**CHAT, **change}, LIMITS)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion({"model": "m", "prompt": prompt}, LIMITS).prompts == expected


@pytest.mark.parametrize("change, param", [
    ({"prompt": None}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"), ({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"prompt": ["a"] * 65}, "prompt"),
])
def test_completion_rejects_wrong_fields(change, param):
    with pytest.raises(APIError) as err:
        parse_completion({"model": "m", "prompt": "x", **change}, GatewaySettings())
    assert err.value.status == 400 and err.value.param == param


def test_body_must_be_an_object():
    with pytest.raises(APIError) as err:
        parse_chat([1], LIMITS)
    assert err.value.status == 400


# ---- the JSON body itself: what Python's json accepts and JSON does not

def _body_error(raw: bytes) -> APIError:
    with pytest.raises(APIError) as err:
        parse_body(raw)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("raw, param, words", [
    (b'{"temperature": NaN}', "temperature", "NaN"),
    (b'{"top_p": Infinity}', "top_p", "Infinity"),
    (b'{"a": {"b": [1, -Infinity]}}', "a.b[1]", "-Infinity"),
    (b'{"temperature": 1e400}', "temperature", "1e400"),
    (b'{"max_tokens": ' + b"9" * 400 + b"}", "max_tokens", "64 bits"),
    (b'{"prompt": [1, ' + b"9" * 5000 + b"]}", "prompt[1]", "64 bits"),
    (b'{"seed": -9223372036854775809}', "seed", "64 bits"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "surrogate"),
    (b'{"prompt": ["ok", "a\\udfffb"]}', "prompt[1]", "surrogate"),
    (b'{"cache_salt": "\\udc00"}', "cache_salt", "surrogate"),
    (b'{"stop": ["\\ud83d"]}', "stop[0]", "surrogate"),
    (b'{"user": {"\\ud800": 1}}', "user", "key"),
    (b'{"\\ud800": 1}', None, "key"),
    (b"[" * 65 + b"]" * 65, "[0]" * 64, "nested too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    (b'{"a": 1', None, "not valid JSON"),
    (b'\xff{}', None, "not valid JSON"),
])
def test_body_rejects_what_json_does_not_allow_naming_the_field(raw, param, words):
    err = _body_error(raw)
    assert err.param == param and words in err.message


def test_body_accepts_ordinary_json_up_to_the_limits():
    assert parse_body(b'{"a": [1.5, -2, 9223372036854775807, -9223372036854775808, "\\ud83d\\ude00", null]}') == {
        "a": [1.5, -2, 2**63 - 1, -2**63, "\U0001f600", None]}
    assert parse_body(b"[" * 64 + b"]" * 64) is not None


def test_the_pin_scope_the_gateway_fills_in_is_no_setting(tmp_path):
    """The engine's salt_fingerprint and tenants come from the gateway's keys: no flag and no YAML key sets them."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    assert not {"--salt-fingerprint", "--tenants"} & flags
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  tenants: [mallory]\n")
    with pytest.raises(ValueError, match="unknown key.*tenants"):
        load_settings(config)


async def test_the_gateway_hands_the_engine_its_salt_fingerprint_and_tenants(aiohttp_client, tiny_llama_dir):
    """The engine restores only the saved pins made under this salt secret, of tenants the keys still name."""
    from gateway.app import create_app
    from gateway.state import STATE
    from tests.support.gateway_helpers import tiny_settings

    keys = (ApiKey("sk-a", "alice"), ApiKey("sk-b", "bob"))
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, keys=keys)))
    engine = client.app[STATE].settings.engine
    assert engine.tenants == ("alice", "bob") and len(engine.salt_fingerprint) == 16


def test_the_cluster_hands_its_replicas_the_pin_scope_of_its_gateway(monkeypatch, tmp_path):
    """The replicas' engines restore only the saved pins made under this salt secret, of its tenants: unscoped,
    they restored every saved pin and saved theirs with no fingerprint, which a later gateway's engine dropped."""
    import ray
    from ray import serve

    import cluster.__main__ as cluster_main
    from gateway.app import scoped_settings
    deployed = []

    def deploy(settings, *args, **kwargs):
        deployed.append(settings.engine)
        raise cluster_main.StartupError("stop here")

    for target, name in ((ray, "init"), (ray, "shutdown"), (serve, "start"), (serve, "shutdown")):
        monkeypatch.setattr(target, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(cluster_main, "deploy", deploy)
    argv = ["serve", "--replicas", "2", "--salt-secret", "s3cret", "--model", "default"]
    assert cluster_main.main(argv) == 2
    [engine] = deployed
    gateway_args = cluster_main.build_parser().parse_args(argv[:1] + argv[3:])
    expected = scoped_settings(cluster_main.settings_from_args(gateway_args))[0].engine
    assert engine.salt_fingerprint is not None and engine.tenants
    assert (engine.salt_fingerprint, engine.tenants) == (expected.salt_fingerprint, expected.tenants)
