"""A first start compiles in two processes: the decode step here, the kernels of steps with a prefill chunk in a
second process (engine/model/compile.py), which this one waits for before its first such step."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from engine import core as engine_core
from engine import threads
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model import compile as compile_ahead
from engine.model import kernel_cache


@pytest.fixture
def first_start(monkeypatch, tmp_path):
    """An empty kernel folder, two cores and memory to spare; the processes it would start, recorded."""
    monkeypatch.setattr(kernel_cache, "FOLDER", tmp_path / "numba")
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(compile_ahead, "_available_memory", lambda: 64 << 30)
    started, real_popen = [], subprocess.Popen

    def popen(command, **kwargs):
        started.append(command)
        return real_popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(compile_ahead.subprocess, "Popen", popen)
    return started


def test_a_first_start_compiles_the_prefill_kernels_in_a_second_process_as_serve_runs_the_model(first_start, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"0" * 1000)
    config = EngineConfig(model=str(model), dtype="bfloat16", kv_cache_dtype="float32", quantization="none",
                          quantized_activations="int8")
    second = compile_ahead.start_prefill_compile(config, model)
    assert second is not None and second.wait()
    [command] = first_start
    assert command[:3] == [sys.executable, "-m", "engine.model.compile"]
    options = dict(zip(command[4::2], command[5::2], strict=True))
    assert command[3] == "--prefill-only"
    assert options == {"--model": str(model), "--dtype": "bfloat16", "--kv-cache-dtype": "float32",
                       "--quantized-activations": "int8", "--quantization": "none"}


def test_no_second_process_where_the_cache_has_the_attention_one_core_or_too_little_memory(first_start, monkeypatch,
                                                                                        tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"0" * 4096)
    config = EngineConfig(model=str(model))
    with monkeypatch.context() as patch:
        patch.setattr(threads, "usable_cores", lambda: 1)
        assert compile_ahead.start_prefill_compile(config, model) is None
    with monkeypatch.context() as patch:  # a second copy of the model's 4 KB and the 1 GB margin do not fit
        patch.setattr(compile_ahead, "_available_memory", lambda: compile_ahead.MEMORY_MARGIN + 4096)
        assert compile_ahead.start_prefill_compile(config, model) is None
    with monkeypatch.context() as patch:
        patch.setattr(kernel_cache, "CACHE", False)  # compiled in memory: nothing a second process could hand over
        assert compile_ahead.start_prefill_compile(config, model) is None
    assert compile_ahead.start_prefill_compile(config.replace(dtype="float16"), model) is None  # no kernel for it
    index = kernel_cache.FOLDER / "kernels" / "paged_decode_cpu.attend-108.py311.nbi"
    index.parent.mkdir(parents=True)
    index.write_bytes(b"")
    assert compile_ahead.start_prefill_compile(config, model) is None
    assert first_start == []
    index.unlink()
    assert compile_ahead.start_prefill_compile(config, model).wait()
    assert len(first_start) == 1


def test_a_failed_second_process_leaves_the_compiling_to_this_one(caplog):
    log = compile_ahead.tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-c", "import sys; print('out of memory'); sys.exit(3)"],
                               stdout=log, stderr=subprocess.STDOUT)
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        assert not compile_ahead.PrefillCompile(process, log).wait()
    assert "exit 3" in caplog.text and "out of memory" in caplog.text


def test_a_second_process_that_hangs_is_stopped_and_this_one_compiles(monkeypatch, caplog):
    monkeypatch.setattr(compile_ahead, "WAIT_S", 0.5)
    log = compile_ahead.tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=log,
                               stderr=subprocess.STDOUT)
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        assert not compile_ahead.PrefillCompile(process, log).wait()
    assert process.returncode is not None and "failed" in caplog.text


def test_the_engine_waits_for_the_second_process_once_its_decode_step_is_compiled(tiny_llama_dir, monkeypatch):
    calls = []

    class Second:
        def wait(self):
            calls.append("wait")
            return True

    def start(config, path):
        calls.append(("start", config.model, path))
        return Second()

    monkeypatch.setattr(compile_ahead, "start_prefill_compile", start)
    decode_probe = engine_core.ModelRunner.decode_probe
    monkeypatch.setattr(engine_core.ModelRunner, "decode_probe",
                        lambda runner: (calls.append("decode step"), decode_probe(runner))[1])
    calibration_step = engine_core.ModelRunner.calibration_step
    monkeypatch.setattr(engine_core.ModelRunner, "calibration_step",
                        lambda runner, *a: (calls.append("prefill step"), calibration_step(runner, *a))[1])
    EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16, threads=1), prefill_compile=True)
    # the decode step compiled (its probe ran) before the wait; the steps with a prefill chunk after it
    assert calls[0] == ("start", str(tiny_llama_dir), tiny_llama_dir)
    assert calls.index("wait") > calls.index("decode step")
    assert calls.index("prefill step") > calls.index("wait")
    calls.clear()
    EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16, threads=1))  # LLM, tests: no second process
    assert calls and "wait" not in calls and not any(isinstance(c, tuple) for c in calls)


def test_the_second_process_compiles_the_prefill_path_without_a_decode_step(tiny_llama_dir, monkeypatch):
    built, tied = [], []
    monkeypatch.setattr(EngineCore, "close", lambda core: built.append(core))
    monkeypatch.setattr("engine.engine_process._die_with_parent", lambda: tied.append(True))
    assert compile_ahead.main(["--prefill-only", "--model", str(tiny_llama_dir), "--dtype", "float32"]) == 0
    [core] = built
    assert tied  # ends with the start-up that started it
    assert core.runner.compiled_decode is None and core.runner.max_compiled_rows == 0
    assert core.runner.paged_kernel  # the decode rows of a step with a prefill chunk: the paged attention
    assert EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16, threads=1,
                                   threads_batch=1)).runner.compiled_decode is not None
