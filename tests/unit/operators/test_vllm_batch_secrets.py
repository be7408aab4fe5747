"""A secret in engine_args never reaches the task log, the identity, the manifest, XCom, S3 or an error (No secrets)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.exceptions import EngineError
from tests.http_inputs import BasicAuthInput
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI, chat_lines
from tests.unit.operators.test_vllm_batch_server import Batch as ServerBatch, requests_lines

#: The password of the http(s) input of the tests below (its user: ``reader``).
PASSWORD = "InputPassw0rd7"


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def _everything_in_s3(batch: Batch) -> str:
    return "\n".join(f"{key}\n{batch.get(key).decode()}" for key in batch.keys())


def test_an_hf_token_in_engine_args_is_in_no_log_line_manifest_xcom_or_object(batch, capfd, caplog):
    secret = "hf_SecretTokenForLogs1"
    ti = FakeTI()
    with caplog.at_level(logging.INFO):
        manifest = batch.run(
            ti,
            args=["--hf-token", secret],
            env={"FAKE_ENGINE_ECHO_ARGS": "1", "HF_TOKEN": "hf_EnvTokenForLogs1"},
        )
    out = capfd.readouterr()
    logged = out.out + out.err + caplog.text
    assert "Starting the vLLM engine" in logged
    assert "--hf-token ***" in logged
    assert "non-default args" in logged  # the engine's own line was relayed...
    for text in (logged, json.dumps(manifest), json.dumps(ti.xcoms, default=str), _everything_in_s3(batch)):
        assert secret not in text
        assert "hf_EnvTokenForLogs1" not in text
    assert manifest["identity"]["engine_args"] == ["--hf-token", "<secret>"]


def test_a_rotated_token_is_the_same_run(batch):
    first = batch.run(args=["--hf-token=hf_RotatedTokenOld1"])
    again = batch.run(args=["--hf-token=hf_RotatedTokenNew2"])
    assert again["fingerprint"] == first["fingerprint"]
    assert batch.engine_runs == 1  # the published output is returned: no engine for a new token


def test_an_engine_failure_message_quoting_the_token_masks_it(batch):
    secret = "hf_SecretTokenInError1"
    with pytest.raises(EngineError) as err:
        batch.run(args=["--hf-token", secret], env={"FAKE_ENGINE_ECHO_ARGS": "fail"})
    assert "unrecognized arguments: --hf-token ***" in str(err.value)
    assert secret not in str(err.value)


def test_a_rendered_secret_is_registered_with_the_masker_before_the_rendered_fields_are_stored():
    import jinja2

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from tests.airflow_compat import redact

    operator = VLLMBatchOperator(
        task_id="t",
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMRunner(args=["--hf-token", "{{ params.token }}"], env={"HF_TOKEN": "{{ params.token }}x"}),
    )
    operator.render_template_fields(
        {"params": {"token": "hf_RenderedTokenAbc1"}}, jinja_env=jinja2.Environment()
    )
    assert operator.engine.args == ["--hf-token", "hf_RenderedTokenAbc1"]
    assert redact(list(operator.engine.args)) == ["--hf-token", "***"]
    assert "hf_RenderedTokenAbc1" not in str(redact(dict(operator.engine.env)))
    # What the rendered-fields view stores: the engine's options, its secrets masked.
    from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

    shown = _serialize_rendered_fields(operator)
    assert shown["engine"]["engine"] == "VLLMRunner"
    assert shown["engine"]["args"] == ["--hf-token", "***"]
    assert "hf_RenderedTokenAbc1" not in json.dumps(shown)


def test_an_http_inputs_credentials_are_masked_when_rendered():
    import jinja2
    from airflow import __version__ as airflow_version

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from tests.airflow_compat import redact

    operator = VLLMBatchOperator(
        task_id="t",
        input_uri="{{ params.url }}",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMRunner(),
    )
    operator.render_template_fields(
        {"params": {"url": "https://reader:RenderedPw123@files.example/in.jsonl"}},
        jinja_env=jinja2.Environment(),
    )
    assert "RenderedPw123" not in str(redact(operator.input_uri))
    assert "RenderedPw123" not in str(redact("a log line quoting reader:RenderedPw123@files.example"))
    if not airflow_version.startswith("3.0."):  # Airflow 3.0 stores a rendered string unredacted
        from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

        assert "RenderedPw123" not in json.dumps(_serialize_rendered_fields(operator))


def test_a_malformed_http_input_fails_without_retry_naming_input_uri_and_no_password(batch, capfd, caplog):
    from airflow_vllm_batch.version_compat import AirflowFailException

    with pytest.raises(
        AirflowFailException, match=r"^input_uri: https://files.example/in.jsonl is not a URL"
    ) as err:
        batch.run(input_uri="https://reader:MalformedPw9@files.example:notaport/in.jsonl")
    out, errs = capfd.readouterr()
    assert "MalformedPw9" not in str(err.value) + out + errs + caplog.text
    assert batch.engine_runs == 0


@pytest.fixture
def started(monkeypatch) -> list[tuple[list[str], dict[str, str]]]:
    """The command line and environment of every engine process started (the runner's, through its hook)."""
    import airflow_vllm_batch.hooks.vllm as hook_module

    seen: list[tuple[list[str], dict[str, str]]] = []
    real = hook_module.start_bound_process

    def spy(argv, env=None, **kwargs):
        seen.append((list(argv), dict(env or {})))
        return real(argv, env=env, **kwargs)

    monkeypatch.setattr(hook_module, "start_bound_process", spy)
    return seen


@pytest.fixture
def runner_input() -> Iterator[BasicAuthInput]:
    with BasicAuthInput(chat_lines(3) + b"\n", PASSWORD) as served:  # a blank line: the copy has none
        yield served


def test_an_http_inputs_password_is_on_no_runner_command_line_environment_or_line_it_prints(
    batch, runner_input, started, capfd, caplog
):
    ti = FakeTI()
    with caplog.at_level(logging.INFO):
        manifest = batch.run(ti, input_uri=runner_input.url, env={"FAKE_ENGINE_ECHO_ARGS": "1"})
    out = capfd.readouterr()
    logged = out.out + out.err + caplog.text
    assert manifest["request_counts"]["completed"] == 3
    [(argv, env)] = started
    assert PASSWORD not in " ".join(argv)
    assert all(PASSWORD not in value for value in env.values())
    engine_input = argv[argv.index("-i") + 1]
    assert engine_input.startswith(str(batch.scratch_dir))
    assert engine_input.endswith("/input.jsonl")
    # vLLM's "Reading batch from ..." line, relayed: it names the task's copy, not the URL.
    assert f"Reading batch from {engine_input}" in logged
    # The task's own read (preflight); the engine read the copy.
    assert runner_input.reads == ["/batches/in.jsonl"]
    for text in (logged, json.dumps(manifest), json.dumps(ti.xcoms, default=str), _everything_in_s3(batch)):
        assert PASSWORD not in text


def test_an_http_input_with_only_a_query_is_withheld_too_and_one_without_credentials_is_not(tmp_path):
    from airflow_vllm_batch.identity import PinnedInput
    from airflow_vllm_batch.run.inputs import BatchInput

    def withheld(uri: str) -> bool:
        return BatchInput(None, None, PinnedInput(uri)).withheld  # type: ignore[arg-type]

    assert withheld("https://reader:pw@files.example/in.jsonl")
    assert withheld("https://reader@files.example/in.jsonl")
    assert withheld("https://b.s3.example/in.jsonl?X-Amz-Signature=abc")
    assert not withheld("https://files.example/in.jsonl")
    assert not withheld("s3://b/in.jsonl")
    assert not withheld(str(tmp_path / "in.jsonl"))


def test_the_runners_command_never_takes_an_input_url_with_credentials():
    from airflow_vllm_batch.engines.vllm.command import build_engine_argv

    with pytest.raises(ValueError, match="never given to the engine"):
        build_engine_argv(
            input_location=f"http://reader:{PASSWORD}@h/in.jsonl", output_location="o", model="m"
        )
    argv = build_engine_argv(
        input_location="https://h/in.jsonl?X-Amz-Signature=s", output_location="o", model="m"
    )
    assert argv[argv.index("-i") + 1] == "https://h/in.jsonl?X-Amz-Signature=s"  # a presigned GET: concealed


@pytest.fixture
def server_input() -> Iterator[BasicAuthInput]:
    from tests.unit.operators.test_vllm_batch_server import N

    with BasicAuthInput(requests_lines(N), PASSWORD) as served:
        yield served


def test_a_warm_server_batch_streams_the_tasks_copy_of_an_http_input_never_its_url(
    s3, bucket, tmp_path, server, server_input, capfd, caplog
):
    from tests.unit.operators.test_vllm_batch_server import N

    with caplog.at_level(logging.INFO):
        manifest = ServerBatch(s3, bucket, tmp_path).run(input_uri=server_input.url)
    out = capfd.readouterr()
    assert manifest["request_counts"]["completed"] == N
    assert server.requests == N
    assert server_input.reads == ["/batches/in.jsonl"]  # preflight's; the stream read the task's checked copy
    assert PASSWORD not in out.out + out.err + caplog.text + json.dumps(manifest)


def test_a_task_started_server_is_given_no_input_location():
    # It streams the requests itself (as the warm server above): its command line and environment are
    # the model, its args and its own key, whatever the input.
    from airflow_vllm_batch.engines import VLLMServer
    from airflow_vllm_batch.engines.server import ServerEngine
    from airflow_vllm_batch.engines.vllm.server_process import build_server_argv
    from airflow_vllm_batch.run.settings import BatchSettings

    settings = BatchSettings.from_rendered(
        input_uri=f"https://reader:{PASSWORD}@files.example/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMServer(args=["--max-model-len", "64"], env={"EXTRA": "1"}),
    )
    engine = ServerEngine(settings, logging.getLogger(__name__))
    arguments = engine.server_arguments()
    argv = build_server_argv("m", host="127.0.0.1", port=1, engine_args=arguments["engine_args"])
    assert PASSWORD not in json.dumps([argv, arguments], default=str)
    assert "files.example" not in json.dumps([argv, arguments], default=str)
