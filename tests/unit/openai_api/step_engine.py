"""An engine stand-in that answers a batch one request at a time, each answer its own checkpoint part.

Between two requests it polls the run's stop condition, as the server engine does; a test
can act after each answer (:data:`AFTER_ANSWER`: ask for a cancel, move the clock on, fail
the try) and choose each request's HTTP status (:class:`StepEngine`'s ``statuses``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any, ClassVar

from airflow_vllm_batch.engines import Engine, EngineJob, EngineOptions, EngineResults
from airflow_vllm_batch.engines.base import EngineInfo, EngineRun
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, served_models

#: Called with the number of requests this try answered so far, after each answer is durable.
AFTER_ANSWER: Callable[[int], None] | None = None
#: How many times an engine was asked to produce.
PRODUCED: list[int] = []


@dataclasses.dataclass(kw_only=True)
class StepEngine(EngineOptions):
    """The stand-in's options.

    :param statuses: the HTTP status of each custom_id's answer (default 200).
    """

    engine_path: ClassVar[str] = f"{__name__}.StepEngineEngine"
    statuses: Mapping[str, int] = dataclasses.field(default_factory=dict)


class StepEngineEngine(Engine):
    name = "step"
    cost_basis = "vllm_connection"

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model)

    def inspect(self) -> EngineInfo:
        return EngineInfo(vllm_version="step-1", supported_urls=FALLBACK_SUPPORTED_URLS | {"/v1/embeddings"})

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        PRODUCED.append(1)
        staging = job.staging
        answered = set()
        for key in staging.list_parts():
            with staging.open_parts([key]) as lines:
                answered.update(json.loads(raw)["custom_id"] for raw in lines if raw.strip())
        token, done = uuid.uuid4().hex[:8], 0
        with job.request_lines() as lines:
            for raw in lines:
                custom_id = json.loads(raw)["custom_id"]
                if custom_id in answered:
                    continue
                job.raise_if_stopped()
                part = job.work / f"part-{len(staging.list_parts()):06d}.jsonl"
                part.write_bytes(_answer(custom_id, self.options.statuses.get(custom_id, 200)) + b"\n")
                staging.put_part(part, token)
                done += 1
                if AFTER_ANSWER is not None:
                    AFTER_ANSWER(done)
        job.raise_if_stopped()
        return EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=staging.open_parts,
            duplicates="first",
        )


def _answer(custom_id: str, status: int) -> bytes:
    if status == 200:
        body: Any = {
            "object": "chat.completion",
            "choices": [{"message": {"role": "assistant", "content": f"hi {custom_id}"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        error = None
    else:
        body = None
        error = {
            "object": "error",
            "message": f"{custom_id} refused ({status})",
            "type": "BadRequestError",
            "param": None,
            "code": status,
        }
    line = {
        "id": f"vllm-{custom_id}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"vllm-batch-{custom_id}", "body": body},
        "error": error,
    }
    return json.dumps(line).encode()
