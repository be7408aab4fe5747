"""A slice of the mutation campaign in the suite: every mutant still anchors, and the simulator catches a handful.

The whole campaign (every mutant, up to 2,000 schedules each, and the unit tests against
each) is ``benchmarks/mutate.py``; its figures are in docs/reliability.md. Each mutant here
runs in a subprocess on a mutated copy of the package (the worktree is never changed) and
must be caught within a few hundred schedules; together about a minute.
"""

from __future__ import annotations

import warnings

import pytest

from tests.simulation.mutation import MUTANTS, PACKAGE, REPO, Mutant, MutantNotAnchored, run_simulator

#: Caught in the campaign within the first tens of schedules, one per kind of bug: a condition dropped,
#: steps reordered, the lease rule broken, a count changed, a take-over going to an older try.
SLICE = {
    "manifest-if-match-dropped": 50,
    "staging-removed-before-manifest": 50,
    "staleness-inverted": 200,
    "duplicates-counted-twice": 300,
    "zombie-retakes-lease": 400,
    # Caught only since the cache may change between two tries (Plan.cache_expires): seed 44.
    "cache-hits-not-staged": 100,
    # The shard scenario's (split -> shards -> merge): a check skipped before the merge publishes.
    "merge-counts-unchecked": 100,
    "merge-missing-shard-unchecked": 300,
}


def test_every_mutant_snippet_is_in_its_module_exactly_once():
    # A snippet that no longer anchors would silently stop being a mutant: re-anchor it (tests/simulation/mutation.py).
    lost, moved = [], []
    for m in MUTANTS:
        try:
            path = m.locate(REPO)
        except MutantNotAnchored as err:
            lost.append(str(err).splitlines()[0])
            continue
        if path != REPO / PACKAGE / m.module:
            moved.append(f"{m.name}: {m.module} -> {path.relative_to(REPO / PACKAGE)}")
    # A module that moved still anchors (Mutant.locate finds the one file holding the snippet); say where, to re-point.
    assert not lost, (
        "re-anchor these mutants:\n"
        + "\n".join(lost)
        + ("\nmoved (re-point their module):\n" + "\n".join(moved) if moved else "")
    )
    if moved:
        warnings.warn("mutants whose module moved (re-point them): " + "; ".join(moved), stacklevel=1)


def test_a_mutant_whose_module_moved_is_found_in_the_one_file_holding_its_snippet(tmp_path):
    (tmp_path / PACKAGE / "storage").mkdir(parents=True)
    (tmp_path / PACKAGE / "storage" / "publishing.py").write_text("x = 1\nif ready:\n    go()\n")
    (tmp_path / PACKAGE / "other.py").write_text("y = 2\n")
    moved = Mutant("m", "storage.py", "a bug", "if ready:", "if True:")
    assert moved.apply(tmp_path) == tmp_path / PACKAGE / "storage" / "publishing.py"
    assert "if True:" in (tmp_path / PACKAGE / "storage" / "publishing.py").read_text()
    twice = Mutant("t", "storage.py", "a bug", "= ", "== ")
    with pytest.raises(MutantNotAnchored, match="exactly one file"):
        twice.apply(tmp_path)


@pytest.mark.parametrize("name", sorted(SLICE))
def test_the_simulator_catches_the_mutant(name):
    mutant = next(m for m in MUTANTS if m.name == name)
    found = run_simulator(mutant, SLICE[name])
    assert found["caught"], found
    assert found["checks"] != ["import-error"], found
