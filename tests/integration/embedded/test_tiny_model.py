"""The tiny chat model: built once, loadable by transformers, and served by vLLM (CPU).

Fresh processes: vLLM's own batch runner on the tiny model is what is tested; the runner is a
process per batch and cannot be shared (one run for the module).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.embedded.engine import BatchRun, run_batch
from vllm_batch_embedded import tiny_model
from vllm_batch_embedded.tiny_model import STAMP_FILE, build_tiny_chat_model

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_writes_a_llama_checkpoint_with_head_size_32(built):
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 2, 4)
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    assert (config["vocab_size"], config["max_position_embeddings"]) == (1024, 2048)
    files = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in (*files, STAMP_FILE):
        assert (built / name).is_file(), name


def test_generation_config_names_the_tokenizers_eos(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")


def test_second_build_returns_at_once_without_rewriting(built):
    before = (built / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert build_tiny_chat_model(built) == built
    assert time.monotonic() - started < 1.0
    assert (built / "model.safetensors").stat().st_mtime_ns == before


def test_build_is_deterministic(built, tmp_path):
    again = build_tiny_chat_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(built / name), name


def test_build_replaces_an_empty_existing_directory(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    assert (build_tiny_chat_model(target) / STAMP_FILE).is_file()


def test_build_from_an_older_recipe_is_rebuilt(tmp_path, monkeypatch):
    target = build_tiny_chat_model(tmp_path / "tiny")
    monkeypatch.setattr(tiny_model, "RECIPE_VERSION", tiny_model.RECIPE_VERSION + 1)
    build_tiny_chat_model(target)
    stamp = json.loads((target / STAMP_FILE).read_text())
    assert stamp["recipe_version"] == tiny_model.RECIPE_VERSION
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_build_refuses_a_directory_holding_something_else(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete tiny model"):
        build_tiny_chat_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_failed_build_leaves_no_half_model(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_model, "_write_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tiny_chat_model(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_chat_template_renders_roles_and_generation_prompt(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is the capital of France?</s>\n<|assistant|>\n"
    )
    without_prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert not without_prompt.endswith("<|assistant|>\n")


@pytest.mark.parametrize("text", ["plain English text", "ünïcödé and 🚀 emoji", "tabs\tand\nnewlines  ", ""])
def test_tokenizer_round_trips_any_text(built, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert max(ids, default=0) < 1024
    assert tokenizer.decode(ids) == text


def test_role_markers_are_single_special_tokens(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    for marker in ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker


def test_cli_builds_and_prints_the_path(tmp_path):
    target = tmp_path / "cli-model"
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_batch_embedded.tiny_model", str(target)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert completed.stdout.strip() == str(target)
    assert (target / STAMP_FILE).is_file()


# -- the real proof: vLLM serves it --------------------------------------------------


@pytest.fixture(scope="module")
def chat_run(built, tmp_path_factory: pytest.TempPathFactory) -> BatchRun:
    requests = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": str(built), "messages": MESSAGES, "max_tokens": 8},
        }
        for i in range(2)
    ]
    return run_batch(tmp_path_factory.mktemp("engine"), built, requests)


@pytest.mark.engine
def test_vllm_answers_every_chat_request_with_status_200(chat_run):
    assert chat_run.returncode == 0, chat_run.log[-5000:]
    assert sorted(line["custom_id"] for line in chat_run.results) == ["chat-0", "chat-1"]
    assert {line["response"]["status_code"] for line in chat_run.results} == {200}
    assert all(line["error"] is None for line in chat_run.results)


@pytest.mark.engine
def test_vllm_generates_tokens_for_the_tiny_model(chat_run):
    for line in chat_run.results:
        body = line["response"]["body"]
        assert body["usage"]["completion_tokens"] > 0
        assert body["choices"][0]["message"]["role"] == "assistant"
