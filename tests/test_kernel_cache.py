"""numba's cache folder for the CPU kernels follows their sources: an edit of any kernel file (not only of
the file that defines a function) moves the cache to a fresh folder."""
from __future__ import annotations

from pathlib import Path

import numba

from engine.model import decode_step_cpu, kernel_cache, paged_decode_cpu


def test_the_kernels_cache_in_the_folder_for_their_sources():
    folder = str(kernel_cache.folder())
    assert numba.config.CACHE_DIR == folder
    for kernel in (paged_decode_cpu.attend, decode_step_cpu._step):
        assert kernel._cache._cache_path.startswith(folder)


def test_an_edit_of_any_kernel_source_changes_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    before = kernel_cache.folder()
    assert before.parent == tmp_path
    read_bytes = Path.read_bytes
    for name in kernel_cache.KERNEL_SOURCES:
        with monkeypatch.context() as patch:
            patch.setattr(Path, "read_bytes",
                          lambda self, name=name: read_bytes(self) + (b"#" if self.name == name else b""))
            assert kernel_cache.folder() != before
    assert kernel_cache.folder() == before
