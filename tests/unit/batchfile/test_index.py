from __future__ import annotations

from airflow_vllm_batch.batchfile.index import (
    CustomIdIndex,
    FirstN,
    hash_partitions,
    repeated_hashes,
)


def test_repeats_yield_repeat_and_first_line():
    index = CustomIdIndex()
    for line, cid in enumerate(["a", "b", "a", "c", "a"], start=1):
        index.add(cid, line)
    assert sorted(index.repeats()) == [(3, 1), (5, 1)]


def test_match_finds_missing_extra_and_repeat():
    wanted, got = CustomIdIndex(), CustomIdIndex()
    for line, cid in enumerate(["a", "b", "c"], start=1):
        wanted.add(cid, line)
    for line, cid in enumerate(["a", "x", "a", "c"], start=1):
        got.add(cid, line)
    assert sorted(wanted.match(got)) == [("extra", 2, 0), ("missing", 2, 0), ("repeat", 3, 1)]


def test_repeated_hashes_counts_occurrences():
    parts = hash_partitions()
    for cid in ["a", "b", "a", "a"]:
        h = hash(cid)
        parts[h & (len(parts) - 1)].append(h)
    assert repeated_hashes(parts) == {hash("a"): 3}


def test_first_n_keeps_smallest_and_counts_all():
    kept = FirstN(3)
    for n in [9, 1, 8, 2, 7, 3]:
        kept.add((n,))
    assert (kept.items(), kept.count) == ([(1,), (2,), (3,)], 6)


def test_line_of_finds_the_first_line_of_an_id_and_none_for_an_unknown_one():
    index = CustomIdIndex()
    for line, cid in enumerate(["a", "b", "a"] + [f"x{i}" for i in range(500)], start=1):
        index.add(cid, line)
    assert (index.line_of("a"), index.line_of("b"), index.line_of("x499"), index.line_of("zz")) == (
        1,
        2,
        503,
        None,
    )


def test_found_in_counts_each_answered_request_once_and_ignores_strangers():
    wanted, answered = CustomIdIndex(), CustomIdIndex()
    for line, cid in enumerate(["a", "b", "c", "d"], start=1):
        wanted.add(cid, line)
    # Two tries' checkpoints: "a" and "b" answered twice, "zz" is no request of the input.
    for line, cid in enumerate(["a", "b", "a", "b", "a", "zz"], start=1):
        answered.add(cid, line)
    assert wanted.found_in(answered) == 2
