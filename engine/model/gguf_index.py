"""A GGUF file's tensor index: each tensor's name, ggml type, dims, data offset and byte count, read once with
the gguf library and kept as JSON in the model directory beside config.json. Later loads memory-map the
tensors from it with numpy: GGUFReader walks every metadata field in Python, the whole vocabulary and its
merges included, at each parse. The index names the file's size and mtime; a file that no longer matches
(or a directory without an index) is parsed again and indexed anew."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader

logger = logging.getLogger("prefixgate.engine")

INDEX_NAME = "gguf_tensors.json"
_VERSION = 2  # bumped when the entries change, so an older index is parsed again rather than misread
# metadata the model directory is built from beyond what transformers reads: rope scaling (under the architecture's
# name) and the tokens a turn may end with besides the EOS (llama.cpp stops on each)
_ROPE_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length")
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    qtype: QType
    dims: tuple[int, ...]  # ggml order: dims[0] is a row's element count
    data: np.ndarray  # the file's bytes as GGUFReader's `data` views them (its dtype and shape)


class ArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its mapping. GGUFReader slices its np.memmap at every metadata
    value, and each slice of a memmap runs numpy's Python-level __array_finalize__: over the default model's
    vocabulary and merges that was most of a parse (docs/quantization.md)."""

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # where GGUFReader.__init__ puts its mapping, before it parses
        self._array = mapped.view(np.ndarray)  # (the view keeps the mapping alive)


def read_indexed(gguf_file: Path) -> tuple[str, list[GGUFTensor]]:
    """The file's architecture and its tensors, mapped through the index in the file's directory (the index
    written there first when it is missing or stale)."""
    index = _load(gguf_file) or write_index(gguf_file, gguf_file.parent)
    mapped = np.memmap(gguf_file, mode="r")
    return index["architecture"], [_view(mapped, entry) for entry in index["tensors"]]


def write_index(gguf_file: Path, out_dir: Path) -> dict:
    """Parse the file with the gguf library and write its index to out_dir (atomically); a directory that
    cannot be written keeps no index, so the next load parses again."""
    logger.info("indexing the tensors of %s (once per file)", gguf_file.name)
    reader = ArrayReader(gguf_file)
    parts = reader.fields.get("split.count")
    if parts is not None and parts.contents() > 1:
        raise ValueError(f"{gguf_file.name} is one of {parts.contents()} parts of a split GGUF file; merge them into "
                         f"one first: llama-gguf-split --merge {gguf_file.name} merged.gguf")
    architecture = reader.fields["general.architecture"].contents()
    keys = [*(f"{architecture}.{key}" for key in _ROPE_KEYS), *END_TOKEN_KEYS]
    index = {"version": _VERSION, **_stamp(gguf_file), "architecture": architecture,
             "metadata": {key: reader.fields[key].contents() for key in keys if key in reader.fields},
             "tensors": [{"name": t.name, "type": QType(t.tensor_type).name, "dims": [int(d) for d in t.shape],
                          "offset": int(t.data_offset), "bytes": int(t.n_bytes), "dtype": t.data.dtype.str,
                          "shape": list(t.data.shape)} for t in reader.tensors]}
    path = out_dir / INDEX_NAME
    staged = path.with_name(f".{INDEX_NAME}.{os.getpid()}")
    try:
        staged.write_text(json.dumps(index))
        staged.replace(path)  # a concurrent loader sees the old index or the new one, never half of one
    except OSError as error:
        logger.warning("%s: tensor index not kept (%s); the next load parses the file again", gguf_file, error)
    return index


def float_tensor(gguf_file: Path, index: dict, name: str) -> np.ndarray | None:
    """An F32 tensor of the file (a small table such as rope_freqs), or None where it has none."""
    entry = next((e for e in index["tensors"] if e["name"] == name and e["type"] == "F32"), None)
    return None if entry is None else np.array(_view(np.memmap(gguf_file, mode="r"), entry).data, np.float32).ravel()


def has_index(model_dir: Path) -> bool:
    return (model_dir / INDEX_NAME).is_file()


def _stamp(gguf_file: Path) -> dict[str, int]:
    stat = gguf_file.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _load(gguf_file: Path) -> dict | None:
    """The index in the file's directory, or None if there is none, it cannot be read, or it describes
    another version of the file."""
    try:
        index = json.loads((gguf_file.parent / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return None
    current = {"version": _VERSION, **_stamp(gguf_file)}
    return index if {key: index.get(key) for key in current} == current else None


def _view(mapped: np.memmap, entry: dict) -> GGUFTensor:
    start = entry["offset"]
    data = mapped[start:start + entry["bytes"]].view(np.dtype(entry["dtype"])).reshape(entry["shape"])
    return GGUFTensor(entry["name"], QType[entry["type"]], tuple(entry["dims"]), data)
