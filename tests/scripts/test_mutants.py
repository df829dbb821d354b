"""scripts/mutants.py: every mutant still applies to the kernel source it names (an edit of a kernel that moves
a mutant's line would otherwise only show when someone next runs the mutants, as one did)."""
from __future__ import annotations

import pytest

from tests.support.scripts import load_script

MUTANTS = load_script("mutants")


@pytest.mark.parametrize("mutant", MUTANTS.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_edits_one_place_of_its_kernel(mutant):
    source = (MUTANTS.KERNELS / mutant.file).read_text()
    assert source.count(mutant.old) == 1, f"{mutant.old!r} occurs {source.count(mutant.old)} times in {mutant.file}"
    assert mutant.new != mutant.old and mutant.isa in ("", "avx2", "avx512", "vnni", "narrow-vnni", "wide")
    for test in mutant.tests:  # a file, or one test of it (file::name)
        path, _, name = test.partition("::")
        assert (MUTANTS.REPO / path).is_file()
        assert not name or f"def {name}(" in (MUTANTS.REPO / path).read_text()


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS.MUTANTS]
    assert len(names) == len(set(names))


def test_narrow_vnni_compiles_without_avx512_vnni():
    """Narrow VNNI's code (256-bit vpdpbusd), which a host with AVX512-VNNI no longer runs for any weight, is
    compiled for the host less AVX512-VNNI where it has AVX-VNNI, and nowhere else."""
    from llvmlite import binding

    from engine.model.kernel_cache import has_vnni
    features = binding.get_host_cpu_features().flatten()
    env = MUTANTS.isa_env("narrow-vnni")
    if not has_vnni(features.replace("+avx512vnni", "-avx512vnni")):
        assert env is None
        return
    assert "+avx512vnni" not in env["NUMBA_CPU_FEATURES"].split(",")
    assert has_vnni(env["NUMBA_CPU_FEATURES"])


def test_mutants_are_chosen_by_name_or_shell_pattern():
    chosen, unknown = MUTANTS.choose(["dequantize-*", "rotary-halves-swapped", "no-such-*"])
    assert [m.name for m in chosen] == ["rotary-halves-swapped", "dequantize-block-high-nibble-as-low",
                                        "dequantize-block-second-half-as-first", "dequantize-block-six-bit-lane-bytes"]
    assert unknown == ["no-such-*"]
    assert MUTANTS.choose([]) == (list(MUTANTS.MUTANTS), [])
