"""Each engine's options: a typed, templated object the operator takes as ``engine=``.

::

    VLLMBatchOperator(..., engine=VLLMRunner(args=["--max-model-len", "4096"]))        # the default
    VLLMBatchOperator(..., engine=VLLMServer(args=[...], checkpoint_interval=timedelta(minutes=2)))
    VLLMBatchOperator(..., engine=WarmVLLMServer(conn_id="vllm_qwen", max_in_flight=1024))

Why an object per engine rather than operator arguments: a user of one engine meets only
its knobs (the runner has no in-flight bound; a warm server has neither engine arguments
nor GPUs, which are not the task's to set); a knob another engine would ignore cannot be
written at all; and another engine brings its own options class (a subclass of
:class:`EngineOptions` naming its :class:`~airflow_vllm_batch.engines.base.Engine`) with
no new operator argument, setting or check in the run layer. Why three classes rather
than one server class with an optional connection: a server the task starts and a warm
one share the streaming knobs but not the others (``args``, ``python``, ``gpus``,
``startup_timeout`` mean nothing for a warm server).

Templating: Airflow renders, in place, the attributes an object lists in
``template_fields`` when the object is the value of an operator's templated field; the
operator lists ``engine``. :meth:`EngineOptions.serialize` is what the rendered-fields
view shows. Durations are a ``datetime.timedelta`` or a number of seconds, as Airflow's own.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from airflow_vllm_batch.exceptions import ConfigurationError

if TYPE_CHECKING:
    from typing_extensions import Self


class EngineClass(Protocol):
    """What the options need of their engine's class (an ``engines.base.Engine`` subclass).

    A protocol, not the class: the engines import their options, so naming ``Engine`` here,
    even for the type checker, would close an import cycle (tests/unit/test_layering.py).
    """

    def check_settings(self, options: EngineOptions, values: Mapping[str, Any], /) -> None: ...
    def __call__(self, settings: Any, log: Any, /) -> object: ...


#: Seconds between SIGTERM and SIGKILL when an engine this task started is stopped.
DEFAULT_KILL_GRACE = timedelta(seconds=4)
#: How long a server this task starts may take to be ready.
DEFAULT_STARTUP_TIMEOUT = timedelta(minutes=15)
#: How long one request to a server may take, its retries included.
DEFAULT_REQUEST_TIMEOUT = timedelta(minutes=30)
#: How often a server engine seals its answers into a checkpoint part.
DEFAULT_CHECKPOINT_INTERVAL = timedelta(seconds=60)
#: How long the batch runner may make no progress before it is stopped and the try fails (retryable): long
#: enough for one long generation of a big model on a busy GPU (as long as a server's request_timeout), short
#: enough that a wedged engine frees its GPUs hours before a typical execution_timeout would.
DEFAULT_STALL_TIMEOUT = timedelta(minutes=30)
#: Airflow config section and option of the stall bound's default (AIRFLOW__VLLM_BATCH__STALL_TIMEOUT).
STALL_TIMEOUT_CONFIG = ("vllm_batch", "stall_timeout")

_OUTPUT_MODES = ("local", "presigned")


def check_gpu_hour_cost(value: Any) -> float | None:
    """
    Return ``gpu_hour_cost`` as a float, or ``None`` when it is not set.

    A rendered template gives a string (``"2.5"``); an empty one means "not set".

    :param value: the rendered ``gpu_hour_cost``.
    :raises ConfigurationError: it is not a finite number >= 0.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        price = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        price = math.nan
    if not math.isfinite(price) or price < 0:
        raise ConfigurationError(
            f"gpu_hour_cost must be a number >= 0 (the price of one GPU-hour, e.g. 2.5), got {value!r} after rendering. "
            "Leave it out (None) to report GPU-seconds without a cost."
        )
    return price


