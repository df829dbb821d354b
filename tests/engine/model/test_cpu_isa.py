"""The CPU kernels per vector instruction set: the row group each one gets, and the kernels compiled for
AVX2 (numba's CPU-name override) on an x86 host, checked against torch in a process of their own."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from llvmlite import binding

from engine.model.kernel_cache import vector_isa
from engine.model.packed_matmul_cpu import row_group

REPO = Path(__file__).resolve().parents[3]
HOST_FEATURES = binding.get_host_cpu_features().flatten()


@pytest.mark.parametrize("features, isa, rows", [
    ("+sse2,+avx,+avx2,+fma,+avx512f,+avx512bw", "avx512", 8),
    ("+sse2,+avx,+avx2,+fma,-avx512f,-avx512bw", "avx2", 2),  # 16 ymm registers: 8 rows spilled
    ("+fp-armv8,+neon,+crc", "neon", 2),  # 32 registers of 4 floats
    ("+sse2,+sse4.2", "generic", 1),
    ("", "generic", 1),  # the named CPU's own features: unknown here, so the safe choice
])
def test_each_instruction_set_gets_the_row_group_its_registers_hold(features, isa, rows):
    assert vector_isa(features) == isa
    assert row_group(isa) == rows


AVX2_CHECK = """
import torch
from engine.model import kernel_cache, packed_matmul_cpu
assert kernel_cache.TARGET_ISA == "avx2" and packed_matmul_cpu.ROW_GROUP == 2, kernel_cache.TARGET_ISA
x, w = torch.randn(9, 40), torch.randn(70, 40)
torch.testing.assert_close(packed_matmul_cpu.linear(x, packed_matmul_cpu.pack(w), None, 70), x @ w.T,
                           rtol=1e-5, atol=1e-5)
asm = "".join(packed_matmul_cpu.matmul.inspect_asm().values())
assert "ymm" in asm and "zmm" not in asm, "not AVX2 code"
print("ok")
"""


@pytest.mark.slow  # fresh processes, one compiling the matmul for AVX2
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or vector_isa(HOST_FEATURES) == "generic",
                    reason="AVX2 code runs only on an x86 CPU with AVX2")
def test_kernels_compiled_for_avx2_use_its_registers_and_match_torch(tmp_path):
    """NUMBA_CPU_NAME=haswell with the host's features minus AVX-512: the machine code uses no AVX-512 register,
    and on a host with AVX-512 every kernel test of the packed and the quantized matmuls passes with AVX2's row
    group (and the 6-bit weights' lanes as AVX2 splits them)."""
    features = ",".join("-" + f[1:] if f[1:].startswith("avx512") else f for f in HOST_FEATURES.split(","))
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": features}
    # numba shows no machine code of a kernel loaded from its cache: the check compiles into an empty one
    check = subprocess.run([sys.executable, "-c", AVX2_CHECK], cwd=REPO, env={**env, "NUMBA_CACHE_DIR": str(tmp_path)},
                           capture_output=True, text=True, timeout=600)
    assert check.stdout.strip() == "ok", check.stderr[-3000:]
    if vector_isa(HOST_FEATURES) == "avx2":
        return  # the suite's own runs of the kernel tests on this host are AVX2 code with AVX2's row group
    # the kernel tests load AVX2 code from the kernels' cache (its folder is keyed on the CPU name and features,
    # so never the host's code), compiled once per version of the kernels' sources as the host's is
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/engine/model/test_packed_matmul.py", "tests/engine/model/test_quant_matmul.py"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
