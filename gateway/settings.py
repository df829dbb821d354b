"""Gateway settings: YAML read once, CLI overrides merged, frozen dataclasses out."""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig, settable
from gateway.generation_defaults import parse_override
from gateway.reasoning import PARSER_NAMES as REASONING_PARSERS

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
ANONYMOUS_TENANT = "anonymous"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key and the tenant it names."""

    key: str = field(repr=False)
    tenant: str
    salt: str | None = field(default=None, repr=False)  # None: derived from the tenant name
    max_concurrent: int | None = None  # requests in flight with this key (None: no per-key limit)
    share_public_salt: bool = False
    max_pinned_blocks: int | None = None  # KV blocks its tenant's pins may hold (None: only the server's cap)


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = _knob("127.0.0.1", "address to listen on")
    port: int = _knob(8000, "TCP port to listen on")
    max_waiting_requests: int = _knob(
        256, "sequences that may wait beyond the engine's max_num_seqs running ones; more -> 429")
    max_concurrent_per_tenant: int | None = _knob(
        None, "concurrent requests per tenant, all its keys together (None: unlimited); a key may also have its own")
    retry_after_s: int = _knob(1, "Retry-After seconds sent with a 429")
    max_body_bytes: int = _knob(4 * 1024 * 1024, "largest request body accepted (413 above)")
    max_prompt_tokens: int | None = _knob(None, "longest prompt in tokens (None: the model's context length)")
    max_tokens_limit: int | None = _knob(None, "largest max_tokens a request may ask for (None: no cap but the context)")
    default_max_tokens: int | None = _knob(
        1024, "max_tokens of a request that sets none, when the model's generation_config.json has no "
              "max_new_tokens (None: the rest of the context, as vLLM)")
    max_n: int = _knob(8, "largest n (choices per prompt)")
    max_prompts: int = _knob(64, "largest number of prompts in one /v1/completions request")
    max_stop_sequences: int = _knob(4, "most stop strings per request")
    max_messages: int = _knob(1024, "most chat messages per request")
    max_top_logprobs: int = _knob(20, "largest top_logprobs (chat, responses) / logprobs (completions)")
    shutdown_timeout_s: float = _knob(10.0, "on SIGTERM/SIGINT, how long in-flight requests may finish")
    stream_write_timeout_s: float = _knob(
        30.0, "a streaming client that reads nothing for this long is dropped (its request aborted)")
    public_salt_tenants: tuple[str, ...] = _knob((), "tenants that share one cache salt on purpose")
    salt_secret: str | None = field(default=None, repr=False, metadata={
        "help": "secret that derives tenant salts (None: $PREFIXGATE_SALT_SECRET, else one generated once and "
                "kept in the cache folder)"})
    api_keys_file: str | None = _knob(
        None, "YAML file: key -> {tenant, salt?, max_concurrent?, share_public_salt?, max_pinned_blocks?}")
    metrics_api_key: str | None = field(default=None, repr=False, metadata={
        "help": "bearer key that /metrics requires (None: /metrics is open, and it lists tenant names)"})
    log_level: str = _knob("info", "debug | info | warning | error")
    vllm_metrics: bool = _knob(True, "/metrics also shows the series vLLM exports under vLLM's names "
                                     "(vllm:num_requests_waiting, ...): dashboards and autoscalers built for vLLM")
    served_model_name: tuple[str, ...] = _knob(
        (), "the model's names in the API, as vLLM's --served-model-name: answers carry the first, each selects the "
            "model; none: its own name (a .gguf file's is its file name without .gguf)")
    tool_call_parser: str = _knob("auto", "auto (from the chat template) | hermes | llama3_json")
    reasoning_parser: str = _knob("auto", "the answer's <think>...</think> in the message's reasoning: auto (when the "
                                          "chat template writes either tag) | none | deepseek_r1 | qwen3 (vLLM's names)")
    exclude_tools_when_tool_choice_none: bool = _knob(
        False, "tool_choice none leaves the tools out of the prompt (vLLM's flag; off: shown, and no call is parsed)")
    allowed_origins: tuple[str, ...] = _knob((), "CORS: browser origins allowed to call the API ('*': any); none: off")
    generation_config: str = _knob(
        "auto", "auto: sampling defaults and max_new_tokens from the model's generation_config.json | none: OpenAI's")
    override_generation_config: str | None = _knob(
        None, 'JSON object of sampling defaults over the model\'s, e.g. \'{"temperature": 0.2}\'')
    responses_store_max: int = _knob(
        1000, "responses kept for previous_response_id and GET /v1/responses/{id} per tenant, least recently used "
              "dropped (store: false keeps one out)")
    responses_ttl_days: float = _knob(30.0, "stored responses older than this many days are dropped (OpenAI: 30)")
    responses_db: str | None = _knob(
        None, "SQLite file of stored responses, shared by gateways on one host (None: $PREFIXGATE_RESPONSES_DB, "
        "else responses.sqlite3 in the cache folder; ':memory:': in the API process, lost at exit), or a "
        "postgresql:// URL: a server gateways on several hosts share")
    engine_process: bool = _knob(True, "run the engine in its own process (off: on a thread of the API process)")
    engine_restarts: int = _knob(
        3, "new engine processes started after the engine dies, within 10 minutes; then the server exits 1")
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)  # from --api-key and api_keys_file

    def __post_init__(self) -> None:
        _check(1 <= self.port <= 65535 or self.port == 0, "port must be in 0..65535")
        _check(self.max_waiting_requests >= 0, "max_waiting_requests must be >= 0")
        _check(self.max_concurrent_per_tenant is None or self.max_concurrent_per_tenant >= 1,
               "max_concurrent_per_tenant must be >= 1")
        _check(self.retry_after_s >= 0, "retry_after_s must be >= 0")
        _check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _check(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1")
        _check(self.max_tokens_limit is None or self.max_tokens_limit >= 1, "max_tokens_limit must be >= 1")
        _check(self.default_max_tokens is None or self.default_max_tokens >= 1, "default_max_tokens must be >= 1")
        for name in ("max_n", "max_prompts", "max_stop_sequences", "max_messages"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1")
        _check(self.max_top_logprobs >= 0, "max_top_logprobs must be >= 0")
        _check(self.shutdown_timeout_s >= 0, "shutdown_timeout_s must be >= 0")
        _check(self.stream_write_timeout_s > 0, "stream_write_timeout_s must be > 0")
        _check(self.engine_restarts >= 0, "engine_restarts must be >= 0")
        _check(self.responses_store_max >= 1, "responses_store_max must be >= 1 (a request's store: false keeps "
               "its response out)")
        _check(self.responses_ttl_days > 0, "responses_ttl_days must be > 0")
        _check(self.generation_config in ("auto", "none"), f"unknown generation_config {self.generation_config!r}")
        parse_override(self.override_generation_config)
        _check(self.log_level in ("debug", "info", "warning", "error"), f"unknown log_level {self.log_level!r}")
        _check(self.tool_call_parser in ("auto", "hermes", "llama3_json"),
               f"unknown tool_call_parser {self.tool_call_parser!r}")
        _check(self.reasoning_parser in REASONING_PARSERS, f"unknown reasoning_parser {self.reasoning_parser!r}; "
               f"use one of {', '.join(REASONING_PARSERS)}")

    def replace(self, **changes: Any) -> "GatewaySettings":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


def load_settings(config_path: str | Path | None = DEFAULT_CONFIG_PATH,
                  engine_overrides: dict[str, Any] | None = None,
                  gateway_overrides: dict[str, Any] | None = None,
                  api_keys: list[str] | None = None) -> Settings:
    """Defaults < YAML file < overrides (the command line). Unknown keys are an error."""
    sections = _read_yaml(config_path) if config_path else {}
    engine_values = _typed_section("engine", EngineConfig, sections.get("engine") or {})
    gateway_values = _typed_section("gateway", GatewaySettings, sections.get("gateway") or {})
    engine_values.update(_typed_section("engine", EngineConfig, engine_overrides or {}))
    gateway_values.update(_typed_section("gateway", GatewaySettings, gateway_overrides or {}))
    keys_file = gateway_values.get("api_keys_file")
    keys = _keys_from_flags(api_keys or []) + (_read_keys_file(keys_file) if keys_file else ())
    _check(len({k.key for k in keys}) == len(keys), "an API key is configured twice")
    _check_bare_keys(api_keys or [])
    return Settings(EngineConfig(**engine_values), GatewaySettings(**gateway_values, api_keys=keys))


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_value(hint: Any, value: Any) -> Any:
    """Converts a YAML or command-line value to the field's type; raises ValueError."""
    if _is_optional(hint):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        hint = _strip_optional(hint)
    if typing.get_origin(hint) is tuple:
        items = [value] if isinstance(value, str) else value
        if value is None or (isinstance(items, (list, tuple)) and len(items) == 1 and isinstance(items[0], str)
                             and items[0].lower() in ("none", "null")):
            return ()  # (none: the empty list, as the help and the YAML header say; not an entry named "none")
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(parse_value(typing.get_args(hint)[0], item) for item in items)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is bool:
        return _parse_bool(value)
    if hint is int and not isinstance(value, bool):
        if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
            return int(value)
    if hint is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return float(value)
    if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _settable_names(cls: type) -> set[str]:
    """The fields a YAML key or a flag sets: not api_keys (--api-key, --api-keys-file), not what the gateway fills in."""
    return {f.name for f in dataclasses.fields(cls) if settable(f) and f.name != "api_keys"}