def seconds_of(name: str, value: Any, *, minimum: float = 0.0, allow_zero: bool = False) -> float:
    """A duration given as a ``timedelta`` or a number of seconds (Airflow's style), in seconds.

    :raises ConfigurationError: naming ``name`` when it is not a duration > 0 (>= 0 with ``allow_zero``).
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        seconds = math.nan
    if not (seconds >= minimum if allow_zero else seconds > minimum):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(
            f"{name} must be a datetime.timedelta or a number of seconds {bound}, e.g. timedelta(minutes=30), got {value!r}."
        )
    return seconds


def configured_stall_timeout() -> float:
    """The stall bound in seconds from Airflow config ``[vllm_batch] stall_timeout`` (0: none), else the default.

    :raises ConfigurationError: naming the option when it is not a number of seconds >= 0.
    """
    from airflow_vllm_batch.version_compat import conf

    section, option = STALL_TIMEOUT_CONFIG
    raw = conf.get(section, option, fallback=None)
    if raw is None or not str(raw).strip():
        return DEFAULT_STALL_TIMEOUT.total_seconds()
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(
            f"Airflow config [{section}] {option} must be a number of seconds >= 0 (0: no stall bound), got {raw!r}. "
            f"Fix it in airflow.cfg or AIRFLOW__{section.upper()}__{option.upper()}, e.g. 1800."
        )
    return seconds


#: How a Jinja template opens (spelt apart so that no scan of the source takes it for one).
_TEMPLATE_OPENING = "{" + "{"


def _templated(value: Any) -> bool:
    """A string holding a template: checked once rendered, not at DAG parse time."""
    return isinstance(value, str) and _TEMPLATE_OPENING in value


def _strings(name: str, value: Any, example: str) -> None:
    if value is not None and (isinstance(value, str) or not all(isinstance(a, str) for a in value)):
        raise ConfigurationError(f"{name} must be a list of strings, e.g. {example}, got {value!r}.")


def _whole(name: str, value: Any, *, minimum: int, why: str = "") -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise ConfigurationError(f"{name} must be a whole number >= {minimum} or None{why}, got {value!r}.")


@dataclasses.dataclass(kw_only=True)
class EngineOptions:
    """What one engine is told; the base of every engine's options (``engine=`` of the operator).

    A subclass names its engine (:attr:`engine_path`), lists its templated fields in
    ``template_fields`` and checks itself (:meth:`check` at DAG parse time, :meth:`rendered`
    when the task starts). The run layer asks it nothing else: what the engine does with it
    is the engine's.

    :param gpu_hour_cost: the price of one hour of what the engine runs on (a GPU the task
        leases; a server-hour for a warm server), a number >= 0: the manifest's ``cost`` then
        holds the run's cost. Default None: GPU-seconds only. (templated)
    """

    template_fields: ClassVar[Sequence[str]] = ("gpu_hour_cost",)

    gpu_hour_cost: float | str | None = None

    #: The dotted path of the :class:`~airflow_vllm_batch.engines.base.Engine` subclass these
    #: options are for. A path, not the class: engines pull in process and HTTP machinery (only
    #: the engine a task uses is imported), and the interface (``engines.base``) reads these
    #: options, so importing the engines here would close an import cycle.
    engine_path: ClassVar[str] = ""

    def engine_class(self) -> EngineClass:
        """The :class:`~airflow_vllm_batch.engines.base.Engine` subclass these options are for (:attr:`engine_path`)."""
        if not self.engine_path:
            raise NotImplementedError(
                f"{type(self).__name__} names no engine: set engine_path (or define engine_class())."
            )
        module, _, name = self.engine_path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    @property
    def label(self) -> str:
        """How messages name this engine, e.g. ``VLLMRunner()``."""
        return f"{type(self).__name__}()"

    def check(self, values: Mapping[str, Any]) -> None:
        """Refuse, at DAG parse time, options this engine cannot use (a templated value is checked once rendered).

        :param values: the operator's other settings (``supported_urls``, ``output_type``...), for checks across them.
        """
        if not isinstance(self.gpu_hour_cost, str):
            check_gpu_hour_cost(self.gpu_hour_cost)
        self.engine_class().check_settings(self, values)

    def rendered(self) -> Self:
        """A checked copy of the rendered options, coerced (a Param's ``"2.5"`` becomes 2.5)."""
        return dataclasses.replace(self, gpu_hour_cost=check_gpu_hour_cost(self.gpu_hour_cost))

    def mask_secrets(self) -> None:
        """Register the secrets among the options with Airflow's masker (as soon as they are rendered)."""

    def serialize(self) -> dict[str, Any]:
        """The options as the rendered-fields view shows them, the engine's secrets masked.

        Masked here, not left to Airflow: Airflow 3.0 stores what an object's ``serialize()``
        returns as it is (3.1+ redacts it afterwards).
        """
        from airflow_vllm_batch.redaction import redact_secrets

        def shown(value: Any) -> Any:
            if isinstance(value, timedelta):
                return str(value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                return shown(dataclasses.asdict(value))
            if isinstance(value, str):
                return redact_secrets(value)
            if isinstance(value, Mapping):
                return {k: shown(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [shown(v) for v in value]
            return value

        return {
            "engine": type(self).__name__,
            **{f.name: shown(getattr(self, f.name)) for f in dataclasses.fields(self)},
        }


@dataclasses.dataclass(kw_only=True)
class _LocalVLLM(EngineOptions):
    """What an engine this task starts on its worker takes: vLLM's arguments, its Python, environment and GPUs."""

    template_fields: ClassVar[Sequence[str]] = ("args", "python", "env", "gpu_hour_cost")

    args: Sequence[str] = ()
    python: str | None = None
    env: Mapping[str, str] | None = None
    gpus: int | None = None
    kill_grace: timedelta | float = DEFAULT_KILL_GRACE

    def check(self, values: Mapping[str, Any]) -> None:
        if not _templated(self.args):
            _strings("args", self.args, "['--max-model-len', '4096']")
        if self.env is not None and not isinstance(self.env, (Mapping, str)):
            raise ConfigurationError(f"env must be a mapping, got {type(self.env).__name__} {self.env!r}.")
        _whole("gpus", self.gpus, minimum=0)
        seconds_of("kill_grace", self.kill_grace, allow_zero=True)
        super().check(values)

    def rendered(self) -> Self:
        _strings("args", self.args, "['--max-model-len', '4096']")
        if self.env is not None and not isinstance(self.env, Mapping):
            raise ConfigurationError(
                f"env must be a mapping, got {type(self.env).__name__} {self.env!r} after rendering."
            )
        return dataclasses.replace(
            super().rendered(),
            args=tuple(self.args or ()),
            env={k: str(v) for k, v in (self.env or {}).items()},
        )

    def mask_secrets(self) -> None:
        from airflow_vllm_batch.redaction import register_engine_secrets

        if isinstance(self.args, (list, tuple)) and isinstance(self.env or {}, Mapping):
            register_engine_secrets([a for a in self.args if isinstance(a, str)], self.env)

    @property
    def kill_grace_s(self) -> float:
        return seconds_of("kill_grace", self.kill_grace, allow_zero=True)


@dataclasses.dataclass(kw_only=True)
class VLLMRunner(_LocalVLLM):
    """vLLM's offline batch runner on this worker, bound to the task (the default engine).

    :param args: more arguments of ``run_batch`` (``--max-model-len``, ``--tensor-parallel-size``...),
        checked by its own parser before it starts. (templated)
    :param python: the Python of the environment that has vLLM. Default: this task's. (templated)
    :param command: a command prefix replacing ``<python> -m <runner>``, e.g. a container's. (templated)
    :param env: environment variables added for the engine; not in the run identity. (templated)
    :param gpus: GPUs the engine leases on the worker. Default: what the parallel sizes in
        ``args`` need (none on a CPU worker); 0: no lease.
    :param kill_grace: time between SIGTERM and SIGKILL when stopping the engine, a
        ``timedelta`` or seconds. Default 4 seconds.
    :param output_mode: ``"local"`` (default) or ``"presigned"`` (the runner PUTs its output to a
        presigned staging URL: for engines without this worker's disk or AWS credentials).
    :param presign_expires_in: how long the presigned URLs stay valid, a ``timedelta`` or seconds.
        Default: ``execution_timeout`` plus 15 minutes, or 24 hours; at most 7 days.
    :param stall_timeout: how long the runner may make no progress (no new line in its output, no
        higher count in its progress report, no other log line) before it is stopped (SIGTERM, then
        SIGKILL: its GPUs are freed) and the try fails as retryable, keeping the answers it wrote; a
        ``timedelta`` or seconds, 0 for no bound. Default None: Airflow config ``[vllm_batch]
        stall_timeout`` (seconds), else 30 minutes, as long as one long generation of a big model may
        take. **Bounded**: a wedged engine (a hung ``EngineCore``, an NCCL hang) holds the GPUs at most
        this long, not until ``execution_timeout``. Raise it when one request may take longer.
    :param gpu_hour_cost: see :class:`EngineOptions`. (templated)
    """

    template_fields: ClassVar[Sequence[str]] = ("args", "python", "command", "env", "gpu_hour_cost")
    engine_path: ClassVar[str] = "airflow_vllm_batch.engines.runner.RunnerEngine"

    command: Sequence[str] | None = None
    output_mode: str = "local"
    presign_expires_in: timedelta | int | None = None
    stall_timeout: timedelta | float | None = None

    def check(self, values: Mapping[str, Any]) -> None:
        if self.output_mode not in _OUTPUT_MODES:
            raise ConfigurationError(f"output_mode must be one of {_OUTPUT_MODES}, got {self.output_mode!r}.")
        if not _templated(self.command):
            _strings(
                "command",
                self.command,
                "['docker', 'exec', 'vllm', 'python', '-m', 'vllm.entrypoints.openai.run_batch']",
            )
        presign = self.presign_expires_in
        # Seconds, as amazon's S3Hook.generate_presigned_url takes them; or a timedelta, as Airflow's durations.
        if (
            presign is not None
            and not isinstance(presign, timedelta)
            and (not isinstance(presign, int) or isinstance(presign, bool) or presign < 1)
        ):
            raise ConfigurationError(
                "presign_expires_in must be a datetime.timedelta or a positive whole number of seconds, e.g. "
                f"timedelta(hours=6), got {presign!r}."
            )
        if self.stall_timeout is not None:
            seconds_of("stall_timeout", self.stall_timeout, allow_zero=True)
        super().check(values)

    def rendered(self) -> Self:
        _strings(
            "command",
            self.command,
            "['docker', 'exec', 'vllm', 'python', '-m', 'vllm.entrypoints.openai.run_batch']",
        )
        rendered = super().rendered()
        assert isinstance(rendered, VLLMRunner)
        stall = (
            configured_stall_timeout()
            if self.stall_timeout is None
            else seconds_of("stall_timeout", self.stall_timeout, allow_zero=True)
        )
        return dataclasses.replace(
            rendered, command=tuple(self.command) if self.command else None, stall_timeout=stall
        )

    @property
    def stall_timeout_s(self) -> float | None:
        """The stall bound in seconds, None when there is none (0); the config's when the options left it unset."""
        seconds = (
            configured_stall_timeout()
            if self.stall_timeout is None
            else seconds_of("stall_timeout", self.stall_timeout, allow_zero=True)
        )
        return seconds or None


@dataclasses.dataclass(kw_only=True)
class _Streaming(EngineOptions):
    """What both server engines take: how the task streams the requests and checkpoints the answers."""

    max_in_flight: int | None = None
    checkpoint_interval: timedelta | float = DEFAULT_CHECKPOINT_INTERVAL
    client_processes: int = 1
    request_timeout: timedelta | float = DEFAULT_REQUEST_TIMEOUT

    def check(self, values: Mapping[str, Any]) -> None:
        _whole("max_in_flight", self.max_in_flight, minimum=1)
        if (
            not isinstance(self.client_processes, int)
            or isinstance(self.client_processes, bool)
            or self.client_processes < 1
        ):
            raise ConfigurationError(
                f"client_processes must be a positive whole number (1 unless the server answers more than one client "
                f"core sends, ~3,400 requests/s), got {self.client_processes!r}."
            )
        seconds_of("checkpoint_interval", self.checkpoint_interval)
        seconds_of("request_timeout", self.request_timeout)
        super().check(values)

    @property
    def checkpoint_interval_s(self) -> float:
        return seconds_of("checkpoint_interval", self.checkpoint_interval)

    @property
    def request_timeout_s(self) -> float:
        return seconds_of("request_timeout", self.request_timeout)


@dataclasses.dataclass(kw_only=True)
class VLLMServer(_Streaming, _LocalVLLM):
    """vLLM's OpenAI-compatible server, started by the task on its worker for the batch and stopped when it ends.

    The task streams the requests to it with bounded in-flight and checkpoints the answers
    to S3 as it goes: a retry on any worker sends only what no checkpoint answers (a try
    killed before its first checkpoint resumes nothing).

    :param args: more arguments of the server (``--max-model-len``...), checked by its own parser. (templated)
    :param python: the Python of the environment that has vLLM. Default: this task's. (templated)
    :param env: environment variables added for the server; not in the run identity. (templated)
    :param gpus: GPUs the server leases on the worker. Default: what ``args`` need; 0: no lease.
    :param kill_grace: time between SIGTERM and SIGKILL when stopping it. Default 4 seconds.
    :param startup_timeout: how long the server may take to be ready, a ``timedelta`` or seconds;
        then the try fails (retryable) and the server is stopped. Default 15 minutes.
    :param max_in_flight: requests sent and not yet answered. Default: twice what the server's
        scheduler takes at once (2 x its ``--max-num-seqs`` x its ``--data-parallel-size``).
    :param checkpoint_interval: time between checkpoints, a ``timedelta`` or seconds. Default 60 seconds.
    :param client_processes: processes the client spreads the requests over (one core sends ~3,400/s). Default 1.
    :param request_timeout: how long one request may take, its retries included; a request still
        unanswered then is set aside (sent again by the task's retry), and a server that answered
        no request for that long ends the try. Default 30 minutes. **Bounded**: a try never waits
        on a silent server longer than ``startup_timeout`` + ``request_timeout`` (plus ``kill_grace``).
    :param gpu_hour_cost: see :class:`EngineOptions`. (templated)
    """

    template_fields: ClassVar[Sequence[str]] = ("args", "python", "env", "gpu_hour_cost")
    engine_path: ClassVar[str] = "airflow_vllm_batch.engines.server.ServerEngine"

    startup_timeout: timedelta | float = DEFAULT_STARTUP_TIMEOUT

    def check(self, values: Mapping[str, Any]) -> None:
        seconds_of("startup_timeout", self.startup_timeout)
        super().check(values)

    @property
    def startup_timeout_s(self) -> float:
        return seconds_of("startup_timeout", self.startup_timeout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class YieldToInteractive:
    """How a batch on a warm server shared with interactive users gives way to them (``WarmVLLMServer(yield_to_interactive=...)``).

    The batch's requests carry a low ``priority`` when the server runs ``--scheduling-policy
    priority``, and the requests it keeps in flight follow the load the server reports (its
    ``/metrics``, and 429/503 answers): fewer when interactive requests queue, more when they
    do not, between ``min_in_flight`` and ``max_in_flight``. See ``docs/gpu-workers.md``.

    :param priority_scheduling: whether the server runs ``--scheduling-policy priority``. Default
        None: what the server says (its ``/server_info``, served only in vLLM's dev mode), else the
        connection's ``scheduling_policy`` extra, else no priority is sent (only the bound gives way).
        A server that says it runs another policy is never sent a priority, whatever this says.
    :param priority: the priority of the batch's requests, > 0 (vLLM serves lower values first;
        interactive requests carry 0 unless they set one). Default 10.
    :param min_in_flight: the fewest requests the batch keeps in flight, whatever the server
        reports (so it always progresses); at most ``max_in_flight``. Default 4.
    :param metrics_urls: the ``/metrics`` URLs of every server behind the connection's endpoint
        (a load-balanced deployment: one per replica). Default: the connection's own ``/metrics``,
        which behind a load balancer is whichever replica answers each read.
    """

    priority_scheduling: bool | None = None
    priority: int = 10
    min_in_flight: int = 4
    metrics_urls: Sequence[str] = ()

    def check(self) -> None:
        """Refuse values that cannot work, naming the parameter."""
        if self.priority_scheduling not in (None, True, False):
            raise ConfigurationError(
                f"YieldToInteractive(priority_scheduling=...) must be True, False or None (ask the server), got {self.priority_scheduling!r}."
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or self.priority < 1:
            raise ConfigurationError(
                f"YieldToInteractive(priority=...) must be a whole number >= 1 (vLLM serves lower values first and "
                f"interactive requests carry 0), got {self.priority!r}."
            )
        _whole("YieldToInteractive(min_in_flight=...)", self.min_in_flight, minimum=1)
        if self.min_in_flight is None:
            raise ConfigurationError(
                "YieldToInteractive(min_in_flight=...) must be a whole number >= 1, got None."
            )
        urls = self.metrics_urls
        if isinstance(urls, str) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls
        ):
            raise ConfigurationError(
                "YieldToInteractive(metrics_urls=...) must be a list of http(s) URLs, e.g. "
                f"['http://vllm-0:8000/metrics', 'http://vllm-1:8000/metrics'], got {urls!r}."
            )


@dataclasses.dataclass(kw_only=True)
class WarmVLLMServer(_Streaming):
    """A running vLLM server (or a load-balanced deployment) behind a ``vllm`` connection: nothing is started.

    Its arguments and GPUs are not the task's to know or set: the run identity holds the
    model and the vLLM version its ``/version`` reports, not its URL, so moving the
    connection to another replica of the same deployment keeps resuming.

    :param conn_id: the ``vllm`` connection (host, port, schema, the API key as password; the
        ``max_in_flight`` extra). Default ``vllm_default``. (templated)
    :param max_in_flight: requests sent and not yet answered. Default: the connection's
        ``max_in_flight`` extra, else 512.
    :param checkpoint_interval: time between checkpoints, a ``timedelta`` or seconds. Default 60 seconds.
    :param client_processes: processes the client spreads the requests over. Default 1.
    :param request_timeout: how long one request may take, its retries included. Default 30 minutes.
    :param gpu_hour_cost: the price of one hour of the server's time (it may serve other tasks
        meanwhile: the manifest's note says so). (templated)
    :param yield_to_interactive: share the server with interactive users: True, or a
        :class:`YieldToInteractive` to tune it. The batch's requests carry a low priority (on a
        server that runs ``--scheduling-policy priority``) and the requests in flight follow the
        server's load, from ``YieldToInteractive.min_in_flight`` up to ``max_in_flight``; each
        progress line says the bound and why it last moved. Default False: a fixed bound, no priority.
    """

    template_fields: ClassVar[Sequence[str]] = ("conn_id", "gpu_hour_cost")
    engine_path: ClassVar[str] = "airflow_vllm_batch.engines.server.ConnectionEngine"

    conn_id: str = "vllm_default"
    yield_to_interactive: bool | YieldToInteractive = False

    @property
    def yielding(self) -> YieldToInteractive | None:
        """The :class:`YieldToInteractive` in force, or None when the batch does not yield."""
        if isinstance(self.yield_to_interactive, YieldToInteractive):
            return self.yield_to_interactive
        return YieldToInteractive() if self.yield_to_interactive is True else None

    def check(self, values: Mapping[str, Any]) -> None:
        if not isinstance(self.yield_to_interactive, (bool, YieldToInteractive)):
            raise ConfigurationError(
                "yield_to_interactive must be True, False or a YieldToInteractive(...), got "
                f"{type(self.yield_to_interactive).__name__} {self.yield_to_interactive!r}."
            )
        if (yielding := self.yielding) is not None:
            yielding.check()
            if self.client_processes != 1:
                raise ConfigurationError(
                    f"yield_to_interactive needs client_processes=1, got {self.client_processes!r}. Leave "
                    "client_processes out or set it to 1: one client steers the in-flight bound from the server's load."
                )
        super().check(values)

    @property
    def label(self) -> str:
        return f"WarmVLLMServer(conn_id={self.conn_id!r})"

    def rendered(self) -> Self:
        if not isinstance(self.conn_id, str) or not self.conn_id.strip():
            raise ConfigurationError(
                f"conn_id must be the name of a vllm connection, got {self.conn_id!r} after rendering."
            )
        rendered = super().rendered()
        assert isinstance(rendered, WarmVLLMServer)
        return rendered


__all__ = [
    "EngineOptions",
    "VLLMRunner",
    "VLLMServer",
    "WarmVLLMServer",
    "YieldToInteractive",
    "check_gpu_hour_cost",
    "configured_stall_timeout",
    "seconds_of",
]
