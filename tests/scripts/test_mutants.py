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
    assert mutant.new != mutant.old and mutant.isa in ("", "avx2", "avx512", "vnni", "wide")
    assert all((MUTANTS.REPO / test).is_file() for test in mutant.tests)


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS.MUTANTS]
    assert len(names) == len(set(names))
