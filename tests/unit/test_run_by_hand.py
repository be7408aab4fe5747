"""Every command and JSON object of ``docs/run-by-hand.md`` works as written (issue 28).

The S3 commands are run as the page gives them (in a scratch directory, ``python`` being
this venv's) and S3 is reached through the connection they export; the JSON objects
parse and are what the hooks read; the vLLM command lines are parsed by vLLM's own
server parser; the DAG, task, environment variables and log lines the page names exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "run-by-hand.md"
#: The installed package (the wheel, on the floor: its tests run in a clone without the package).
PACKAGE = Path(__import__("airflow_vllm_batch").__file__).parent
STRUCTURED = ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


def _commands() -> list[str]:
    """Every shell command of the page, continuation lines joined."""
    return [
        line for block in _blocks("bash") for line in block.replace("\\\n", " ").splitlines() if line.strip()
    ]


def _json_objects() -> list[dict]:
    return [json.loads(block) for block in _blocks("json")]


def test_the_page_is_in_the_docs_index_and_linked_from_the_readme():
    assert re.search(r"^run-by-hand$", (REPO / "docs" / "index.md").read_text(), re.M)
    assert "(docs/run-by-hand.md)" in (REPO / "README.md").read_text()


def test_every_json_object_on_the_page_parses_as_a_connection():
    conn_types = [obj["conn_type"] for obj in _json_objects()]
    assert conn_types == ["aws", "vllm"]
    exported = [c for c in _commands() if c.startswith("export AIRFLOW_CONN_") and "'" in c]
    assert exported
    for command in exported:
        (assignment,) = shlex.split(command.removeprefix("export "))
        assert json.loads(assignment.partition("=")[2])["conn_type"]


def test_the_aws_connection_json_has_sigv4_and_path_addressing():
    aws = _json_objects()[0]
    assert aws["extra"]["config_kwargs"] == {"signature_version": "s3v4", "s3": {"addressing_style": "path"}}
    assert set(aws) == {"conn_type", "login", "password", "extra"}
    assert set(aws["extra"]) == {"endpoint_url", "region_name", "config_kwargs"}


def test_the_vllm_connection_json_is_read_by_the_hook(monkeypatch):
    from airflow_vllm_batch.hooks.vllm import VLLMServerHook

    monkeypatch.setenv("AIRFLOW_CONN_VLLM_DEFAULT", json.dumps(_json_objects()[1]))
    hook = VLLMServerHook()
    assert hook.base_url == "http://127.0.0.1:8000"
    assert hook.api_key == "change-me"
    assert hook.max_in_flight == 256


def test_the_local_s3_commands_start_s3_that_the_exported_connection_reaches(tmp_path):
    s3 = [c for c in _commands() if "vllm_batch_embedded.seaweedfs" in c]
    assert [c.split()[3] if c.startswith("python") else "connection" for c in s3] == [
        "start",
        "connection",
        "stop",
    ]
    check = (
        'python -c "from airflow.providers.amazon.aws.hooks.s3 import S3Hook; '
        "hook = S3Hook(); assert hook.check_for_bucket('vllm-batch'); "
        "hook.load_string('hi', 'probe.txt', bucket_name='vllm-batch'); print('S3 OK', hook.read_key('probe.txt', 'vllm-batch'))\""
    )
    script = (
        "set -e\n" + "\n".join([s3[0], s3[1], 'echo "CONN=$AIRFLOW_CONN_AWS_DEFAULT"', check, s3[2]]) + "\n"
    )
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
    }
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "S3 OK hi" in done.stdout
    (exported,) = [
        json.loads(line.removeprefix("CONN="))
        for line in done.stdout.splitlines()
        if line.startswith("CONN=")
    ]
    documented = _json_objects()[0]
    assert set(exported) == set(documented)
    assert set(exported["extra"]) == set(documented["extra"])
    assert exported["extra"]["config_kwargs"] == documented["extra"]["config_kwargs"]
    assert exported["extra"]["region_name"] == documented["extra"]["region_name"]
    assert "stopped" in done.stdout
    assert not (tmp_path / ".cache" / "s3.json").exists()


def _server_argv(command: str) -> list[str]:
    """The arguments vLLM's server parser gets from one of the page's server command lines."""
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value prefixes
        words.pop(0)
    if words[:2] == ["vllm", "serve"]:
        return ["--model", words[2], *words[3:]]
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], command
    return words[3:]


@pytest.mark.vllm
def test_the_warm_server_command_lines_parse_with_vllms_own_server_parser():
    from airflow_vllm_batch.engines.vllm.checks import run_argcheck_script

    servers = [c for c in _commands() if "api_server" in c or c.startswith("vllm serve")]
    assert len(servers) == 2  # CPU and GPU
    argvs = [_server_argv(c) for c in servers]
    for argv in argvs:
        assert argv[argv.index(STRUCTURED[0]) + 1] == STRUCTURED[1]
    results = run_argcheck_script(
        sys.executable,
        {"checks": [{"entrypoint": "api_server", "argv": argv} for argv in argvs]},
        timeout=300,
    )["results"]
    assert [r["ok"] for r in results] == [True, True], results


def test_the_airflow_commands_name_a_real_dag_and_task_and_parse():
    from airflow.cli import cli_parser

    from tests.integration.dagrun import load_dag

    airflow = [shlex.split(c) for c in _commands() if c.startswith("airflow ")]
    assert ["airflow", "tasks", "test", "vllm_batch_pipeline", "vllm_batch", "<run_id>"] in airflow
    dag = load_dag("vllm_batch_pipeline.py", "pipeline_dag")
    parser = cli_parser.get_parser()
    for words in airflow:
        args = parser.parse_args(words[1:])
        if getattr(args, "dag_id", None) is not None:
            assert args.dag_id == dag.dag_id
        if getattr(args, "task_id", None) is not None:
            assert args.task_id in dag.task_dict


def test_the_settings_and_log_lines_the_page_names_exist():
    examples = (REPO / "dags" / "vllm_batch_examples.py").read_text()
    for name in re.findall(r"\bAIRFLOW_VLLM_BATCH_[A-Z_]+", PAGE.read_text()):
        assert name in examples, name
    assert "(reused: no engine ran in this try)" in (PACKAGE / "summary.py").read_text()
    assert "Resuming from %d checkpoint part(s)" in (PACKAGE / "engines" / "server.py").read_text()
    assert (REPO / ".cache" / "models").name  # the tiny model's place is the one demo.py builds
    from vllm_batch_embedded import demo

    assert "tiny-llama-chat" in Path(demo.__file__).read_text()


def test_the_readme_links_every_reference_page_make_docs_builds():
    index = (REPO / "docs" / "index.md").read_text()
    pages = re.findall(r"^(reference/\w+)$", index, re.M)
    assert len(pages) >= 3
    readme = (REPO / "README.md").read_text()
    for page in pages:
        source = next((REPO / "docs").glob(page.removeprefix("reference/").join(["reference/", ".*"])))
        assert f"({source.relative_to(REPO)})" in readme, page
        assert f"build/docs/html/{page}.html" in readme or f"{Path(page).name}.html" in readme, page
