"""numba's cache folder for the CPU kernels follows their sources: an edit of any kernel file (not only of
the file that defines a function) moves the cache to a fresh folder."""
from __future__ import annotations

import os
from pathlib import Path

import numba
import pytest

from engine.model import decode_step_cpu, kernel_cache, paged_decode_cpu


def test_the_kernels_cache_in_the_folder_for_their_sources():
    folder = str(kernel_cache.folder())
    assert numba.config.CACHE_DIR == folder
    for kernel in (paged_decode_cpu.attend, decode_step_cpu._step):
        assert kernel._cache._cache_path.startswith(folder)


def test_a_second_clone_of_the_same_sources_finds_the_kernels_the_first_compiled(tmp_path):
    """numba's own locator keys the subfolder on the checkout's absolute path, so every clone or worktree
    compiled anew; ours keys it on nothing but the sources (the folder's name and each file's content hash)."""
    kernel = paged_decode_cpu.attend
    source = Path(paged_decode_cpu.__file__)
    clone = tmp_path / "clone" / "engine" / "model"
    clone.mkdir(parents=True)
    (clone / source.name).write_bytes(source.read_bytes())
    here = kernel_cache._KernelLocator.from_function(kernel.py_func, str(source))
    there = kernel_cache._KernelLocator.from_function(kernel.py_func, str(clone / source.name))
    assert here.get_cache_path() == there.get_cache_path() == kernel._cache._cache_path
    assert here.get_source_stamp() == there.get_source_stamp()
    (clone / source.name).write_bytes(source.read_bytes() + b"#")  # an edit: numba's index sees the new hash
    assert kernel_cache._KernelLocator.from_function(kernel.py_func, str(clone / source.name)).get_source_stamp() \
        != here.get_source_stamp()
    elsewhere = tmp_path / "other_package.py"
    elsewhere.write_text("")
    assert kernel_cache._KernelLocator.from_function(kernel.py_func, str(elsewhere)) is None  # numba's own, there


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


def test_the_folder_follows_numbas_and_llvmlites_versions_and_the_cpu(monkeypatch, tmp_path):
    """Two CPU models on one shared volume, or two numba versions, never share an index."""
    import llvmlite

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    before = kernel_cache.folder()
    for module, attr, value in ((numba, "__version__", "0.0.1"), (llvmlite, "__version__", "0.0.1"),
                                (numba.config, "CPU_NAME", "haswell"), (numba.config, "CPU_FEATURES", "+avx2")):
        with monkeypatch.context() as patch:
            patch.setattr(module, attr, value)
            assert kernel_cache.folder() != before, (module, attr)
    assert kernel_cache.folder() == before


@pytest.mark.slow  # a fresh interpreter imports torch and numba
def test_an_unwritable_folder_is_reported_and_the_kernels_compile_in_memory(tmp_path):
    """Never loaded from elsewhere: numba's own fallback (the source tree's __pycache__) is keyed by one
    file only, so it served a stale kernel after an edit of another."""
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder beneath a regular file cannot be made, even by root
    code = ("from engine.model import kernel_cache, paged_decode_cpu\n"
            "print(kernel_cache.CACHE, type(paged_decode_cpu.attend._cache).__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[3],
                            env={**os.environ, "NUMBA_CACHE_DIR": str(blocker / "numba")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "NullCache"]
    assert "cannot be written: compiling them in memory" in result.stderr


def test_saving_to_the_cache_waits_for_another_process_holding_the_folder_lock(tmp_path):
    """numba names a data file from the index it read: two processes saving at once could map one signature
    to the other's code. The lock (an flock, which another open file description of this process also
    contends for) serialises them."""
    import fcntl
    import threading

    from numba.core.caching import IndexDataCacheFile

    cache_file = IndexDataCacheFile(str(tmp_path), "kernel-test", source_stamp=(0, 0))
    saved = threading.Event()

    def save() -> None:
        cache_file.save(("signature", "target"), b"machine code")
        saved.set()

    with open(tmp_path / kernel_cache.LOCK_FILE, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = threading.Thread(target=save)
        writer.start()
        assert not saved.wait(0.5)  # blocked on the lock, however slow this machine is
        fcntl.flock(held, fcntl.LOCK_UN)
    writer.join(30)
    assert saved.is_set() and cache_file.load(("signature", "target")) == b"machine code"


def test_compiling_ahead_runs_the_model_and_names_the_kernels_folder(tiny_llama_dir, capsys):
    """`python -m engine.model.compile`'s work: the engine on a few prompts (the kernels compile or load), then
    where they are kept."""
    from engine.model.compile import compile_kernels

    assert compile_kernels(str(tiny_llama_dir), "float32", "float32") > 0
    assert f"kernels ready in {kernel_cache.folder()}" in capsys.readouterr().err
