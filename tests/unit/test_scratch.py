"""What ``age_out`` removes from the runs' own directory: only the entries the runs make (invariant: No strangers, Bounded)."""

from __future__ import annotations

import os
import time

from airflow_vllm_batch.engines.vllm.checks import write_options
from airflow_vllm_batch.scratch import age_out


def test_age_out_removes_old_run_try_and_engine_options_entries_and_nothing_else(tmp_path):
    old = time.time() - 3600
    run = tmp_path / "0123456789abcdef"
    attempt = tmp_path / "0123456789abcdef-try-3"
    options = tmp_path / "engine-options-fedcba9876543210.json"
    half_written = tmp_path / "engine-options-fedcba9876543210.json.4242.tmp"
    users = [tmp_path / "notes.txt", tmp_path / "engine-options-mine.json", tmp_path / "models"]
    for directory in (run, attempt, users[2]):
        directory.mkdir()
    for path in (options, half_written, users[0], users[1]):
        path.write_text("x")
    for path in (run, attempt, options, half_written, *users):
        os.utime(path, (old, old))
    fresh = tmp_path / "engine-options-0000000000000000.json"
    write_options(fresh, {"options": ["--model"], "help": "vllm serve --help"})

    age_out(tmp_path, max_age_s=60)

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, *(p.name for p in users)])
