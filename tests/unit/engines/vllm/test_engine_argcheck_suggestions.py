"""A misspelled engine flag gets "did you mean": the closest flag vLLM's own parser knows."""

from __future__ import annotations

import argparse
import sys

import pytest

from airflow_vllm_batch.engines.vllm.argcheck import _did_you_mean
from airflow_vllm_batch.engines.vllm.checks import (
    EngineArgumentsError,
    argv_to_check,
    raise_for_result,
    run_argcheck_script,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for flag in ("--max-model-len", "--max-num-seqs", "--tensor-parallel-size", "--enforce-eager"):
        parser.add_argument(flag)
    return parser


@pytest.mark.parametrize(
    ("message", "suggested"),
    [
        (
            "unrecognized arguments: --max-modle-len 4096",
            "(did you mean --max-model-len for --max-modle-len?)",
        ),
        ("unrecognized arguments: --max_num_seq=8", "(did you mean --max-num-seqs for --max_num_seq?)"),
        (
            "unrecognized arguments: --tensor-paralel-size 2 --enforce-eagre",
            "(did you mean --tensor-parallel-size for --tensor-paralel-size, --enforce-eager for --enforce-eagre?)",
        ),
    ],
)
def test_a_misspelled_flag_is_told_the_closest_known_one(message, suggested):
    assert _did_you_mean(message, _parser()) == f"{message} {suggested}"


@pytest.mark.parametrize(
    "message",
    [
        "unrecognized arguments: --quantum-mode on",
        "unrecognized arguments: true",
        "argument --max-model-len: invalid int value: 'x'",
    ],
)
def test_nothing_close_or_no_unknown_flag_gets_no_guess(message):
    assert _did_you_mean(message, _parser()) == message


@pytest.mark.vllm
def test_vllms_own_parser_suggests_the_flag_for_a_misspelling():
    checks = [
        {"entrypoint": "run_batch", "argv": argv_to_check("m", ["--max-modle-len", "4096"], "run_batch")}
    ]
    (result,) = run_argcheck_script(sys.executable, {"checks": checks}, timeout=300)["results"]
    with pytest.raises(
        EngineArgumentsError,
        match=r"unrecognized arguments: --max-modle-len 4096 \(did you mean --max-model-len for --max-modle-len\?\)",
    ):
        raise_for_result(result, sys.executable)


def test_a_misspelled_flag_is_refused_at_once_from_the_flags_an_earlier_check_saw(tmp_path):
    import json
    import time

    from airflow_vllm_batch.engines.vllm.checks import check_engine_args

    options = tmp_path / "engine-options.json"
    options.write_text(
        json.dumps(
            {"options": ["--max-model-len", "--enforce-eager", "--compilation-config"], "help": "vllm --help"}
        )
    )
    started = time.monotonic()
    # No engine Python is run: this one does not even exist.
    with pytest.raises(
        EngineArgumentsError,
        match=r"unrecognized arguments: --max-modle-len \(did you mean --max-model-len for --max-modle-len\?\)",
    ):
        check_engine_args("/nonexistent/python", "m", ["--max-modle-len", "64"], options_file=options)
    assert time.monotonic() - started < 1


@pytest.mark.parametrize(
    "args", [["--max_model_len", "64"], ["--compilation-config.level=3"], ["--max-model", "64"], ["-O3"]]
)
def test_flags_vllms_parser_reads_are_left_to_the_full_check(tmp_path, args):
    import json

    from airflow_vllm_batch.engines.vllm.checks import check_engine_args
    from airflow_vllm_batch.exceptions import EngineArgsCheckError

    options = tmp_path / "engine-options.json"
    options.write_text(
        json.dumps(
            {"options": ["--max-model-len", "--enforce-eager", "--compilation-config"], "help": "vllm --help"}
        )
    )
    # Not refused from the file: the full check runs (and fails here, for want of a Python).
    with pytest.raises(EngineArgsCheckError, match="cannot run the engine environment's Python"):
        check_engine_args("/nonexistent/python", "m", args, options_file=options)


@pytest.mark.vllm
def test_a_check_keeps_the_flags_vllms_parser_knows_and_the_next_misspelling_needs_no_import(tmp_path):
    import time

    from airflow_vllm_batch.engines.vllm.checks import check_engine_args

    options = tmp_path / "engine-options.json"
    check_engine_args(sys.executable, "m", ["--enforce-eager"], options_file=options)
    started = time.monotonic()
    with pytest.raises(EngineArgumentsError, match=r"did you mean --max-model-len for --max-modle-len\?"):
        check_engine_args(sys.executable, "m", ["--max-modle-len", "64"], options_file=options)
    assert time.monotonic() - started < 1
