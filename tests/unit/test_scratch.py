"""The runs' own directory: ``age_out`` removes only the entries the runs make (No strangers, Bounded), and it is private to the worker's user."""

from __future__ import annotations

import errno
import os
import stat
import time

import pytest

from airflow_vllm_batch.engines.vllm.checks import write_options
from airflow_vllm_batch.exceptions import ConfigurationError, ScratchFullError
from airflow_vllm_batch.scratch import age_out, ensure_owned_dir, owned_dir, scratch


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


def test_the_runs_own_directory_is_made_private_to_the_workers_user(tmp_path):
    old_umask = os.umask(0o022)
    try:
        with scratch(str(tmp_path), "0123456789abcdef") as work:
            assert work.parent == owned_dir(str(tmp_path))
    finally:
        os.umask(old_umask)

    assert stat.S_IMODE(owned_dir(str(tmp_path)).stat().st_mode) == 0o700


def test_an_older_releases_world_readable_directory_is_made_private(tmp_path):
    root = owned_dir(str(tmp_path))
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)

    ensure_owned_dir(str(tmp_path))

    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_another_user_made_first_is_refused_and_left_as_it_is(tmp_path):
    root = owned_dir(str(tmp_path))
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    planted = root / "0123456789abcdef"
    planted.mkdir()
    os.chown(root, 4242, 4242)

    with (
        pytest.raises(ConfigurationError, match=r"results_dir: .*belongs to uid 4242") as err,
        scratch(str(tmp_path), "0123456789abcdef"),
    ):
        pass

    assert not err.value.retryable
    assert stat.S_IMODE(root.stat().st_mode) == 0o777
    assert planted.exists()


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    owned_dir(str(tmp_path)).symlink_to(elsewhere)

    with pytest.raises(ConfigurationError, match="is not a directory"):
        ensure_owned_dir(str(tmp_path))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_inside_a_tries_scratch_is_a_retryable_error_naming_the_directory(tmp_path, code):
    with pytest.raises(ScratchFullError) as raised, scratch(str(tmp_path), "0123456789abcdef"):
        # A write() on a full disk: its OSError names no file.
        raise OSError(code, os.strerror(code))
    message = str(raised.value)
    assert str(owned_dir(str(tmp_path))) in message
    assert os.strerror(code) in message
    assert "results_dir" in message
    assert raised.value.retryable
    assert [p.name for p in owned_dir(str(tmp_path)).iterdir()] == []  # the try's scratch is gone


def test_other_os_errors_in_a_tries_scratch_pass_through_unchanged(tmp_path):
    with pytest.raises(PermissionError), scratch(str(tmp_path), "0123456789abcdef"):
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere")