def _typed_section(name: str, cls: type, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"config section {name!r} must be a mapping")
    types_ = {name: hint for name, hint in field_types(cls).items() if name in _settable_names(cls)}
    unknown = sorted(set(raw) - set(types_))
    _check(not unknown, f"unknown key(s) in config section {name!r}: {', '.join(map(str, unknown))}")
    values = {}
    for key, value in raw.items():
        try:
            values[key] = parse_value(types_[key], value)
        except ValueError as exc:
            raise ValueError(f"config {name}.{key}: {exc}") from None
    return values


def _read_yaml(path: str | Path) -> dict[str, Any]:
    data = _load_yaml(path)
    _check(isinstance(data, dict), f"{path}: the top level must be a mapping")
    unknown = sorted(set(data) - {"engine", "gateway"})
    _check(not unknown, f"{path}: unknown section(s): {', '.join(map(str, unknown))}")
    return data


def _load_yaml(path: str | Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:  # its position and problem only: the snippet could show an API key
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}") from None


def key_fingerprint(key: str) -> str:
    """A short, non-secret name for a key (logs, errors, tenant names): 8 hex digits of its sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def key_tenant(key: str) -> str:
    """The tenant of a key given without one: a tenant of its own, named after the key's fingerprint."""
    return "key-" + key_fingerprint(key)


