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
  no manifest that says how it ended;
* ``Lifecycle/ended-batch-changed``: a batch ended (its task succeeded with a published
  manifest), then something happened to it that happens to ended batches (below), and its
  manifest, output or error file is no longer byte for byte what it was, or a later try
  returned another manifest (Fencing (d) of docs/protocol.md: *final is final*);
* ``Lifecycle/earlier-identity-answer-dropped``: a cancelled or expired batch published as
  ``batch_<status>`` a request whose final answer another run identity (a try before a vLLM
  upgrade) made durable before the publishing try began (Durability for a write-once output;
  the answer cache's staged hits excepted).

What may happen to a batch besides a cancel and its deadline (:class:`Lifecycle`): the
workers' vLLM is upgraded between two tries (every try from a given number on has another
run identity: a rolling upgrade during retries), and, once the task succeeded, the run is
cleared (its next try runs, under the same identity or another, before or past the deadline)
or its conf is replayed into another batch DAG (a second task instance, which must refuse
it: the signed spec binds the DAG).

The core simulator's files are reused unchanged; its search is another helper's.
``VLLM_BATCH_LIFECYCLE_SCHEDULES`` sets how many schedules a run checks.
"""

from __future__ import annotations

import dataclasses
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
from airflow_vllm_batch.exceptions import BatchStopped, ConfigurationError
from airflow_vllm_batch.lease import TaskTry
from airflow_vllm_batch.manifest import Manifest
from airflow_vllm_batch.openai_api import batch_dag
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, ForgedBatchError
from airflow_vllm_batch.run.answer_cache import CACHED_RESULTS
from airflow_vllm_batch.run.batch import BatchOutcome, BatchRun
from airflow_vllm_batch.run.settings import BatchSettings
from airflow_vllm_batch.storage.layout import default_error_uri, manifest_uri
from tests.simulation.engines import (
    SimEngineHook,
    SimRunner,
    SimRunnerEngine,
    SimRunnerProcess,
    answer_line,
)
from tests.simulation.invariants import Outcome, Violation, check_all, durable_answers, first_input
from tests.simulation.scheduler import TryState, VirtualThreading
from tests.simulation.world import BUCKET, World, make_plan, simulation

if TYPE_CHECKING:
    import pytest

SCHEDULES = int(os.environ.get("VLLM_BATCH_LIFECYCLE_SCHEDULES", "300"))
#: Seeds run besides the first ``SCHEDULES``, each the first to reach a schedule the others miss:
#: 579 pauses try 1 before it takes the lease until its successor has ended the batch (a zombie
#: that looked before the end and leases after it); with the check once the lease is taken
#: skipped for a write-once output (``run/batch.py``), it republishes the ended batch under its
#: new identity (Lifecycle/ended-batch-changed), and no seed below 300 shows it.
REGRESSION_SEEDS = (579,)
CANCEL_KEY = "batches/batch_sim.cancel.json"
#: The virtual clock's zero on the wall clock the stop condition reads.
EPOCH = 1_900_000_000


#: What may happen to an ended batch: its run cleared (the next try runs), under the same identity or
#: another, before or past its deadline; or its conf replayed into another batch DAG.
AFTER_END = ("clear", "clear-new-identity", "clear-past-deadline", "replay")
#: The batch DAG of the batch, and the one its conf is replayed into.
DAG_ID, OTHER_DAG_ID = "vllm_batch_openai", "another_batch_dag"
SIM_KEY = "s" * 40


@dataclass
class Lifecycle:
    """What the API user, the clock and the operators do to the batch.

    :param cancel_at_step: the global step of a cancel, if any.
    :param deadline_s: the deadline in virtual seconds, if any.
    :param new_identity_from_try: every try from this number on runs another vLLM (another run identity).
    :param after_end: what happens once the task succeeded (one of :data:`AFTER_END`), if anything.
    """

    cancel_at_step: int | None
    deadline_s: float | None
    new_identity_from_try: int | None = None
    after_end: str | None = None

    def describe(self) -> str:
        return (
            f"cancel at step {self.cancel_at_step}, deadline {self.deadline_s} virtual s, "
            f"new identity from try {self.new_identity_from_try}, after the end: {self.after_end}"
        )


def make_lifecycle(seed: int) -> Lifecycle:
    rng = random.Random(f"lifecycle-{seed}")
    cancel = rng.randint(1, 150) if rng.random() < 0.45 else None
    deadline = None
    if rng.random() < 0.4:
        deadline = 0.0 if rng.random() < 0.15 else rng.uniform(1, 400)
    # Drawn from a generator of their own: the schedules above stay what they were.
    more = random.Random(f"lifecycle-more-{seed}")
    new_identity = more.randint(2, 3) if more.random() < 0.3 else None
    after_end = more.choice(AFTER_END) if more.random() < 0.5 else None
    return Lifecycle(cancel, deadline, new_identity, after_end)


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
        #: Virtual seconds the wall clock is ahead of the scheduler's (a clear long after the deadline).
        self.clock_ahead_s = 0.0
        #: The batch's published objects (key -> bytes) when its task first succeeded, and that try's manifest.
        self.ended: dict[str, bytes | None] | None = None
        self.ended_manifest: Any = None
        #: The first try of the clear (every later try of run-1 is the clear's too), and whether the replay was refused.
        self.cleared_from: int | None = None
        self.replay_refused: bool | None = None
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

    def operator_view(self) -> Any:
        """The batch task as its methods see it, on this world's S3: the signed input version is the first input's ETag."""
        return SimpleNamespace(
            hook=self.hook,
            batch=SimpleNamespace(input_version=next(iter(self.inputs))),
            output_uri=self.output_uri,
            error_uri=self.error_uri,
            log=logging.getLogger("sim.task"),
        )

    def run_callbacks(self) -> dict[str, Any]:
        """What the batch task tells its run (OpenAIBatchOperator.run_callbacks): its stop condition, write once; no progress record."""
        view = SimpleNamespace(stop_condition=self.stop_condition, write_progress=None)
        callbacks = OpenAIBatchOperator.run_callbacks(view)  # type: ignore[arg-type]
        return {**callbacks, "on_checkpoint": None}

    def now(self) -> float:
        """The wall clock the stop condition reads."""
        return EPOCH + self.scheduler.now + self.clock_ahead_s

    def run_try(self, state: TryState) -> None:
        if state.label.startswith("prior/"):
            return super().run_try(state)
        if state.run == "run-2":
            return self.replay(state)
        upgraded = self.lifecycle.new_identity_from_try
        cleared_upgraded = self.lifecycle.after_end == "clear-new-identity" and any(
            t is state for t in self.after_end_tries()
        )
        task = TaskTry(
            dag_id=DAG_ID,
            run_id="run-1",
            task_id="batch",
            map_index=-1,
            try_number=state.number,
            last_try=state.number >= self.plan.max_tries,
        )
        self.run_batch_task(
            state, task, (upgraded is not None and state.number >= upgraded) or cleared_upgraded
        )

    def run_batch_task(self, state: TryState, task: TaskTry, upgraded: bool) -> None:
        """What the batch task does once it bound the batch: its first look for an ended batch, then the run.

        :param upgraded: whether this try's worker runs another vLLM (another run identity).
        """
        log = logging.getLogger("sim.task")
        ended = OpenAIBatchOperator.ended_manifest(self.operator_view())  # type: ignore[arg-type]
        if ended is not None:
            state.outcome = BatchOutcome(Manifest.from_dict(ended), resumed=True)
            return
        values = self.settings_values
        if upgraded:
            # Another vLLM on this worker: the engine's flags change the run identity (as its version would).
            engine = values["engine"]
            values = {**values, "engine": dataclasses.replace(engine, args=[*engine.args, "--seed", "7"])}
        settings = BatchSettings.from_rendered(**values)
        sim_engine = settings.engine.engine_class()(settings, log)
        sim_engine.world = self  # type: ignore[attr-defined]
        state.outcome = BatchRun(
            settings, s3_hook=self.hook, engine=sim_engine, task=task, log=log, **self.run_callbacks()
        ).execute()

    def replay(self, state: TryState) -> None:
        """The batch's conf triggered in another batch DAG: its task verifies the spec first, and must refuse it."""
        spec = BatchSpec(
            batch_id="batch_0123456789abcdef",
            dag_id=DAG_ID,
            owner="u",
            input_file_id="file-0123456789",
            input_version=next(iter(self.inputs)),
            endpoint="/v1/chat/completions",
            route="",
            created_at=EPOCH,
            window_s=86400,
        )
        try:
            BatchSpec.verified(spec.sign(SIM_KEY), spec.batch_id, SIM_KEY, OTHER_DAG_ID)
        except (ForgedBatchError, ConfigurationError) as err:
            # Refused for the right reason, its DAG (a refusal for anything else would hide a DAG not checked).
            self.replay_refused = f"not for {OTHER_DAG_ID!r}" in str(err)
            raise
        self.replay_refused = False
        # Not refused: the other DAG's batch task runs it, with its own engine (another identity).
        task = TaskTry(
            dag_id=OTHER_DAG_ID,
            run_id=spec.batch_id,
            task_id="batch",
            map_index=-1,
            try_number=1,
            last_try=True,
        )
        self.run_batch_task(state, task, upgraded=True)

    def try_ended(self, actor: Any, error: BaseException | None) -> None:
        super().try_ended(actor, error)
        state: TryState = actor.owner
        after = self.lifecycle.after_end
        if state.run != "run-1" or self.final != "success" or self.ended is not None or after is None:
            return
        # The batch ended: what it published must never change.
        self.ended = self.published_objects()
        self.ended_manifest = state.outcome.manifest if state.outcome is not None else None
        if after == "replay":
            self.start_try(1, "run-2")
            return
        if after == "clear-past-deadline":
            if self.lifecycle.deadline_s is None:
                self.lifecycle.deadline_s = self.scheduler.now
            self.clock_ahead_s = 25 * 3600
        self.cleared_from = state.number + 1
        self.start_try(self.cleared_from)

    def after_end_tries(self) -> list[TryState]:
        """The tries of the clear (run-1's tries from its first on), and the replay's."""
        return [
            t
            for t in self.tries
            if (t.run == "run-1" and self.cleared_from is not None and t.number >= self.cleared_from)
            or t.run == "run-2"
        ]

    def published_objects(self) -> dict[str, bytes | None]:
        objects = self.s3.buckets[BUCKET]
        keys = [
            self.output_uri,
            self.error_uri or default_error_uri(self.output_uri),
            manifest_uri(self.output_uri),
        ]
        return {
            key: (objects[key].body if key in objects else None)
            for key in (uri.split("/", 3)[3] for uri in keys)
        }

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
    # The batch's input is the API's copy, written once at create and pinned by the signed ETag: no user rewrites it
    # (a copy that changed fails the batch task before it runs: test_batch_spec.py), and an ended batch answers it.
    plan.rewrite_input_at = None
    if plan.target is not None and plan.target[1] == "freeze":
        plan.target, plan.resume_at = None, None
    world = LifecycleWorld(plan, workdir, make_lifecycle(seed))
    with monkeypatch.context() as patch:
        # The virtual clock, for the deadline and the engines' polls (every request, not every 5 s of a clock that does not pass).
        patch.setattr(batch_dag, "time", SimpleNamespace(time=world.now))
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
    found += ended_batch_checks(world)
    if m is None:
        return found
    found += answers_of_earlier_identities_checks(world, outcome)
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


