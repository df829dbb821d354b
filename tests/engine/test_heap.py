"""engine.heap.trim: the C heap's freed pages go back to the OS after the engine loads."""
from __future__ import annotations

import platform

import psutil

from engine import LLM, heap


def test_trim_returns_freed_heap_pages_on_glibc():
    if platform.libc_ver()[0] != "glibc":
        assert heap.trim() is False
        return
    blocks = [bytearray(64 * 1024) for _ in range(1000)]  # below mmap's threshold: heap pages, not mappings
    del blocks[:-1]  # all but the top one freed: a hole glibc keeps while the top chunk is in use
    before = psutil.Process().memory_info().rss
    assert heap.trim() is True
    assert psutil.Process().memory_info().rss < before


def test_the_engine_trims_its_heap_once_loaded(tiny_llama_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    LLM(str(tiny_llama_dir), cpu_kernels="eager", num_kv_blocks=8)
    assert calls == [1]


def test_the_api_process_trims_its_heap_once_its_tokenizer_is_loaded(tiny_llama_dir, monkeypatch):
    from engine import process_client
    from engine.messages import EngineInfo
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    info = EngineInfo("tiny", str(tiny_llama_dir), 64, 512, 8, [2], None, None, 1)
    tokenizer = process_client._load_tokenizer(info)
    assert calls == [1]
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
