"""A slice of the mutation campaign in the suite: every mutant still anchors, and the simulator catches a handful.

The whole campaign (every mutant, up to 2,000 schedules each, and the unit tests against
each) is ``benchmarks/mutate.py``; its figures are in docs/reliability.md. Each mutant here
runs in a subprocess on a mutated copy of the package (the worktree is never changed) and
must be caught within a few hundred schedules; together about a minute.
"""

from __future__ import annotations

import pytest

from tests.simulation.mutation import MUTANTS, PACKAGE, REPO, run_simulator

#: Caught in the campaign within the first tens of schedules, one per kind of bug: a condition dropped,
#: steps reordered, the lease rule broken, a count changed, a take-over going to an older try.
SLICE = {
    "manifest-if-match-dropped": 50,
    "staging-removed-before-manifest": 50,
    "staleness-inverted": 200,
    "duplicates-counted-twice": 300,
    "zombie-retakes-lease": 400,
}


def test_every_mutant_snippet_is_in_its_module_exactly_once():
    # A snippet that no longer anchors would silently stop being a mutant: re-anchor it (tests/simulation/mutation.py).
    lost = [
        m.name for m in MUTANTS if (REPO / PACKAGE / m.module).read_text(encoding="utf-8").count(m.old) != 1
    ]
    assert not lost, f"re-anchor these mutants: {lost}"


@pytest.mark.parametrize("name", sorted(SLICE))
def test_the_simulator_catches_the_mutant(name):
    mutant = next(m for m in MUTANTS if m.name == name)
    found = run_simulator(mutant, SLICE[name])
    assert found["caught"], found
    assert found["checks"] != ["import-error"], found