def answers_of_earlier_identities_checks(world: LifecycleWorld, outcome: Outcome) -> list[Violation]:
    """``Lifecycle/earlier-identity-answer-dropped``: a stopped batch publishes the answers another identity made durable.

    Durability for a write-once output: a final answer in the staging of another run identity (a try
    before a vLLM upgrade), written before the publishing try began, is published as an answer, not as
    ``batch_<status>``.
    """
    m = outcome.complete
    if m is None or m.status not in ("cancelled", "expired"):
        return []
    publisher = next(
        (
            t
            for t in world.tries
            if t.outcome is not None
            and not t.outcome.resumed
            and t.outcome.manifest.fingerprint == m.fingerprint
        ),
        None,
    )
    if publisher is None:
        return []
    first = next((i for i, x in enumerate(world.s3.mutations) if x.try_label == publisher.label), None)
    root = world.output_uri.split("/", 3)[3] + ".staging/"
    wanted = first_input(world)
    earlier: set[str] = set()
    for x in world.s3.mutations[:first]:
        # The answer cache's staged hits are the cache's, not a run's: another identity's are not kept (a limit, docs).
        if (
            x.key.startswith(root)
            and x.body is not None
            and not x.key[len(root) :].startswith(m.fingerprint[:16])
            and not x.key.endswith(CACHED_RESULTS)
        ):
            earlier |= durable_answers(x.body, wanted)
    dropped = sorted(
        line["custom_id"]
        for line in map(json.loads, (outcome.body(m.error_uri) or b"").splitlines())
        if line.get("response") is None
        and (line.get("error") or {}).get("code") == f"batch_{m.status}"
        and line["custom_id"] in earlier
    )
    if not dropped:
        return []
    return [
        Violation(
            "Lifecycle/earlier-identity-answer-dropped",
            f"answered durably under another identity, published as batch_{m.status}: {dropped}",
        )
    ]


