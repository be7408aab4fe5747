"""Unit tests of the engine checks: engine_args against vLLM's real parser, and the model's files.

No engine starts. The argument cases share one run of the check script (importing vLLM's
parser is the slow part, about 8 s); one test runs :func:`check_engine_args` end to end.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.vllm.checks import (
    EngineArgsCheckError,
    EngineArgumentsError,
    IncompleteModelError,
    ModelInfo,
    ModelNotFoundError,
    argv_to_check,
    check_engine_args,
    inspect_model,
    raise_for_result,
    run_argcheck_script,
)
from vllm_batch_embedded.tiny_model import (
    build_tiny_chat_model,
    embedding_model_path,
)

# Runs vLLM's own argument parsers and model loaders in this Python.
pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[4]
RUNNER_HELP = "'python -m vllm.entrypoints.launchers.run_batch --help'"

#: (engine_args, fragments the one-line message must hold) for arguments vLLM refuses.
REFUSED_RUNNER_ARGS = {
    "max-model-len-not-a-number": (
        ["--max-model-len", "abc"],
        ["argument --max-model-len", "'abc'"],
    ),
    "unknown-flag": (["--max-model-lenght", "4096"], ["unrecognized arguments: --max-model-lenght 4096"]),
    "tensor-parallel-size-not-a-number": (
        ["--tensor-parallel-size", "x"],
        ["argument --tensor-parallel-size", "invalid int value: 'x'"],
    ),
    "stray-value": (["--enforce-eager", "true"], ["unrecognized arguments: true"]),
    "bad-choice": (["--runner", "embed"], ["argument --runner", "invalid choice: 'embed'"]),
    "task-removed": (["--task", "embed"], ["unrecognized arguments: --task embed", "use --runner pooling"]),
    # The server's own flag: accepted by the api_server parser (tests/unit/engines/test_local.py), not the runner's.
    "server-only-flag": (
        ["--enforce-eager", "--uvicorn-log-level", "warning"],
        ["unrecognized arguments: --uvicorn-log-level warning"],
    ),
}
ACCEPTED_RUNNER_ARGS = {
    "none": [],
    "typical": ["--max-model-len", "4k", "--dtype", "bfloat16", "--enforce-eager", "-tp", "1"],
    "pooling": ["--runner", "pooling", "--convert", "embed", "--served-model-name", "a", "b"],
    "underscores-and-dotted": ["--max_model_len=512", "--compilation-config.mode", "0"],
}
REFUSED_SERVER_ARGS = {
    # (--port, --host, --api-key and --uds are refused before vLLM's parser: the task sets them.)
    "log-level-not-a-choice": (
        ["--uvicorn-log-level", "loud"],
        ["argument --uvicorn-log-level", "'loud'"],
        "'vllm serve --help'",
    ),
    "auto-tool-choice-alone": (
        ["--enable-auto-tool-choice"],
        ["--enable-auto-tool-choice requires --tool-call-parser"],
        "'vllm serve --help'",
    ),
}


@pytest.fixture(scope="module")
def argcheck_results() -> dict[str, dict]:
    """Every argument case, checked by the real vLLM parser in one run of the check script."""
    cases = {f"run_batch/{k}": ("run_batch", v[0]) for k, v in REFUSED_RUNNER_ARGS.items()}
    cases |= {f"run_batch/{k}": ("run_batch", v) for k, v in ACCEPTED_RUNNER_ARGS.items()}
    cases |= {f"api_server/{k}": ("api_server", v[0]) for k, v in REFUSED_SERVER_ARGS.items()}
    checks = [{"entrypoint": ep, "argv": argv_to_check("m", args, ep)} for ep, args in cases.values()]
    results = run_argcheck_script(sys.executable, {"checks": checks}, timeout=300)["results"]
    return dict(zip(cases, results))


@pytest.mark.parametrize("case", REFUSED_RUNNER_ARGS)
def test_runner_args_refused_by_vllm_name_the_argument_and_the_fix(argcheck_results, case):
    _, fragments = REFUSED_RUNNER_ARGS[case]
    with pytest.raises(EngineArgumentsError) as err:
        raise_for_result(argcheck_results[f"run_batch/{case}"], sys.executable)
    message = str(err.value)
    assert message.startswith("VLLMRunner(args=...): ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    assert message.endswith(f"Fix args (see {RUNNER_HELP}).")


@pytest.mark.parametrize("case", ACCEPTED_RUNNER_ARGS)
def test_runner_args_vllm_accepts_pass(argcheck_results, case):
    assert argcheck_results[f"run_batch/{case}"]["ok"], argcheck_results[f"run_batch/{case}"]
    raise_for_result(argcheck_results[f"run_batch/{case}"], sys.executable)


@pytest.mark.parametrize("case", REFUSED_SERVER_ARGS)
def test_server_args_refused_by_vllm_name_the_argument_and_the_fix(argcheck_results, case):
    _, fragments, help_cmd = REFUSED_SERVER_ARGS[case]
    with pytest.raises(EngineArgumentsError) as err:
        raise_for_result(argcheck_results[f"api_server/{case}"], sys.executable)
    message = str(err.value)
    assert message.startswith("VLLMServer(args=...): ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    assert message.endswith(f"Fix args (see {help_cmd}).")


def test_check_engine_args_runs_the_engine_pythons_parser():
    expected = r"^VLLMRunner\(args=\.\.\.\): argument --max-model-len: .*'abc'\. Fix args"
    with pytest.raises(EngineArgumentsError, match=expected):
        check_engine_args(sys.executable, "m", ["--max-model-len", "abc"])


@pytest.mark.parametrize(
    ("engine_args", "fragments"),
    [
        ("--max-model-len 4096", ["expected a list of strings", "'--max-model-len 4096'", "shlex.split"]),
        (["--max-model-len", 4096], ["args[1]", "expected a string, found int 4096", "'4096'"]),
        (["-i", "other.jsonl"], ["-i is not allowed", "the operator sets the input itself"]),
        (["--output_file=x"], ["--output_file is not allowed", "the operator sets the output itself"]),
        (["--model", "other"], ["--model is not allowed", "set model= instead"]),
    ],
    ids=["one-string", "not-a-string", "input", "output", "model"],
)
def test_malformed_engine_args_fail_without_running_the_engine_python(engine_args, fragments):
    with pytest.raises(EngineArgumentsError) as err:
        check_engine_args("/nonexistent/python", "m", engine_args)
    assert str(err.value).startswith("VLLMRunner(args=...): ")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_engine_python_without_vllm_says_to_install_it():
    base_python = str(Path(sys.base_prefix) / "bin" / "python3")  # the venv's base interpreter: no vLLM
    expected = r"^VLLMRunner\(args=\.\.\.\): cannot load vLLM's argument parser .*Install vllm.* set VLLMRunner\(python=\.\.\.\)"
    with pytest.raises(EngineArgsCheckError, match=expected):
        check_engine_args(base_python, "m", [])


def test_missing_engine_python_names_the_options_python():
    expected = r"cannot run the engine environment's Python .*Set VLLMRunner\(python=\.\.\.\)"
    with pytest.raises(EngineArgsCheckError, match=expected) as err:
        check_engine_args("/nonexistent/python", "m", [])
    assert not err.value.retryable


def test_slow_check_is_a_retryable_timeout():
    with pytest.raises(EngineArgsCheckError, match="took more than") as err:
        check_engine_args(sys.executable, "m", [], timeout=0.05)
    assert err.value.retryable


def test_a_check_killed_by_a_signal_is_retryable(tmp_path):
    # The chaos campaign's task_kill (seed 2) met the probe beside it: a SIGKILLed check is no
    # verdict on the arguments, and a terminal error there failed the task with retries left.
    killed = tmp_path / "python"
    killed.write_text("#!/bin/sh\nkill -9 $$\n")
    killed.chmod(0o755)
    with pytest.raises(EngineArgsCheckError, match="was killed by signal 9") as err:
        check_engine_args(str(killed), "m", [])
    assert err.value.retryable


# --- the model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny chat model, built once into the repo's cache (shared with ``make demo``)."""
    return build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    """A copy of the tiny model that a test may break."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def test_tiny_chat_model_generates(tiny_model):
    info = inspect_model(str(tiny_model), ["--max-model-len", "512"])
    assert info == ModelInfo(
        model=str(tiny_model),
        kind="generate",
        kind_source="config.json architectures ['LlamaForCausalLM']",
        served_names=[str(tiny_model)],
        local_path=tiny_model,
        architectures=["LlamaForCausalLM"],
    )


def test_sentence_transformers_minilm_pools():
    info = inspect_model(str(embedding_model_path()), [])
    assert info.kind == "pooling"
    assert "modules.json" in info.kind_source


@pytest.mark.parametrize(
    ("engine_args", "kind", "source"),
    [
        (["--runner", "pooling"], "pooling", "--runner pooling"),
        (["--runner=pooling", "--convert", "embed"], "pooling", "--runner pooling"),
        (["--convert", "classify"], "pooling", "--convert classify"),
        (["--task", "embed"], "pooling", "--task embed"),
        (["--runner", "auto"], "generate", "config.json architectures ['LlamaForCausalLM']"),
    ],
)
def test_runner_and_convert_override_the_architecture(tiny_model, engine_args, kind, source):
    info = inspect_model(str(tiny_model), engine_args)
    assert (info.kind, info.kind_source) == (kind, source)


def test_generate_runner_overrides_a_pooling_model():
    assert inspect_model(str(embedding_model_path()), ["--runner", "generate"]).kind == "generate"


@pytest.mark.parametrize(
    ("engine_args", "served"),
    [
        ([], None),
        (["--served-model-name", "chat"], ["chat"]),
        (["--served-model-name", "a", "b", "--enforce-eager"], ["a", "b"]),
        (["--served_model_name=x"], ["x"]),
    ],
)
def test_served_names_are_served_model_name_else_the_model(tiny_model, engine_args, served):
    assert inspect_model(str(tiny_model), engine_args).served_names == (served or [str(tiny_model)])


@pytest.mark.parametrize(
    ("architectures", "kind"),
    [
        (["MistralForCausalLM"], "generate"),
        (["Qwen2VLForConditionalGeneration"], "generate"),
        (["GPT2LMHeadModel"], "generate"),
        (["ChatGLMModel"], "generate"),
        (["BertModel"], "pooling"),
        (["XLMRobertaForSequenceClassification"], "pooling"),
        (["BertForMaskedLM"], "pooling"),
        (["Qwen2ForRewardModel"], "pooling"),
        (["SomethingNew"], "generate"),
    ],
)
def test_kind_follows_vllms_architecture_rule(model_copy, architectures, kind):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(config | {"architectures": architectures}))
    assert inspect_model(str(model_copy), []).kind == kind


@pytest.mark.parametrize(
    "model", ["/nonexistent/models/llama", "./no-such-model", "../no-such-model", "a/b/c"]
)
def test_missing_local_model_names_model_and_path(model):
    with pytest.raises(ModelNotFoundError) as err:
        inspect_model(model, [])
    message = str(err.value)
    assert message.startswith(f"model: the local model directory {model!r}")
    assert "does not exist" in message
    assert "Give model= an existing model directory" in message


@pytest.mark.parametrize(
    ("remove", "engine_args", "missing"),
    [
        (["config.json"], [], "no config.json"),
        (["model.safetensors"], [], "no weights"),
        (["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"], [], "no tokenizer files"),
        (["config.json", "model.safetensors"], [], "no config.json, no weights"),
    ],
    ids=["config", "weights", "tokenizer", "config-and-weights"],
)
def test_directory_without_model_files_says_what_is_missing(model_copy, remove, engine_args, missing):
    for name in remove:
        (model_copy / name).unlink()
    with pytest.raises(IncompleteModelError) as err:
        inspect_model(str(model_copy), engine_args)
    message = str(err.value)
    assert message.startswith(
        f"model: the directory {str(model_copy)!r} does not look like a model: {missing}"
    )
    assert "Give model= the directory that holds the downloaded model" in message


@pytest.mark.parametrize(
    ("remove", "engine_args"),
    [
        (["model.safetensors"], ["--load-format", "dummy"]),
        (["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"], ["--tokenizer", "org/tok"]),
        (["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"], ["--skip-tokenizer-init"]),
    ],
    ids=["dummy-weights", "other-tokenizer", "no-tokenizer"],
)
def test_files_the_engine_args_make_unneeded_are_not_required(model_copy, remove, engine_args):
    for name in remove:
        (model_copy / name).unlink()
    assert inspect_model(str(model_copy), engine_args).kind == "generate"


def test_a_file_is_not_a_model_directory(tiny_model):
    with pytest.raises(
        IncompleteModelError, match=r"model: .*config\.json' is a file, not a model directory"
    ):
        inspect_model(str(tiny_model / "config.json"), [])


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_uncached_hub_model_fails_when_downloads_are_off(tmp_path, variable):
    env = {variable: "1", "HF_HOME": str(tmp_path)}
    with pytest.raises(ModelNotFoundError) as err:
        inspect_model("org/not-cached", [], env=env)
    message = str(err.value)
    assert message.startswith("model: 'org/not-cached' is not in the local Hugging Face cache")
    assert str(tmp_path / "hub") in message
    assert "downloads are off" in message
    assert "hf download org/not-cached" in message


def test_uncached_hub_model_is_left_to_the_engine_when_downloads_are_on(tmp_path):
    info = inspect_model("org/not-cached", [], env={"HF_HOME": str(tmp_path)})
    assert (info.kind, info.local_path) == (None, None)


def test_cached_hub_model_is_read_from_its_snapshot(tiny_model, tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    info = inspect_model("org/tiny", ["--served-model-name", "tiny"], env=env)
    assert (info.kind, info.local_path, info.served_names) == (
        "generate",
        repo / "snapshots" / commit,
        ["tiny"],
    )


def test_check_engine_args_reads_vllms_offline_defaults_for_the_engines_device_and_world_size():
    """On this CPU vLLM's offline row is 256 sequences and 4096 tokens per rank of tensor x pipeline parallel."""
    defaults = check_engine_args(sys.executable, "m", ["--enforce-eager"], offline_defaults_for=2)
    assert defaults is not None
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.device) == (512, 8192, "cpu")
