"""Prefill's float GEMM (cpu_gemm): OpenBLAS split over threads and oneMKL give x @ w.T into a view of a wider
output."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from threadpoolctl import ThreadpoolController

from engine.model import cpu_gemm


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("openblas", [True, False])
@pytest.mark.parametrize("n,count", [(300, 1), (300, 2), (300, 3), (40, 2)])
def test_each_gemm_writes_the_product_into_its_columns_only(openblas, n, count, threads, monkeypatch):
    """n columns split over `count` threads (40: narrower than two parts, the caller alone), written into the
    middle columns of a wider output: the float64 product there to float32 summation, the rest untouched."""
    monkeypatch.setattr(cpu_gemm, "OPENBLAS", openblas)
    threads(count)
    rng = np.random.default_rng(n + count)
    x, w = rng.standard_normal((40, 96)).astype(np.float32), rng.standard_normal((n, 96)).astype(np.float32)
    out = torch.full((40, n + 30), 7.0)
    cpu_gemm.matmul_nt(torch.from_numpy(x), torch.from_numpy(w), out[:, 20:20 + n])
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(out[:, 20:20 + n].numpy(), expected, rtol=1e-5, atol=1e-4)
    assert (out[:, :20] == 7.0).all() and (out[:, 20 + n:] == 7.0).all()


def test_openblas_runs_one_thread_a_call(threads, monkeypatch):
    """Its own workers would spin after each call and slow the numba kernels that follow."""
    monkeypatch.setattr(cpu_gemm, "OPENBLAS", True)
    threads(2)
    x, w = torch.ones(8, 16), torch.ones(200, 16)
    out = torch.empty(8, 200)
    cpu_gemm.matmul_nt(x, w, out)
    assert (out == 16.0).all()
    openblas = ThreadpoolController().select(internal_api="openblas").info()
    assert openblas and all(library["num_threads"] == 1 for library in openblas)


def test_vendor_comes_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_gemm.cpu_vendor(cpuinfo) == "AuthenticAMD"
    assert cpu_gemm.cpu_vendor(tmp_path / "absent") == ""
    cpuinfo.write_text("processor\t: 0\n")
    assert cpu_gemm.cpu_vendor(cpuinfo) == ""