def ended_batch_checks(world: LifecycleWorld) -> list[Violation]:
    """``Lifecycle/ended-batch-changed``: what an ended batch published never changes, whatever happened to it since."""
    if world.ended is None:
        return []
    found = []
    now = world.published_objects()
    changed = sorted(key for key, body in world.ended.items() if now.get(key) != body)
    if changed:
        found.append(
            Violation(
                "Lifecycle/ended-batch-changed",
                f"{world.lifecycle.after_end} after the batch ended changed {changed}",
            )
        )
    for t in world.after_end_tries():
        if (
            t.outcome is not None
            and world.ended_manifest is not None
            and t.outcome.manifest != world.ended_manifest
        ):
            found.append(
                Violation(
                    "Lifecycle/ended-batch-changed",
                    f"{t.label} returned another manifest than the batch's ending",
                )
            )
            break
    if world.lifecycle.after_end == "replay" and world.ended is not None and world.replay_refused is not True:
        found.append(
            Violation(
                "Lifecycle/ended-batch-changed",
                f"the conf replayed into {OTHER_DAG_ID} was not refused for its DAG (refused: {world.replay_refused})",
            )
        )
    return found


def test_no_lifecycle_schedule_violates_an_invariant(tmp_path, monkeypatch, sim_seed):
    seeds = [sim_seed] if sim_seed is not None else sorted({*range(SCHEDULES), *REGRESSION_SEEDS})
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
        assert {make_lifecycle(seed).after_end for seed in seeds} >= set(AFTER_END)
