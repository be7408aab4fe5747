from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.engines.vllm.model_names import (
    LoraAdapter,
    ServedModels,
    check_adapters,
    cpu_lora_slots_problem,
    served_models,
    served_models_of_server,
)
from airflow_vllm_batch.exceptions import AdapterNotFoundError, EngineArgumentsError


@pytest.fixture
def adapter(tmp_path):
    path = tmp_path / "sql-lora"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return path


def test_without_options_the_model_is_the_only_name():
    assert served_models("/models/llama").names == ("/models/llama",)


@pytest.mark.parametrize(
    ("engine_args", "base"),
    [
        (["--served-model-name", "chat"], ("chat",)),
        (["--served-model-name", "a", "b", "--enforce-eager"], ("a", "b")),
        (["--served_model_name=x"], ("x",)),
    ],
)
def test_served_model_names_replace_the_path(engine_args, base):
    served = served_models("/models/llama", engine_args)
    assert served.base_names == base
    assert served.default_name == base[0]


def test_adapters_in_both_forms_are_names(adapter):
    as_json = json.dumps({"name": "chat", "path": str(adapter), "base_model_name": "llama"})
    served = served_models(
        "/m", ["--enable-lora", "--lora-modules", f"sql={adapter}", as_json, "--max-lora-rank", "8"]
    )
    assert served == ServedModels(
        base_names=("/m",),
        adapters=(LoraAdapter("sql", str(adapter)), LoraAdapter("chat", str(adapter), "llama")),
    )
    assert served.names == ("/m", "sql", "chat")


def test_adapters_without_enable_lora_fail_naming_the_fix(adapter):
    with pytest.raises(EngineArgumentsError, match="Add '--enable-lora'"):
        served_models("/m", ["--lora-modules", f"sql={adapter}"])


@pytest.mark.parametrize(
    "flag", ["--enable-lora=false", "--no-enable-lora", "--disable-lora", "--disable_lora"]
)
def test_enable_lora_switched_off_again_counts_as_off(adapter, flag):
    with pytest.raises(EngineArgumentsError, match="--enable-lora"):
        served_models("/m", ["--enable-lora", flag, "--lora-modules", f"sql={adapter}"])


@pytest.mark.parametrize("value", ["sql", '{"name": "sql"}', "{not json"])
def test_an_unreadable_adapter_entry_fails_with_both_forms(value):
    with pytest.raises(EngineArgumentsError, match="name=path"):
        served_models("/m", ["--enable-lora", "--lora-modules", value])


def test_an_adapter_named_like_the_model_fails():
    with pytest.raises(EngineArgumentsError, match="given twice"):
        served_models("/m", ["--enable-lora", "--served-model-name", "llama", "--lora-modules", "llama=/a"])


def test_an_adapter_directory_with_its_config_passes(adapter):
    check_adapters(served_models("/m", ["--enable-lora", "--lora-modules", f"sql={adapter}"]))


def test_a_missing_adapter_directory_fails_before_any_engine(tmp_path):
    with pytest.raises(AdapterNotFoundError, match=r"'sql'.*no such directory"):
        check_adapters(served_models("/m", ["--enable-lora", "--lora-modules", f"sql={tmp_path / 'nope'}"]))


def test_an_adapter_without_adapter_config_fails(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterNotFoundError, match=r"has no adapter_config.json"):
        check_adapters(served_models("/m", ["--enable-lora", "--lora-modules", f"sql={tmp_path}"]))


def test_a_hub_adapter_not_cached_fails_when_downloads_are_off(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    with pytest.raises(AdapterNotFoundError, match="downloads are off"):
        check_adapters(served_models("/m", ["--enable-lora", "--lora-modules", "sql=org/sql-lora"]), env)


def test_a_hub_adapter_is_left_to_the_engine_when_downloads_are_on(tmp_path):
    check_adapters(
        served_models("/m", ["--enable-lora", "--lora-modules", "sql=org/sql-lora"]),
        {"HF_HOME": str(tmp_path)},
    )


def test_a_cached_hub_adapter_is_checked_in_its_snapshot(tmp_path, adapter):
    repo = tmp_path / "hub" / "models--org--sql-lora"
    commit = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).mkdir()
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    served = served_models("/m", ["--enable-lora", "--lora-modules", "sql=org/sql-lora"])
    with pytest.raises(AdapterNotFoundError, match=r"has no adapter_config.json"):
        check_adapters(served, env)
    (repo / "snapshots" / commit / "adapter_config.json").write_text("{}")
    check_adapters(served, env)


def test_a_warm_servers_listing_gives_its_names_base_first():
    cards = [
        {"id": "llama", "root": "/models/llama", "parent": None},
        {"id": "llama-chat", "root": "/models/llama", "parent": None},
        {"id": "sql", "root": "/adapters/sql", "parent": "llama"},
    ]
    served = served_models_of_server(cards, "llama-chat")
    assert served.base_names == ("llama", "llama-chat")
    assert served.default_name == "llama"
    assert served.names == ("llama", "llama-chat", "sql")


def test_a_model_the_listing_lacks_stays_a_name():
    assert served_models_of_server([], "m").names == ("m",)


CPU_LORA = ["--enable-lora", "--lora-modules", "a=/a", "b=/b"]


@pytest.mark.parametrize(
    ("extra", "requests", "problem"),
    [
        ([], {"m": 1, "a": 1}, "at least 2"),
        (["--max-loras", "2"], {"m": 1, "a": 1, "b": 1}, "at least 3"),
        (["--max-loras", "3"], {"m": 1, "a": 1, "b": 1}, None),
        (["--max_loras=2"], {"m": 1, "a": 1}, None),
        ([], {"a": 1, "b": 1}, None),  # no base-model line
        ([], {"m": 3}, None),  # no adapter line
    ],
)
def test_cpu_lora_slots_need_one_more_than_the_adapters_a_mixed_batch_uses(extra, requests, problem):
    found = cpu_lora_slots_problem(served_models("m", CPU_LORA + extra), CPU_LORA + extra, requests)
    assert (
        (found is None)
        if problem is None
        else (problem in found and '"LoRA on a CPU" in the docs\' Troubleshooting page' in found)
    )


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ("0.32.0", True),
        ("0.32.1", True),
        (None, True),
        ("0.33.0", False),
        ("0.33.1", False),
        ("0.34.0rc1", False),
    ],
)
def test_the_cpu_lora_slots_workaround_stops_at_the_vllm_release_that_fixes_it(version, affected):
    """vLLM 0.33's CPU LoRA ops mask the base model's rows (tests/unit/engines/vllm/test_vllm_releases.py reads the fix)."""
    found = cpu_lora_slots_problem(served_models("m", CPU_LORA), CPU_LORA, {"m": 1, "a": 1}, version)
    assert (found is not None) is affected
