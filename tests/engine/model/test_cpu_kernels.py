"""The way back from the compiled CPU kernels: --cpu-kernels eager runs in plain PyTorch, imports no numba, and
answers as the compiled path does; without numba the compiled path says what to do in one line."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from engine import LLM, SamplingParams
from engine.model.linear import Linear
from tests.support.gateway_helpers import REPO

PROMPTS = [list(range(3, 40)), list(range(50, 60)), list(range(3, 40)) + [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_eager_steps_run_without_any_compiled_kernel_and_answer_the_same(tiny_llama_dir):
    compiled = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    eager = LLM(str(tiny_llama_dir), num_kv_blocks=64, cpu_kernels="eager")
    runner = eager.core.runner
    assert runner.compiled_decode is None and not runner.paged_kernel
    assert all(m.packed is None and m.weight is not None for m in eager.core.model.modules() if isinstance(m, Linear))
    assert compiled.core.runner.compiled_decode is not None and compiled.core.runner.paged_kernel
    expected = [o.token_ids for o in compiled.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.slow  # a fresh process: torch, the model and its kernels loaded anew
def test_with_numba_hidden_eager_serves_and_compiled_says_what_to_do(tiny_llama_dir, tiny_qwen2_dir):
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["numba"] = sys.modules["llvmlite"] = None  # as if neither were installed
        from engine import LLM, SamplingParams
        llm = LLM({str(tiny_llama_dir)!r}, num_kv_blocks=64, cpu_kernels="eager")
        out = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        try:
            LLM({str(tiny_qwen2_dir)!r}, num_kv_blocks=64)
            message = None
        except ValueError as exc:
            message = str(exc)
        print(json.dumps({{"tokens": [o.token_ids for o in out], "message": message,
                          "numba": [m for m in sys.modules if m.startswith("numba") and sys.modules[m]]}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    expected = [o.token_ids for o in LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(PROMPTS, GREEDY)]
    assert result["tokens"] == expected and result["numba"] == []
    assert "numba" in result["message"] and "--cpu-kernels eager" in result["message"]


@pytest.mark.slow  # a fresh process: torch, the model and its kernels loaded anew
def test_start_up_loads_every_kernel_overload_the_first_requests_use(tiny_llama_dir):
    """The first request costs what the second does: after LLM(...) returns, serving (prefill chunks, shared
    prefixes, a batch of decodes, sampling) compiles or loads no further numba overload. In a fresh process,
    since this one's kernels have run other shapes already."""
    code = textwrap.dedent(f"""
        import json
        from numba.core.dispatcher import Dispatcher
        from engine import LLM, SamplingParams
        from engine.model import decode_step_cpu, packed_matmul_cpu, paged_decode_cpu

        def overloads():
            return {{f"{{m.__name__}}.{{n}}": sorted(str(s) for s in d.overloads)
                     for m in (decode_step_cpu, packed_matmul_cpu, paged_decode_cpu)
                     for n, d in vars(m).items() if isinstance(d, Dispatcher)}}

        llm = LLM({str(tiny_llama_dir)!r}, num_kv_blocks=64, max_num_batched_tokens=32)
        before = overloads()
        prompts = [list(range(3, 80)), list(range(3, 80)) + [5, 6], list(range(50, 60))]
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        llm.generate([list(range(3, 9))], SamplingParams(max_tokens=3, temperature=0.7))
        print(json.dumps({{"before": before, "after": overloads()}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    loaded = {name for name, signatures in result["before"].items() if signatures}
    assert {"engine.model.decode_step_cpu._step", "engine.model.packed_matmul_cpu.matmul",
            "engine.model.paged_decode_cpu.attend"} <= loaded
    assert result["after"] == result["before"]
