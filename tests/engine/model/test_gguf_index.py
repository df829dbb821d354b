"""The tensor index of a GGUF file: the tensors mapped through it are the gguf library's own, byte for byte, and
an index that is missing, stale or of another version is never read: the file is parsed and indexed again."""
from __future__ import annotations

import json
import logging
import os

import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader

from engine.model import gguf_index
from engine.model.gguf_index import INDEX_NAME, read_indexed, write_index
from engine.model.gguf_loader import WEIGHTS_NAME
from tests.support.tiny_gguf import write_gguf_model

# a float, a half, a bf16 (bytes to GGUFReader) and every block format the loader meets, on one tiny model
FORMATS = {"attn_q.": QType.F16, "attn_k.": QType.BF16, "attn_v.": QType.Q4_0, "attn_output.": QType.Q4_1,
           "ffn_down.": QType.Q5_0, "token_embd.": QType.F32}


def _format_of(name: str) -> QType:
    return next((qtype for part, qtype in FORMATS.items() if part in name), QType.Q8_0)


@pytest.fixture
def gguf_file(tiny_llama_dir, tmp_path):
    return write_gguf_model(tiny_llama_dir, tmp_path / "gguf", _format_of) / WEIGHTS_NAME


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Each parse of a GGUF file by the index, recorded."""
    calls: list[str] = []
    parse = gguf_index.ArrayReader

    def reader(path):
        calls.append(str(path))
        return parse(path)
    monkeypatch.setattr(gguf_index, "ArrayReader", reader)
    return calls


def _assert_same_as_reader(gguf_file, arch: str, tensors) -> None:
    reader = GGUFReader(gguf_file)
    assert arch == "llama"
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.qtype == theirs.tensor_type and ours.dims == tuple(theirs.shape.tolist())
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert ours.data.tobytes() == theirs.data.tobytes()


def test_indexed_tensors_are_the_gguf_readers_byte_for_byte(gguf_file, parses):
    arch, tensors = read_indexed(gguf_file)  # no index yet: parsed and indexed
    assert {t.qtype for t in tensors} == {QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0,
                                          QType.Q8_0}
    _assert_same_as_reader(gguf_file, arch, tensors)
    arch, tensors = read_indexed(gguf_file)  # through the index
    _assert_same_as_reader(gguf_file, arch, tensors)
    assert parses == [str(gguf_file)]
    assert (gguf_file.parent / INDEX_NAME).is_file()


def test_a_rewritten_file_is_parsed_and_indexed_again(gguf_file, tiny_llama_dir, tmp_path, parses):
    read_indexed(gguf_file)
    rewritten = write_gguf_model(tiny_llama_dir, tmp_path / "again", lambda name: QType.Q4_0) / WEIGHTS_NAME
    os.replace(rewritten, gguf_file)  # other formats, other size, same path
    arch, tensors = read_indexed(gguf_file)
    assert {t.qtype for t in tensors} == {QType.F32, QType.Q4_0}
    _assert_same_as_reader(gguf_file, arch, tensors)
    assert len(parses) == 2
    read_indexed(gguf_file)
    assert len(parses) == 2  # the new index is used


def test_an_index_of_another_mtime_or_version_is_not_read(gguf_file, parses):
    read_indexed(gguf_file)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    read_indexed(gguf_file)
    assert len(parses) == 2
    index_path = gguf_file.parent / INDEX_NAME
    assert json.loads(index_path.read_text())["mtime_ns"] == stat.st_mtime_ns + 1
    index_path.write_text(json.dumps({**json.loads(index_path.read_text()), "version": 0}))
    read_indexed(gguf_file)
    index_path.write_text("{")  # cut short
    read_indexed(gguf_file)
    assert len(parses) == 4


def test_a_directory_that_cannot_hold_the_index_still_loads(gguf_file, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        index = write_index(gguf_file, tmp_path / "missing")
    assert "tensor index not kept" in caplog.text
    assert [entry["name"] for entry in index["tensors"]] == [t.name for t in GGUFReader(gguf_file).tensors]
