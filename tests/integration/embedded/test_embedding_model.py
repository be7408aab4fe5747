"""The bundled all-MiniLM-L6-v2: found on disk and served by vLLM (CPU) for /v1/embeddings.

Fresh processes: vLLM's own batch runner on the bundled embedding model is what is tested; the
runner is a process per batch and cannot be shared (one run for the module).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.embedded.engine import BatchRun, run_batch
from vllm_batch_embedded.tiny_model import embedding_model_path

DIMENSIONS = 384


def test_embedding_model_path_is_a_local_bert_checkpoint():
    path = embedding_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "bert"
    assert config["hidden_size"] == DIMENSIONS
    assert (path / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def embedding_run(tmp_path_factory: pytest.TempPathFactory) -> BatchRun:
    model = embedding_model_path()
    requests = [
        {
            "custom_id": "embed-one",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": str(model), "input": "The batch runs every night."},
        },
        {
            "custom_id": "embed-two",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": str(model), "input": ["Paris is in France.", "A week has seven days."]},
        },
    ]
    return run_batch(
        tmp_path_factory.mktemp("engine"), model, requests, "--runner", "pooling", max_model_len=256
    )


@pytest.mark.engine
def test_vllm_embeds_every_input_with_384_unit_vectors(embedding_run):
    assert embedding_run.returncode == 0, embedding_run.log[-5000:]
    by_id = {line["custom_id"]: line for line in embedding_run.results}
    assert sorted(by_id) == ["embed-one", "embed-two"]
    for custom_id, expected_vectors in (("embed-one", 1), ("embed-two", 2)):
        line = by_id[custom_id]
        assert line["response"]["status_code"] == 200
        data = line["response"]["body"]["data"]
        assert len(data) == expected_vectors
        for item in data:
            assert len(item["embedding"]) == DIMENSIONS
            # sentence-transformers' Normalize module is honoured: unit length.
            assert math.isclose(math.hypot(*item["embedding"]), 1.0, rel_tol=1e-3)