def _keys_from_flags(flags: list[str]) -> tuple[ApiKey, ...]:
    """`--api-key KEY` (a tenant of its own, `key-<fingerprint>`) or `--api-key KEY:TENANT`."""
    keys = []
    for flag in flags:
        key, _, tenant = flag.partition(":")
        _check(bool(key) and not any(c.isspace() for c in key), "--api-key needs a non-empty key without spaces")
        keys.append(ApiKey(key=key, tenant=tenant or key_tenant(key)))
    return tuple(keys)


def _check_bare_keys(flags: list[str]) -> None:
    """Keys without a tenant never share one by accident (their fingerprints would have to collide).
    A key that names a `key-...` tenant joins it on purpose."""
    bare = [key_tenant(f) for f in flags if ":" not in f]
    for tenant in bare:
        if bare.count(tenant) > 1:
            raise ValueError(f"two API keys without a tenant would share tenant {tenant!r} (their fingerprints "
                             "collide); name their tenants: --api-key KEY:TENANT")


_KEY_FIELDS = {"tenant": str, "salt": str | None, "max_concurrent": int | None, "share_public_salt": bool,
               "max_pinned_blocks": int | None}


def _read_keys_file(path: str) -> tuple[ApiKey, ...]:
    data = _load_yaml(path)
    _check(isinstance(data, dict), f"{path}: expected a mapping key -> {{tenant, ...}}")
    return tuple(_key_entry(path, key, entry) for key, entry in data.items())


def _key_entry(path: str, key: Any, entry: Any) -> ApiKey:
    # YAML reads `0777:` as the int 511 and `on:` as True: such a key is not what the file says, so refuse it
    _check(isinstance(key, str), f"{path}: the key {key!r} is not a string; quote it ('...')")
    where = f"{path}: the key with sha256 {key_fingerprint(key)}..."  # never the key itself in a message
    _check(bool(key) and not any(c.isspace() for c in key), f"{where}: a key must be non-empty, without spaces")
    entry = {"tenant": entry} if isinstance(entry, str) else entry
    _check(isinstance(entry, dict) and "tenant" in entry, f"{where}: every key needs a tenant")
    unknown = sorted(map(str, set(entry) - set(_KEY_FIELDS)))
    _check(not unknown, f"{where}: unknown field(s) {', '.join(unknown)}")
    for name in ("tenant", "salt"):
        _check(entry.get(name) is None or isinstance(entry[name], str),
               f"{where}: {name} must be a string; quote it ('...')")
    _check(bool(entry["tenant"]), f"{where}: tenant must be a non-empty string")
    try:
        values = {name: parse_value(_KEY_FIELDS[name], value) for name, value in entry.items()}
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    _check(values.get("max_concurrent") is None or values["max_concurrent"] >= 1,
           f"{where}: max_concurrent must be >= 1")
    _check(values.get("max_pinned_blocks") is None or values["max_pinned_blocks"] >= 0,
           f"{where}: max_pinned_blocks must be >= 0")
    return ApiKey(key=key, **values)


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0]


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    raise ValueError(f"expected a bool, got {value!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
