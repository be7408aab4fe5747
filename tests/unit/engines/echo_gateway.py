"""A third engine, in a module of its own: an "echo gateway" behind a connection of its own type, with its own options.

It answers every chat request with the connection's greeting and the request's last
message. Nothing in the operator, the settings, the run layer or preflight knows it: its
options class names it, and that is all the operator needs (see ``docs/contributing/architecture.md``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.engines import Engine, EngineJob, EngineOptions, EngineResults
from airflow_vllm_batch.engines.base import EngineInfo, EngineRun
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, served_models
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.version_compat import BaseHook

#: The connection type of the gateway.
CONN_TYPE = "echo_gateway"


class EchoGatewayHook(BaseHook):
    """The gateway's connection: its ``greeting`` extra."""

    conn_name_attr = "conn_id"
    default_conn_name = "echo_gateway_default"
    conn_type = CONN_TYPE
    hook_name = "Echo gateway"

    def __init__(self, conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.conn_id = conn_id

    def greeting(self) -> str:
        conn = self.get_connection(self.conn_id)
        if conn.conn_type != CONN_TYPE:
            raise ConfigurationError(
                f"connection {self.conn_id!r} is a {conn.conn_type!r} connection, not an {CONN_TYPE!r} one."
            )
        return conn.extra_dejson.get("greeting", "")


@dataclasses.dataclass(kw_only=True)
class EchoGateway(EngineOptions):
    """The gateway's options.

    :param conn_id: an ``echo_gateway`` connection. (templated)
    :param suffix: appended to every answer. (templated)
    :param max_words: the most words of a request echoed; None: all.
    """

    template_fields: ClassVar[Sequence[str]] = ("conn_id", "suffix", "gpu_hour_cost")
    engine_path: ClassVar[str] = f"{__name__}.EchoGatewayEngine"

    conn_id: str = EchoGatewayHook.default_conn_name
    suffix: str = ""
    max_words: int | None = None

    def check(self, values: Mapping[str, Any]) -> None:
        if self.max_words is not None and (not isinstance(self.max_words, int) or self.max_words < 1):
            raise ConfigurationError(
                f"max_words must be a whole number >= 1 or None, got {self.max_words!r}."
            )
        super().check(values)


class EchoGatewayEngine(Engine):
    """Answers through the run's staging like any engine: its results go up before the run checks them."""

    name = "echo-gateway"
    cost_basis = "vllm_connection"
    produced = 0

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model)

    def identity(self) -> dict[str, Any]:
        return {"engine": self.name, "suffix": self.options.suffix, "max_words": self.options.max_words}

    def inspect(self) -> EngineInfo:
        return EngineInfo(vllm_version="echo-1", supported_urls=FALLBACK_SUPPORTED_URLS)

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        type(self).produced += 1
        greeting = EchoGatewayHook(self.options.conn_id).greeting()
        path = job.work / "echo.jsonl"
        with job.request_lines() as lines, open(path, "w") as out:
            for raw in lines:
                request = json.loads(raw)
                words = request["body"]["messages"][-1]["content"].split()[: self.options.max_words]
                content = greeting + " ".join(words) + self.options.suffix
                body = {"choices": [{"message": {"role": "assistant", "content": content}}]}
                line = {
                    "id": "e",
                    "custom_id": request["custom_id"],
                    "response": {"status_code": 200, "request_id": "e", "body": body},
                    "error": None,
                }
                out.write(json.dumps(line) + "\n")
        job.lease.ensure_held(verify=True)
        job.staging.put_results(path)
        return EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=lambda: open_lines(str(path)),
            staged_results=True,
        )
