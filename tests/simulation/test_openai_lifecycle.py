"""The OpenAI API's batch lifecycle under the fault simulator: run, expire, cancel, zombies and retries interleaved.

Each seed takes the core simulator's plan (engine, faults, kills, zombies, retries; see
:mod:`tests.simulation.world`) without its colliding configurations (the API makes every
location itself) and adds what an API user and the clock do to a batch: a cancel
(``POST /batches/{id}/cancel`` writes the cancel object) at a random step, and a deadline
(``expires_at``, from ``created_at``) at a random virtual time, sometimes before the task
runs at all. Every try runs the real :class:`~airflow_vllm_batch.run.batch.BatchRun` with
the batch task's real stop condition
(:meth:`~airflow_vllm_batch.openai_api.batch_dag.OpenAIBatchOperator.stop_condition`) and
OpenAI's line shape. After each schedule, the run protocol's invariants are checked on the
batch's files (:func:`tests.simulation.invariants.check_all`), and the lifecycle's own:

* ``Lifecycle/unasked-stop``: a manifest says ``cancelled`` though no cancel was asked, or
  ``expired`` before the deadline;
* ``Lifecycle/stopped-lines``: an unanswered request of a stopped batch is not one
  ``batch_<status>`` line without a response (and a batch run to its end has none);
* ``Lifecycle/openai-shape``: a published line whose id is not ``batch_req_…``, or an HTTP
  failure whose error is not in ``response.body.error`` (with ``error: null``);
* ``Lifecycle/stop-failed-the-task``: a try ended in ``BatchStopped`` (a stopped batch
  publishes and succeeds; the stop must never escape the run layer);
* ``Lifecycle/stopped-but-not-published``: the task succeeded after a stop was asked, with
  no manifest that says how it ended.

The core simulator's files are reused unchanged; its search is another helper's.
``VLLM_BATCH_LIFECYCLE_SCHEDULES`` sets how many schedules a run checks.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.engines import base as engine_base, runner as runner_module
from airflow_vllm_batch.exceptions import BatchStopped
from airflow_vllm_batch.lease import TaskTry
from airflow_vllm_batch.openai_api import batch_dag
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
from airflow_vllm_batch.run.batch import BatchRun
from airflow_vllm_batch.run.settings import BatchSettings
from tests.simulation.engines import (
    SimEngineHook,
    SimRunner,
    SimRunnerEngine,
    SimRunnerProcess,
    answer_line,
)
from tests.simulation.invariants import Outcome, Violation, check_all
from tests.simulation.scheduler import TryState, VirtualThreading
from tests.simulation.world import BUCKET, World, make_plan, simulation

if TYPE_CHECKING:
    import pytest

SCHEDULES = int(os.environ.get("VLLM_BATCH_LIFECYCLE_SCHEDULES", "300"))
CANCEL_KEY = "batches/batch_sim.cancel.json"
#: The virtual clock's zero on the wall clock the stop condition reads.
EPOCH = 1_900_000_000


@dataclass
class Lifecycle:
    """What the API user and the clock do to the batch: a cancel at a global step, a deadline in virtual seconds."""

    cancel_at_step: int | None
    deadline_s: float | None

    def describe(self) -> str:
        return f"cancel at step {self.cancel_at_step}, deadline {self.deadline_s} virtual s"


def make_lifecycle(seed: int) -> Lifecycle:
    rng = random.Random(f"lifecycle-{seed}")
    cancel = rng.randint(1, 150) if rng.random() < 0.45 else None
    deadline = None
    if rng.random() < 0.4:
        deadline = 0.0 if rng.random() < 0.15 else rng.uniform(1, 400)
    return Lifecycle(cancel, deadline)


class StoppableProcess(SimRunnerProcess):
    """The simulated runner, stopped between two requests when terminated (SIGTERM: no output written)."""

    stopped = False

    def lines(self) -> Any:
        world, argv = self.world, self.argv
        source, target = argv[argv.index("-i") + 1], argv[argv.index("-o") + 1]
        out: list[bytes] = []
        for request in world.read_engine_input(source):
            if self.stopped:
                self.returncode = -15
                return
            fate = world.engine_fate(runner=True)
            if fate in ("crash", "die"):
                self.returncode = 1
                yield b"RuntimeError: CUDA error: an illegal memory access was encountered"
                return
            out.append(answer_line(request, 400 if fate == "fail" else 200))
            world.note_sent(request["custom_id"], Path(target).parent)
        if self.stopped:
            self.returncode = -15
            return
        Path(target).write_bytes(b"\n".join(out) + b"\n")
        self.returncode = 0


class StoppableHook(SimEngineHook):
    def terminate(self) -> None:
        if isinstance(self.process, StoppableProcess):
            self.process.stopped = True


class StoppableRunnerEngine(SimRunnerEngine):
    @property
    def hook(self) -> Any:  # type: ignore[override]
        if "_hook" not in self.__dict__:
            hook = StoppableHook(kill_grace_s=self.options.kill_grace_s)
            hook._log = logging.getLogger("airflow.task.hooks.sim_engine")
            self.__dict__["_hook"] = hook
        return self.__dict__["_hook"]


class StoppableRunner(SimRunner):
    def engine_class(self) -> type[SimRunnerEngine]:
        return StoppableRunnerEngine


class LifecycleWorld(World):
    """The batch task of one API batch under the simulator: the core world, with a cancel and a deadline."""

    def __init__(self, plan: Any, workdir: Path, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        #: Virtual time of the cancel request, once written.
        self.cancel_asked_at: float | None = None
        super().__init__(plan, workdir)

    def _settings_values(self) -> dict[str, Any]:
        values = super()._settings_values()
        engine = values["engine"]
        if isinstance(engine, SimRunner):
            # No stall bound: its stand-in does not wedge (the core simulator checks the bound), and the schedules
            # stay what they were.
            values["engine"] = StoppableRunner(args=list(engine.args), stall_timeout=0)
        return {**values, "result_shape": "openai", "max_failed_ratio": 0.0}

    def stop_condition(self) -> str | None:
        """The batch task's real stop condition, on this world's S3 and clock."""
        operator = SimpleNamespace(
            hook=self.hook,
            cancel_uri=f"s3://{BUCKET}/{CANCEL_KEY}",
            batch=SimpleNamespace(
                batch_id="batch_sim",
                expires_at=EPOCH + self.lifecycle.deadline_s
                if self.lifecycle.deadline_s is not None
                else float("inf"),
            ),
            log=logging.getLogger("sim.task"),
        )
        return OpenAIBatchOperator.stop_condition(operator)  # type: ignore[arg-type]

    def run_try(self, state: TryState) -> None:
        if state.label.startswith("prior/"):
            return super().run_try(state)
        log = logging.getLogger("sim.task")
        settings = BatchSettings.from_rendered(**self.settings_values)
        engine = settings.engine.engine_class()(settings, log)
        engine.world = self  # type: ignore[attr-defined]
        task = TaskTry(
            dag_id="sim",
            run_id="run-1",
            task_id="batch",
            map_index=-1,
            try_number=state.number,
            last_try=state.number >= self.plan.max_tries,
        )
        state.outcome = BatchRun(
            settings, s3_hook=self.hook, engine=engine, task=task, log=log, stop=self.stop_condition
        ).execute()

    def on_step(self, actor: Any) -> None:
        super().on_step(actor)
        if self.lifecycle.cancel_at_step == self.global_steps and self.cancel_asked_at is None:
            # The API user asks, outside every try: no step, no fault, written by "user".
            self.s3.put(BUCKET, CANCEL_KEY, json.dumps({"cancelling_at": 1}).encode())
            self.s3.buckets[BUCKET][CANCEL_KEY].writer = "user"
            self.cancel_asked_at = self.scheduler.now


def run_lifecycle(seed: int, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> LifecycleWorld:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    plan = make_plan(seed)
    plan.collision = None  # the API makes every location: no colliding configuration reaches the task
    # A batch is one DAG run (its run_id is the batch id); any other run of its conf fails BatchSpec.verified
    # before it reads or writes, so no second task instance ever shares a batch's output.
    plan.second_run_at = None
    plan.engine_faults.pop("wedge", None)  # StoppableProcess does not model a wedged engine
    # Nor any of the schedules that start one (a frozen process beside another run, a user's rewrite then a re-run).
    plan.outside_rewrite = False
    if plan.target is not None and plan.target[1] == "freeze":
        plan.target, plan.resume_at = None, None
    world = LifecycleWorld(plan, workdir, make_lifecycle(seed))
    with monkeypatch.context() as patch:
        # The virtual clock, for the deadline and the engines' polls (every request, not every 5 s of a clock that does not pass).
        patch.setattr(batch_dag, "time", SimpleNamespace(time=lambda: EPOCH + world.scheduler.now))
        patch.setattr(engine_base, "STOP_POLL_S", 0.0)
        patch.setattr(runner_module, "threading", VirtualThreading(world.scheduler))
        with simulation(world):
            world.run()
    world.s3.scheduler = None
    world.s3.faults = None
    return world


def lifecycle_checks(world: LifecycleWorld) -> list[Violation]:
    outcome = Outcome(world)
    found: list[Violation] = []
    m = outcome.complete
    status = m.status if m is not None else None
    if status == "cancelled" and world.cancel_asked_at is None:
        found.append(
            Violation("Lifecycle/unasked-stop", "the manifest says cancelled, but no cancel was asked")
        )
    if status == "expired" and (
        world.lifecycle.deadline_s is None or world.scheduler.now < world.lifecycle.deadline_s
    ):
        found.append(Violation("Lifecycle/unasked-stop", "the manifest says expired before the deadline"))
    for t in world.tries:
        if isinstance(t.error, BatchStopped):
            found.append(Violation("Lifecycle/stop-failed-the-task", f"{t.label} ended in BatchStopped"))
            break
    stop_asked = world.cancel_asked_at is not None or (
        world.lifecycle.deadline_s is not None and world.scheduler.now >= world.lifecycle.deadline_s
    )
    if world.final == "success" and m is None and stop_asked:
        found.append(
            Violation(
                "Lifecycle/stopped-but-not-published",
                "the task succeeded after a stop with no complete manifest",
            )
        )
    if m is None:
        return found
    for uri in (m.output_uri, m.error_uri):
        for raw in (outcome.body(uri) or b"").splitlines():
            line = json.loads(raw)
            if not str(line.get("id", "")).startswith("batch_req_"):
                found.append(Violation("Lifecycle/openai-shape", f"line id {line.get('id')!r}"))
                return found
            response, error = line.get("response"), line.get("error")
            if response is not None and response.get("status_code", 200) >= 400:
                body_error = (response.get("body") or {}).get("error") or {}
                if (
                    error is not None
                    or not isinstance(body_error.get("message"), str)
                    or set(body_error) != {"message", "type", "param", "code"}
                ):
                    found.append(
                        Violation(
                            "Lifecycle/openai-shape",
                            f"HTTP failure of {line['custom_id']} not in response.body.error: {raw[:200]!r}",
                        )
                    )
                    return found
            if response is None:
                code = (error or {}).get("code")
                if status is None and code in ("batch_cancelled", "batch_expired"):
                    found.append(
                        Violation(
                            "Lifecycle/stopped-lines",
                            f"{line['custom_id']} is {code} in a batch run to its end",
                        )
                    )
                elif status is not None and code not in (f"batch_{status}", "engine_crash"):
                    found.append(
                        Violation(
                            "Lifecycle/stopped-lines",
                            f"{line['custom_id']} of a {status} batch has error {error}",
                        )
                    )
    return found


def test_no_lifecycle_schedule_violates_an_invariant(tmp_path, monkeypatch, sim_seed):
    seeds = [sim_seed] if sim_seed is not None else range(SCHEDULES)
    failing: dict[int, list[str]] = {}
    statuses: dict[str | None, int] = {}
    started = time.perf_counter()
    for seed in seeds:
        world = run_lifecycle(seed, tmp_path / "schedule", monkeypatch)
        found = check_all(world) + lifecycle_checks(world)
        complete = Outcome(world).complete
        key = (complete.status or "completed") if complete is not None else None
        statuses[key] = statuses.get(key, 0) + 1
        if found or world.s3.unsupported:
            failing[seed] = [f"{v.check}: {v.detail}" for v in found] + (
                [f"unsupported S3 calls {sorted(world.s3.unsupported)}"] if world.s3.unsupported else []
            )
    report = "\n".join(
        f"seed {seed} ({make_plan(seed).describe()}; {make_lifecycle(seed).describe()}): "
        + "; ".join(v)
        + f"\n  replay: VLLM_BATCH_SIM_SEED={seed} python -m pytest -q {__file__}"
        for seed, v in list(failing.items())[:10]
    )
    assert not failing, (
        f"{len(failing)} of {len(list(seeds))} schedules failed in {time.perf_counter() - started:.0f}s:\n{report}"
    )
    # The search reached every way a batch ends, or it proves nothing about them.
    if sim_seed is None and SCHEDULES >= 200:
        assert {"completed", "cancelled", "expired"} <= set(statuses), statuses
