"""Served names and LoRA adapters through the real batch runner: one engine, the base model and two adapters in one batch.

The adapters are built here (rank 8, PEFT layout, random A and B weights: see
:mod:`vllm_batch_embedded.tiny_lora`); nothing is downloaded.

vLLM 0.32 on CPU (its torch LoRA ops) reads a base-model row's adapter index -1 as "the
last adapter slot": with ``--max-loras`` equal to the number of adapters, base-model lines
batched with adapter lines are answered *through the last adapter*. One slot more than
the adapters keeps the last slot empty, and base lines are answered by the base model;
hence ``--max-loras 3`` for two adapters (see the README).

Fresh processes: the runner with LoRA flags of its own (``--enable-lora``, ``--max-loras``), the
task's child; the fail-fast tests check that no engine starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from airflow_vllm_batch.batchfile import Text
from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.storage import read_answers
from tests.integration.test_operator import _keys, _run_operator
from vllm_batch_embedded.demo import BUCKET
from vllm_batch_embedded.tiny_lora import build_tiny_lora_adapter

pytestmark = pytest.mark.integration

PROMPTS = ["tell me about the river", "what does the scheduler do", "a small cat in a quiet city"]
NAMES = ("tiny", "sql", "poem")  # the base model's served name, then the two adapters


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": build_tiny_lora_adapter(root / "sql", seed=1),
        "poem": build_tiny_lora_adapter(root / "poem", seed=2),
    }


def lora_args(adapters: dict[str, Path], *more: str) -> list[str]:
    as_json = json.dumps({"name": "poem", "path": str(adapters["poem"]), "base_model_name": "tiny"})
    return [
        "--enforce-eager", "--max-model-len", "512", "--served-model-name", "tiny",
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "3",
        "--lora-modules", f"sql={adapters['sql']}", as_json, *more,
    ]  # fmt: skip


def test_adapter_files_are_peft_rank_8(adapters):
    from safetensors import safe_open

    config = json.loads((adapters["sql"] / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"]) == ("LORA", 8)
    with safe_open(adapters["sql"] / "adapter_model.safetensors", "pt") as weights:
        a = weights.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        b = weights.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    assert tuple(a.shape) == (8, 128)
    assert tuple(b.shape) == (128, 8)
    assert b.abs().sum() > 0


@pytest.mark.engine
def test_one_batch_alternating_base_and_two_adapters_answers_each_through_its_own_weights(
    embedded, airflow_db, tiny_model, adapters
):
    requests = [
        {"id": f"{name}-{i}", "model": name, "messages": [{"role": "user", "content": prompt}]}
        for i, prompt in enumerate(PROMPTS)
        for name in NAMES
    ]
    result = _run_operator(
        "lora",
        requests=requests,
        requests_custom_id="id",
        output_uri=f"s3://{BUCKET}/lora/results.jsonl",
        model=str(tiny_model),
        default_body={"temperature": 0, "max_completion_tokens": 8},
        engine=VLLMRunner(args=lora_args(adapters)),
    )
    assert result.state == "success", result.output[-5000:]
    manifest = result.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 9, "completed": 9, "failed": 0}
    per_model = manifest["per_model"]
    assert {name: (c["requests"], c["completed"]) for name, c in per_model.items()} == dict.fromkeys(
        NAMES, (3, 3)
    )
    assert sum(c["total_tokens"] for c in per_model.values()) == manifest["usage"]["total_tokens"]

    answers = dict(read_answers(manifest))
    assert all(isinstance(a, str) for a in answers.values())
    assert len(answers) == 9
    for i in range(len(PROMPTS)):
        base, sql, poem = (answers[f"{name}-{i}"] for name in NAMES)
        assert sql != base, (i, base, sql, poem)
        assert poem != base, (i, base, sql, poem)
        assert sql != poem, (i, base, sql, poem)
    responses = {r.custom_id for r in read_answers(manifest) if isinstance(r, Text)}
    assert responses == set(answers)


@pytest.mark.parametrize(
    ("case", "names", "extra", "expected"),
    [
        (
            "path",
            ("tiny", "{model}"),
            (),
            "which the engine does not serve — use one of: 'tiny', 'poem', 'sql'",
        ),
        ("no_config", ("tiny",), ("--lora-modules", "sql={empty}"), "has no adapter_config.json"),
    ],
)
def test_a_wrong_name_or_adapter_fails_in_seconds_before_any_engine(
    embedded, airflow_db, tiny_model, adapters, tmp_path, case, names, extra, expected
):
    empty = tmp_path / "empty-adapter"
    empty.mkdir()
    model = str(tiny_model)
    requests = [
        {"model": name.format(model=model), "messages": [{"role": "user", "content": "hi"}]} for name in names
    ]
    args = lora_args(adapters)
    if extra:
        args = args[: args.index("--lora-modules")] + [a.format(empty=empty) for a in extra]
    started = time.monotonic()
    result = _run_operator(
        f"lora_{case}",
        requests=requests,
        output_uri=f"s3://{BUCKET}/lora-{case}/results.jsonl",
        model=model,
        engine=VLLMRunner(args=args),
    )
    assert result.state == "failed"
    assert expected in result.output
    assert "Starting the vLLM engine" not in result.output
    assert time.monotonic() - started < 60
    assert all(key.startswith("results.requests/") for key in _keys(embedded, f"lora-{case}/"))


def test_on_cpu_a_mixed_batch_with_every_lora_slot_taken_fails_before_any_engine(
    embedded, airflow_db, tiny_model, adapters
):
    # With --max-loras 2 this batch ran and its base-model lines came back answered by
    # the "poem" adapter (identical texts): the operator refuses it instead.
    args = lora_args(adapters)
    args[args.index("--max-loras") + 1] = "2"
    requests = [{"model": name, "messages": [{"role": "user", "content": "hi"}]} for name in NAMES]
    result = _run_operator(
        "lora_slots",
        requests=requests,
        output_uri=f"s3://{BUCKET}/lora-slots/results.jsonl",
        model=str(tiny_model),
        engine=VLLMRunner(args=args),
    )
    assert result.state == "failed"
    assert "Set --max-loras to at least 3" in result.output
    assert "Starting the vLLM engine" not in result.output
