"""The fault simulator's shard scenario: split -> N shard runs -> merge, under the simulator's faults.

One seed draws a batch of 4-14 requests and a shard size; the real
:class:`~airflow_vllm_batch.operators.shards.VLLMBatchSplitOperator` splits it on the fake S3
(its tries retried as Airflow would), a stand-in for each mapped ``VLLMBatchOperator`` publishes
its shard's results, error file and manifest the way the run leaves them (results without a final
newline, one error line per failed request; the run protocol itself is the core simulator's, in
:mod:`tests.simulation.world`), and the real
:class:`~airflow_vllm_batch.operators.shards.VLLMBatchMergeOperator` merges them, try after try,
on the same fake S3, scheduler and fault plan as the run (``world.py`` and ``scheduler.py`` are
used, not changed). What the seed adds:

* S3 faults at the plan's rate on every call (5xx, lost responses, slow calls, outages), and a
  targeted fault at one call site of one merge try (:data:`MERGE_SITES`): an S3 fault, a 409 at a
  conditional write, a kill, a zombie (Airflow starts the next try while it runs on), a pause
  (until its successor reaches a site, or ends), or a freeze of its whole process right after the
  fence of a publishing write while a second merge takes the stale lease over;
* random kills and zombies of merge tries at a step;
* a second DAG run's merge of *other* shards (other answers) into the same ``output_uri``;
* an earlier merge's output already published there (the output a failed merge must leave alone);
* a bad shard: a mapped task that published nothing (``None`` in the mapped output, or absent
  from it), a shard's results or error file rewritten (lines added, dropped, or the same count
  with other bytes) or deleted after its manifest, before the merge; or rewritten *while* the
  merge runs; and older shard manifests without ETags (only the counts can tell then).

Checked after every change S3 applies (:class:`ShardStepChecks`), with the core's fencing checks:
a reader never takes a merged output as complete unless it is (its manifest's counts match the
merged files and every shard's lines are there exactly once, in shard order); a merge try that
does not hold the lease changes at most the one write its last fence let through
(``Fencing/writes-after-lease-lost``); no write replaces a version made after its try's last
lease read; a take-over never goes to an older try. And at the end (:func:`check_shard_schedule`):
the split kept every request exactly once; a merge that succeeded left a complete merged output;
a bad shard failed the merge without a retry, with nothing written by it and the old merged
output as it was; and a merge whose last try met no fault succeeded when every shard published.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_vllm_batch.manifest import Manifest, is_tombstone
from airflow_vllm_batch.operators.shards import VLLMBatchMergeOperator, VLLMBatchSplitOperator
from tests.simulation.invariants import StepChecks, Violation
from tests.simulation.s3 import FakeS3, FakeS3Client, FakeS3Hook, FaultPlan
from tests.simulation.scheduler import Scheduler, TryState
from tests.simulation.world import retryable, simulation, site_of

BUCKET = "sim"
INPUT_KEY = "in/batch.jsonl"
OUTPUT_KEY = "out/results.jsonl"
MANIFEST_KEY = "out/results.manifest.json"
ERRORS_KEY = "out/results.errors.jsonl"
LEASE_KEY = "out/results.lease.json"
#: Each DAG run's shards live under its own prefix (``p/run-1/shards/``), as the docs tell users to template it.
SHARD_PREFIX = "p/{run}/shards/"
MAX_TRIES = 3
#: Airflow's default ``retry_delay``.
RETRY_DELAY_S = 300.0

#: The merge's call sites (operation, object): the shards' files, the split's listing, the input's head, and
#: the publishing steps and lease writes the run shares (docs/protocol.md).
MERGE_SITES: tuple[str, ...] = (
    "list shards",
    "get shard results",
    "get shard errors",
    "head input",
    "get lease",
    "put lease",
    "delete lease",
    "head manifest",
    # The merge's reads of the manifest: before merging, and under the lease the one its tombstone is pinned to.
    "get manifest",
    "put manifest",
    "head results",
    "put results",
    "head errors",
    "put errors",
    "delete errors",
)
#: Publishing's steps: most pauses are at one of these.
PUBLISH_SITES = ("put lease", "head manifest", "put manifest", "head results", "put results", "put errors")
#: Where a merge's process may be frozen (right after the fence of a write).
FREEZE_SITES = ("put manifest", "put results", "put errors", "delete errors")
#: Where a paused merge try goes on: its successor at this site.
RESUME_SITES = ("put lease", "head manifest", "put manifest", "put results", "put errors", "delete errors")
CONDITIONAL_SITES = frozenset(
    {"put manifest", "put results", "put errors", "delete errors", "put lease", "delete lease"}
)
#: The bad shards a plan may hold: ``None`` in the mapped output, left out of it, a results file rewritten
#: (a line more, a line less, other bytes), the results or error file deleted, all before the merge;
#: ``during``: rewritten while the merge runs (the merge either fails or publishes what the manifest counted).
BAD_KINDS = ("none", "absent", "extra-line", "lost-line", "other-bytes", "results-deleted", "errors-deleted")


def merge_site_kinds(site: str) -> tuple[str, ...]:
    """The fault kinds that exist at ``site``."""
    kinds: tuple[str, ...] = ("error", "lost_response", "slow", "outage", "kill", "zombie", "pause")
    if site in FREEZE_SITES:
        kinds += ("freeze",)
    if site in CONDITIONAL_SITES:
        kinds += ("conflict",)
    return kinds


def merge_site_of(op: str, key: str) -> str:
    """The call site of an S3 call of the split or the merge."""
    if key.startswith("p/"):
        verb = site_of(op, key, OUTPUT_KEY, INPUT_KEY).split(" ")[0]
        if op == "list_objects_v2":
            return "list shards"
        if key.endswith(".results.errors.jsonl"):
            return f"{verb} shard errors"
        if key.endswith(".results.jsonl"):
            return f"{verb} shard results"
        return f"{verb} shard"
    return site_of(op, key, OUTPUT_KEY, INPUT_KEY)


@dataclass
class ShardPlan:
    """Everything a seed decides before the schedule runs (the interleaving is decided as it runs)."""

    seed: int
    requests: int
    max_requests: int
    fault_rate: float
    fail_rate: float
    #: Shard manifests record their files' ETags (an older ``VLLMBatchOperator``'s do not: only counts tell).
    etags: bool = True
    kill_at: dict[int, int] = field(default_factory=dict)
    zombie_at: dict[int, int] = field(default_factory=dict)
    #: ``(site, kind, n, try)``: the ``n``-th call of merge try ``try`` at ``site`` meets ``kind``.
    target: tuple[str, str, int, int] | None = None
    resume_at: tuple[str, int] | None = None
    #: A bad shard: ``(kind, shard position drawn in [0, 1))``; None: every shard published and is intact.
    bad: tuple[str, float] | None = None
    #: A shard's results rewritten (a line dropped) at this global step, while the merge runs.
    rewrite_during_at: int | None = None
    #: A second DAG run's merge of other shards into the same output starts at this global step.
    second_at: int | None = None
    #: An earlier DAG run's merge published the output first.
    old_output: bool = False
    #: ... with an error file (a merge without failures then deletes it, ``If-Match``).
    old_errors: bool = False
    stay: float = 0.5
    shuffle_lists: bool = False

    def describe(self) -> str:
        bits = [
            f"requests={self.requests}",
            f"max_requests={self.max_requests}",
            f"s3_fault_rate={self.fault_rate}",
            f"failed requests {self.fail_rate}",
        ]
        if not self.etags:
            bits.append("shard manifests without ETags")
        if self.kill_at:
            bits.append(f"kill(try:step)={self.kill_at}")
        if self.zombie_at:
            bits.append(f"zombie(try:step)={self.zombie_at}")
        if self.target:
            site, kind, n, number = self.target
            bits.append(f"target: {kind} at call {n} of merge try {number} to {site!r}")
            if self.resume_at:
                bits.append(f"until its successor's call {self.resume_at[1]} to {self.resume_at[0]!r}")
        if self.bad:
            bits.append(f"bad shard: {self.bad[0]} at {self.bad[1]:.2f} of the shards")
        if self.rewrite_during_at:
            bits.append(f"a shard's results rewritten at step {self.rewrite_during_at}")
        if self.second_at:
            bits.append(f"run-2's merge of other shards starts at step {self.second_at}")
        if self.old_output:
            bits.append("an earlier merge's output" + (" with an error file" if self.old_errors else ""))
        if self.stay != 0.5:
            bits.append(f"scheduler stay={self.stay}")
        if self.shuffle_lists:
            bits.append("listings in random order")
        return ", ".join(bits)


def make_shard_plan(seed: int) -> ShardPlan:
    """Draw one shard schedule's plan from its seed."""
    rng = random.Random(f"shards-{seed}")
    plan = ShardPlan(
        seed=seed,
        requests=rng.randint(4, 14),
        max_requests=rng.randint(2, 5),
        fault_rate=rng.choice((0.0, 0.01, 0.03, 0.06)),
        fail_rate=rng.choice((0.0, 0.2)),
        etags=rng.random() < 0.7,
        stay=rng.choice((0.1, 0.5, 0.5, 0.9)),
        shuffle_lists=rng.random() < 0.3,
        old_output=rng.random() < 0.4,
    )
    for number in range(1, MAX_TRIES + 1):
        roll = rng.random()
        if roll < 0.15:
            plan.kill_at[number] = rng.randint(1, 30)
        elif roll < 0.3 and number < MAX_TRIES:
            plan.zombie_at[number] = rng.randint(1, 30)
    mode = rng.random()
    if mode < 0.7:
        pause = mode < 0.35
        site = rng.choice(PUBLISH_SITES if pause and rng.random() < 0.7 else MERGE_SITES)
        kind = "pause" if pause else rng.choice([k for k in merge_site_kinds(site) if k != "pause"])
        number = rng.choices((1, 2), weights=(3, 1))[0]
        plan.target = (site, kind, 1, number)
        plan.kill_at.pop(number, None)
        plan.zombie_at.pop(number, None)
        # The step exists only with failed lines (an error file to write), or an earlier one to delete.
        if site == "delete errors":
            plan.old_output, plan.old_errors, plan.fail_rate = True, True, 0.0
        elif site in ("put errors", "get shard errors", "head errors"):
            plan.fail_rate = 0.2
        if kind == "pause":
            roll = rng.random()
            resume = "end" if roll < 0.4 else site if roll < 0.6 else rng.choice(RESUME_SITES)
            plan.resume_at = (resume, 1)
        elif kind == "freeze":
            plan.resume_at = ("end", 1) if rng.random() < 0.6 else (rng.choice(RESUME_SITES), 1)
    roll = rng.random()
    if roll < 0.25:
        kinds = [k for k in BAD_KINDS if plan.etags or k != "other-bytes"]
        plan.bad = (rng.choice(kinds), rng.random())
    elif roll < 0.35:
        plan.rewrite_during_at = rng.randint(1, 40)
    if rng.random() < 0.15 and not (plan.target and plan.target[1] == "freeze"):
        plan.second_at = rng.randint(1, 60)
    return plan


@dataclass
class Batch:
    """The shards one DAG run's mapped tasks published: what its merge is given, and what it must publish."""

    run: str
    #: The manifests as each mapped task returned them (its XCom), in shard order.
    manifests: list[dict[str, Any]]
    #: Each shard's result lines and error lines as its manifest counted them (what the merge must copy).
    results: list[list[bytes]]
    errors: list[list[bytes]]

    @property
    def uris(self) -> list[str]:
        return [m["manifest_uri"] for m in self.manifests]

    def expected(self) -> tuple[bytes, bytes]:
        """The merged results and error file: every shard's lines once, in shard order, newline-terminated."""
        return (
            b"".join(line + b"\n" for lines in self.results for line in lines),
            b"".join(line + b"\n" for lines in self.errors for line in lines),
        )

    def counts(self) -> dict[str, int]:
        completed = sum(len(r) for r in self.results)
        failed = sum(len(e) for e in self.errors)
        return {"total": completed + failed, "completed": completed, "failed": failed}


class SimTI:
    """What the split and merge operators use of a task instance."""

    def __init__(self, run: str, task_id: str, try_number: int) -> None:
        self.dag_id, self.task_id, self.run_id = "sim", task_id, run
        self.try_number, self.map_index, self.max_tries = try_number, -1, MAX_TRIES - 1
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


class _VirtualMonotonic:
    """The merge's duration clock on the scheduler's (a replay writes the same manifest bytes)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def monotonic(self) -> float:
        return self.scheduler.now


class ShardWorld:
    """The split, the shard runs and the merge task instances of one plan, on the fake S3 under the scheduler.

    Duck-types what :func:`tests.simulation.world.simulation` and :class:`ShardStepChecks` (the core's
    :class:`~tests.simulation.invariants.StepChecks`) read of a world.
    """

    def __init__(self, plan: ShardPlan, workdir: Path) -> None:
        self.plan = plan
        #: The core checks read these of a plan: no collision of URIs here.
        plan.collision = None  # type: ignore[attr-defined]
        self.rng = random.Random(plan.seed)
        self.scheduler = Scheduler(self.rng, on_step=self.on_step, stay=plan.stay)
        self.faults = FaultPlan(self.rng, plan.fault_rate)
        self.lease_key = (BUCKET, LEASE_KEY)
        self.s3 = FakeS3(self.scheduler, self.faults, lease_key=self.lease_key)
        self.s3.shuffle_lists = plan.shuffle_lists
        self.s3.create_bucket(BUCKET)
        self.s3.site_of = lambda op, bucket, key: merge_site_of(op, key)
        self.hook = FakeS3Hook(FakeS3Client(self.s3))
        self.workdir = workdir
        self.input_uri = f"s3://{BUCKET}/{INPUT_KEY}"
        self.output_uri = f"s3://{BUCKET}/{OUTPUT_KEY}"
        self.error_uri: str | None = None
        self.tries: list[TryState] = []
        self.logs: list[Any] = []
        self.finals: dict[str, str] = {}
        self.final_tries: dict[str, TryState] = {}
        self.step_violations: list[Violation] = []
        self.site_calls: dict[tuple[str, str], int] = {}
        self.lease_read_call: dict[str, int] = {}
        self.global_steps = 0
        #: Steps of run-1's merge tries (when run-2 starts, when a shard is rewritten during the merge).
        self.merge_steps = 0
        self.kills = 0
        self.zombies = 0
        # What the core's per-step checks read of a world (no input rewrite, no outside rewrite of the output).
        self.input_version = 1
        self.outside_rewrite_call: int | None = None
        self.inputs: dict[str, dict[str, str]] = {}
        #: The DAG runs' shards, by run; and the merged manifests' shard lists that name each.
        self.batches: dict[str, Batch] = {}
        #: The split's shard kwargs (None until it succeeded).
        self.split: list[dict[str, str]] | None = None
        #: What run-1's merge is given (its bad shard applied); None until the shards published.
        self.given: list[Any] | None = None
        #: The merged output's objects (key -> body) when run-1's merge began.
        self.before_merge: dict[str, bytes | None] = {}
        #: The S3 call count when run-1's merge began.
        self.merge_began_call = 0
        self.rewritten_during = False
        #: The plan's bad shard as applied (the kind may change: a shard without errors loses its results instead).
        self.bad_kind: str | None = None
        self.bad_index: int | None = None
        self.input_bytes = b"".join(self.request_line("in", i) + b"\n" for i in range(plan.requests))
        self.s3.put(BUCKET, INPUT_KEY, self.input_bytes)
        self.s3.buckets[BUCKET][INPUT_KEY].writer = "user"
        self.step_checks = ShardStepChecks(self)
        self.s3.on_change = self.step_checks.after_change

    @staticmethod
    def request_line(run: str, i: int) -> bytes:
        return json.dumps(
            {
                "custom_id": f"{run}-r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]},
            }
        ).encode()

    # -- the shard runs (stand-ins for the mapped VLLMBatchOperator) ----------------------

    def publish_shard(
        self, run: str, index: int, input_key: str, lines: list[bytes], fail_rate: float | None = None
    ) -> tuple:
        """One mapped task's published shard: its results (no final newline), its error file, its manifest.

        :param fail_rate: the chance that a request failed (default: the plan's).
        """
        fail_rate = self.plan.fail_rate if fail_rate is None else fail_rate
        stem = input_key.removesuffix(".jsonl")
        results, errors = [], []
        for raw in lines:
            custom_id = json.loads(raw)["custom_id"]
            if self.rng.random() < fail_rate:
                errors.append(
                    json.dumps(
                        {
                            "id": f"e-{custom_id}",
                            "custom_id": custom_id,
                            "response": None,
                            "error": {"message": "400"},
                        }
                    ).encode()
                )
            else:
                results.append(
                    json.dumps(
                        {
                            "id": f"a-{custom_id}",
                            "custom_id": custom_id,
                            "response": {"status_code": 200, "body": {"answer": f"{run} says {custom_id}"}},
                            "error": None,
                        }
                    ).encode()
                )
        self.put_user(f"{stem}.results.jsonl", b"\n".join(results))
        manifest: dict[str, Any] = {
            "output_uri": f"s3://{BUCKET}/{stem}.results.jsonl",
            "error_uri": None,
            "input_uri": f"s3://{BUCKET}/{input_key}",
            "model": "m",
            "request_counts": {"total": len(lines), "completed": len(results), "failed": len(errors)},
            "usage": {
                "prompt_tokens": len(lines),
                "completion_tokens": len(results),
                "total_tokens": len(lines) + len(results),
            },
            "duration_s": 1.0,
            "engine_duration_s": 0.5,
            "vllm_version": "0.32.0",
            "fingerprint": hashlib.sha256(f"{run}/{index}".encode()).hexdigest(),
            "manifest_uri": f"s3://{BUCKET}/{stem}.results.manifest.json",
        }
        if self.plan.etags:
            manifest["output_etag"] = self.etag(f"{stem}.results.jsonl")
        if errors:
            self.put_user(f"{stem}.results.errors.jsonl", b"".join(e + b"\n" for e in errors))
            manifest["error_uri"] = f"s3://{BUCKET}/{stem}.results.errors.jsonl"
            if self.plan.etags:
                manifest["error_etag"] = self.etag(f"{stem}.results.errors.jsonl")
        return manifest, results, errors

    def put_user(self, key: str, body: bytes) -> None:
        """A write outside every try (a mapped task's publish, a user's tool): no step, no fault."""
        self.s3.put(BUCKET, key, body)
        self.s3.buckets[BUCKET][key].writer = "user"

    def etag(self, key: str) -> str:
        return self.s3.buckets[BUCKET][key].etag.strip('"')

    def batch_of_lines(self, run: str, requests: int, max_requests: int) -> Batch:
        """Another DAG run's shards, split here directly (the split is simulated for run-1 only)."""
        lines = [self.request_line(run, i) for i in range(requests)]
        prefix = SHARD_PREFIX.format(run=run)
        batch = Batch(run, [], [], [])
        # Another run's failures (or none) beside run-1's: an error file to replace, or to delete.
        fail_rate = 0.4 if run == "run-0" and self.plan.old_errors else self.rng.choice((0.0, 0.4))
        for start in range(0, requests, max_requests):
            index = start // max_requests
            key = f"{prefix}shard-{index:05d}.jsonl"
            chunk = lines[start : start + max_requests]
            self.put_user(key, b"".join(line + b"\n" for line in chunk))
            manifest, results, errors = self.publish_shard(run, index, key, chunk, fail_rate)
            batch.manifests.append(manifest)
            batch.results.append(results)
            batch.errors.append(errors)
        return batch

    def publish_run1_shards(self) -> None:
        """The mapped tasks of run-1 publish its shards (the split's output); then the plan's bad shard."""
        assert self.split is not None
        batch = Batch("run-1", [], [], [])
        for index, kwargs in enumerate(self.split):
            key = kwargs["input_uri"].split("/", 3)[3]
            lines = [line for line in self.s3.buckets[BUCKET][key].body.splitlines() if line.strip()]
            manifest, results, errors = self.publish_shard("run-1", index, key, lines)
            batch.manifests.append(manifest)
            batch.results.append(results)
            batch.errors.append(errors)
        self.batches["run-1"] = batch
        given: list[Any] = list(batch.manifests)
        if self.plan.bad is not None:
            kind, where = self.plan.bad
            index = min(int(where * len(given)), len(given) - 1)
            manifest = batch.manifests[index]
            if kind == "errors-deleted" and not manifest.get("error_uri"):
                # The shard failed none of its requests: its results go instead.
                kind = "results-deleted"
            self.bad_kind, self.bad_index = kind, index
            results_key = manifest["output_uri"].split("/", 3)[3]
            body = self.s3.buckets[BUCKET][results_key].body
            if kind == "none":
                given[index] = None
            elif kind == "absent":
                del given[index]
            elif kind == "extra-line":
                self.put_user(
                    results_key, body + b"\n" + b'{"custom_id": "late", "response": {"status_code": 200}}'
                )
            elif kind == "lost-line":
                self.put_user(
                    results_key, b"\n".join(body.split(b"\n")[:-1]) if body else b'{"custom_id": "x"}'
                )
            elif kind == "other-bytes":
                self.put_user(results_key, body.replace(b"says", b"said") if b"says" in body else body + b" ")
            elif kind == "results-deleted":
                del self.s3.buckets[BUCKET][results_key]
            elif kind == "errors-deleted":
                del self.s3.buckets[BUCKET][manifest["error_uri"].split("/", 3)[3]]
        self.given = given

    def rewrite_during(self) -> None:
        """A user's tool drops the last line of one of run-1's shard results while the merge runs."""
        batch = self.batches.get("run-1")
        if batch is None or self.rewritten_during:
            return
        self.rewritten_during = True
        manifest = batch.manifests[self.rng.randrange(len(batch.manifests))]
        key = manifest["output_uri"].split("/", 3)[3]
        body = self.s3.buckets[BUCKET][key].body
        self.put_user(key, b"\n".join(body.split(b"\n")[:-1]) if b"\n" in body else body + b"\n{}")

    # -- the task instances ---------------------------------------------------------

    def run(self) -> None:
        """Run the earlier merge (if any), the split, the shards, run-1's merge (and run-2's) to their ends."""
        if self.plan.old_output:
            self.batches["run-0"] = self.batch_of_lines("run-0", self.rng.randint(2, 6), 3)
            self.start_try(1, "run-0")
        else:
            self.start_split(1)
        self.scheduler.run()

    def start_split(self, number: int) -> None:
        state = TryState(number, f"split/try-{number}")
        self.tries.append(state)

        def body() -> None:
            operator = VLLMBatchSplitOperator(
                task_id="split",
                input_uri=self.input_uri,
                shard_prefix=f"s3://{BUCKET}/{SHARD_PREFIX.format(run='run-1')}",
                max_requests=self.plan.max_requests,
            )
            operator.__dict__["hook"] = self.hook
            state.outcome = operator.execute({"ti": SimTI("run-1", "split", number)})  # type: ignore[arg-type]

        self.scheduler.spawn(state.label, body, state, on_exit=self.split_ended)

    def split_ended(self, actor: Any, error: BaseException | None) -> None:
        state: TryState = actor.owner
        state.error, state.ended = error, True
        if error is None:
            self.split = state.outcome
            self.finals["split"] = "success"
            self.publish_run1_shards()
            self.snapshot_output()
            self.start_try(1, "run-1")
        elif retryable(error) and state.number < MAX_TRIES:
            self.start_split(state.number + 1)
        else:
            self.finals["split"] = "failed"

    def snapshot_output(self) -> None:
        objects = self.s3.buckets[BUCKET]
        self.before_merge = {
            k: (objects[k].body if k in objects else None) for k in (MANIFEST_KEY, OUTPUT_KEY, ERRORS_KEY)
        }
        self.merge_began_call = self.s3.calls

    def start_try(self, number: int, run: str = "run-1", delay_s: float = 0.0) -> None:
        plan = self.plan
        if run == "run-1":
            state = TryState(
                number,
                f"run-1/try-{number}",
                kill_at=plan.kill_at.get(number),
                zombie_at=plan.zombie_at.get(number),
            )
        else:
            state = TryState(number, f"{run}/try-{number}")
        self.tries.append(state)

        def body() -> None:
            if delay_s:
                self.scheduler.sleep(delay_s)  # Airflow's retry_delay
            given = self.given if run == "run-1" else self.batches[run].manifests
            operator = VLLMBatchMergeOperator(
                task_id="merge",
                shard_manifests=list(given or []),
                output_uri=self.output_uri,
                input_uri=self.input_uri if run == "run-1" else None,
                retries=MAX_TRIES - 1,
            )
            operator.__dict__["hook"] = self.hook
            state.outcome = operator.execute({"ti": SimTI(run, "merge", number)})  # type: ignore[arg-type]

        self.scheduler.spawn(state.label, body, state, on_exit=self.try_ended)

    def try_ended(self, actor: Any, error: BaseException | None) -> None:
        state: TryState = actor.owner
        state.error, state.ended = error, True
        if state.zombie:
            return  # Airflow gave up on it and started its successor already; its ending is ignored.
        run = state.run
        if error is None:
            self.finals[run] = "success"
        elif retryable(error) and state.number < MAX_TRIES:
            # Airflow's retry_delay (300 s by default): longer than the lease's staleness, so a lease another
            # merge left behind (its delete failed) is stale by the retry, as a user's retries would find it.
            self.start_try(
                state.number + 1,
                run,
                delay_s=RETRY_DELAY_S if run != "run-2" else 60.0 + self.rng.random() * 240,
            )
            return
        else:
            self.finals[run] = "failed"
        self.final_tries[run] = state
        if run == "run-0":
            self.start_split(1)

    def start_second_run(self) -> None:
        """A second DAG run's merge of its own shards (other answers) into the same output_uri."""
        if "run-2" in self.batches or self.given is None:
            return
        self.batches["run-2"] = self.batch_of_lines("run-2", self.rng.randint(2, 8), self.rng.randint(2, 4))
        self.start_try(1, "run-2")

    # -- the plan's events, at steps ----------------------------------------------------

    def on_step(self, actor: Any) -> None:
        """Kills, zombies, pauses, freezes, targeted faults, rewrites and run-2's start happen at steps."""
        self.global_steps += 1
        state: TryState = actor.owner
        site = self.s3.current_site
        if site == "get lease" and actor.name == state.label:
            # The try's last lease read (its fence, or taking the lease): what Fencing/stray-write-over-newer reads.
            self.lease_read_call[state.label] = self.s3.calls
        if state.run != "run-1":
            return
        self.merge_steps += 1
        if self.plan.second_at == self.merge_steps:
            self.start_second_run()
        if self.plan.rewrite_during_at == self.merge_steps:
            self.rewrite_during()
        if site is not None:
            calls = self.site_calls[(state.label, site)] = self.site_calls.get((state.label, site), 0) + 1
            target = self.plan.target
            if (
                target is not None
                and (site, calls, state.number) == (target[0], target[2], target[3])
                and not state.zombie
            ):
                self.targeted(state, site, target[1])
        if state.kill_at is not None and state.steps >= state.kill_at and not state.dead and not state.ended:
            state.dead = True
            self.kills += 1
        elif state.zombie_at is not None and state.steps == state.zombie_at and not state.zombie:
            state.zombie = True
            self.zombies += 1
            self.start_try(state.number + 1)

    def targeted(self, state: TryState, site: str, kind: str) -> None:
        self.s3.coverage[(site, kind)] = self.s3.coverage.get((site, kind), 0) + 1
        if kind == "kill":
            state.dead = True
            self.kills += 1
        elif kind in ("zombie", "pause"):
            state.zombie = True
            self.zombies += 1
            self.start_try(state.number + 1)
            if kind == "pause" and self.plan.resume_at is not None:
                resume_site, n = self.plan.resume_at
                successor = f"run-1/try-{state.number + 1}"

                def resumed() -> bool:
                    if resume_site != "end" and self.site_calls.get((successor, resume_site), 0) >= n:
                        return True
                    later = [t for t in self.tries if t.run == "run-1" and t.number > state.number]
                    return all(t.ended for t in later)

                self.scheduler.wait_until(resumed, 4 * 3600)
        elif kind == "freeze":
            resume_site, n = self.plan.resume_at or ("end", 1)

            def thawed() -> bool:
                if resume_site != "end" and any(
                    calls >= n
                    for (label, where), calls in self.site_calls.items()
                    if where == resume_site and label.startswith("run-2/")
                ):
                    return True
                return "run-2" in self.finals

            state.frozen, state.frozen_until = thawed, self.scheduler.now + 4 * 3600
            self.start_second_run()
        else:
            self.s3.forced = kind

    # -- what the checks ask ---------------------------------------------------------------

    def batch_named(self, uris: list[str | None] | None) -> Batch | None:
        """The DAG run whose shards a merged manifest names (all of them, in order)."""
        for batch in self.batches.values():
            if list(uris or []) == batch.uris:
                return batch
        return None

    @property
    def bad_from_start(self) -> bool:
        return self.plan.bad is not None and self.given is not None


class ShardStepChecks(StepChecks):
    """The core's per-step checks (fencing, the lease rule), with a reader of the *merged* output."""

    def reader(self) -> None:
        """What a reader sees now: a merged output it takes as complete must be the sum of its shards."""
        objects = self.world.s3.buckets[BUCKET]
        raw = objects.get(MANIFEST_KEY)
        if raw is None or is_tombstone(raw.body):
            return
        try:
            manifest = Manifest.from_json(raw.body)
        except Exception:  # noqa: BLE001 - unreadable: no reader takes it
            return
        bodies = []
        # What a reader accepts (OutputStore.completed, read_answers): the files with the ETags the manifest names.
        for uri, etag in (
            (manifest.output_uri, manifest.output_etag),
            (manifest.error_uri, manifest.error_etag),
        ):
            if not uri:
                bodies.append(b"")
                continue
            obj = objects.get(uri.split("/", 3)[3])
            if obj is None or (etag is not None and obj.etag.strip('"') != etag.strip('"')):
                return
            bodies.append(obj.body)
        for detail in merge_problems(self.world, manifest, bodies[0], bodies[1]):  # type: ignore[arg-type]
            self.flag("Exactly once/reader-saw-wrong-merge", detail)


def merge_problems(world: ShardWorld, m: Manifest, results: bytes, errors: bytes) -> list[str]:
    """What is wrong with a merged output a reader takes as complete."""
    batch = world.batch_named(m.shard_manifest_uris)
    if batch is None:
        uris = set(m.shard_manifest_uris or [])
        near = [b for b in world.batches.values() if uris <= set(b.uris)]
        missing = [i for i, u in enumerate(near[0].uris) if u not in uris] if near else []
        return [
            f"the merged manifest names {len(uris)} shard(s) of no DAG run's whole split"
            + (f": {near[0].run}'s shard(s) {missing} are missing" if near else "")
        ]
    want_results, want_errors = batch.expected()
    found = []
    if results != want_results:
        got, want = Counter(results.splitlines()), Counter(want_results.splitlines())
        missing = sum((want - got).values())
        extra = sum((got - want).values())
        found.append(
            f"{batch.run}'s merged results hold {missing} shard line(s) too few and {extra} too many"
            + (" (same lines, other order or bytes)" if not missing and not extra else "")
        )
    if errors != want_errors:
        found.append(f"{batch.run}'s merged error file is not its shards' error lines once each, in order")
    counts = {
        "total": m.request_counts.total,
        "completed": m.request_counts.completed,
        "failed": m.request_counts.failed,
    }
    lines = {"completed": len(results.splitlines()), "failed": len(errors.splitlines())}
    if counts != batch.counts() or any(counts[k] != lines[k] for k in lines):
        found.append(f"the manifest counts {counts}; the shards {batch.counts()}; the merged files {lines}")
    if m.shards != len(batch.manifests):
        found.append(f"the manifest says {m.shards} shard(s), {batch.run} has {len(batch.manifests)}")
    return found


def check_shard_schedule(world: ShardWorld) -> list[Violation]:
    """Every check of one shard schedule: the per-step ones, and the final state's."""
    found = list(world.step_violations)
    found += split_exactly_once(world)
    found += merged_output(world)
    found += bad_shard(world)
    found += merge_liveness(world)
    return found


def split_exactly_once(world: ShardWorld) -> list[Violation]:
    """The split's shards hold every request line of the input once, in order."""
    if world.split is None:
        return []
    objects = world.s3.buckets[BUCKET]
    lines = []
    for kwargs in world.split:
        obj = objects.get(kwargs["input_uri"].split("/", 3)[3])
        lines += obj.body.splitlines() if obj is not None else [b"<shard file missing>"]
    want = [line for line in world.input_bytes.splitlines() if line.strip()]
    if lines != want:
        return [
            Violation(
                "Exactly once/split-lost-or-repeated-requests",
                f"{len(lines)} shard lines for {len(want)} requests",
            )
        ]
    return []


def merged_output(world: ShardWorld) -> list[Violation]:
    """A merge that succeeded left a complete merged output (unless another merge wrote it since)."""
    if world.finals.get("run-1") != "success" or "run-2" in world.batches:
        return []
    objects = world.s3.buckets[BUCKET]
    raw = objects.get(MANIFEST_KEY)
    if raw is None or is_tombstone(raw.body):
        return [
            Violation(
                "Exactly once/success-without-complete-merge", "run-1's merge succeeded; no merged manifest"
            )
        ]
    manifest = Manifest.from_json(raw.body)
    for uri, etag in ((manifest.output_uri, manifest.output_etag), (manifest.error_uri, manifest.error_etag)):
        obj = objects.get(uri.split("/", 3)[3]) if uri else None
        if uri and (obj is None or (etag and obj.etag.strip('"') != etag)):
            return [
                Violation(
                    "Exactly once/success-without-complete-merge", f"{uri} is not the file its manifest names"
                )
            ]
    if world.batch_named(manifest.shard_manifest_uris) is not world.batches["run-1"]:
        return [
            Violation("Exactly once/success-without-complete-merge", "the merged manifest is not run-1's")
        ]
    return []


def bad_shard(world: ShardWorld) -> list[Violation]:
    """A bad shard fails the merge without a retry; the merge writes nothing; the old merged output stays."""
    if not world.bad_from_start:
        return []
    found = []
    final = world.final_tries.get("run-1")
    if world.finals.get("run-1") == "success":
        found.append(
            Violation("Bad shard/merged-anyway", f"{world.bad_kind} shard {world.bad_index} was merged")
        )
    elif final is not None and not final.dead and not final.faults:
        from airflow_vllm_batch.version_compat import AirflowFailException

        if not isinstance(final.error, AirflowFailException):
            found.append(
                Violation(
                    "Bad shard/retried",
                    f"{world.bad_kind} shard {world.bad_index}: {final.label} ended with "
                    f"{type(final.error).__name__}: {str(final.error)[:200]} (retried: every try fails the same way)",
                )
            )
    wrote = [m for m in world.s3.mutations if m.try_label and m.try_label.startswith("run-1/")]
    if wrote:
        found.append(
            Violation(
                "Bad shard/published", f"{wrote[0].try_label} {wrote[0].op} {wrote[0].key} with a bad shard"
            )
        )
    if "run-2" not in world.batches:
        objects = world.s3.buckets[BUCKET]
        now = {k: (objects[k].body if k in objects else None) for k in world.before_merge}
        changed = [k for k in now if now[k] != world.before_merge[k]]
        if changed:
            found.append(
                Violation("Bad shard/old-output-changed", f"{changed} changed by a merge with a bad shard")
            )
    return found


def merge_liveness(world: ShardWorld) -> list[Violation]:
    """A merge whose last try met no fault succeeds when every shard published (and no other merge wrote the output)."""
    last = world.final_tries.get("run-1")
    if (
        last is None
        or world.finals.get("run-1") != "failed"
        or last.dead
        or last.faults
        or world.plan.bad is not None
        or world.rewritten_during
        or "run-2" in world.batches
        or world.scheduler.out_of_time
    ):
        return []
    return [
        Violation(
            "Liveness/clean-last-merge-try-failed",
            f"{last.label}: {type(last.error).__name__}: {str(last.error)[:200]}",
        )
    ]


@contextlib.contextmanager
def _virtual_merge_clock(world: ShardWorld) -> Iterator[None]:
    from airflow_vllm_batch.operators import shards

    saved = shards.time
    shards.time = _VirtualMonotonic(world.scheduler)  # type: ignore[assignment]
    try:
        yield
    finally:
        shards.time = saved


def run_shard_schedule(seed: int, workdir: Path) -> ShardWorld:
    """Run the shard plan of ``seed``; return its world for :func:`check_shard_schedule`."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    world = ShardWorld(make_shard_plan(seed), workdir)
    with simulation(world), _virtual_merge_clock(world):  # type: ignore[arg-type]
        world.run()
    world.s3.scheduler = None
    world.s3.faults = None
    return world


@dataclass
class ShardCampaign:
    """Many shard schedules: what was injected, what happened, which checks failed for which seeds."""

    schedules: int = 0
    seconds: float = 0.0
    violations: dict[str, list[int]] = field(default_factory=dict)
    details: dict[int, str] = field(default_factory=dict)
    faults: Counter = field(default_factory=Counter)
    coverage: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)

    def add(
        self, seed: int, world: ShardWorld | None, found: list[Violation], crash: str | None = None
    ) -> None:
        self.schedules += 1
        if crash is not None:
            self.violations.setdefault("simulator-crash", []).append(seed)
            self.details[seed] = crash
            return
        assert world is not None
        for check in sorted({v.check for v in found}):
            self.violations.setdefault(check, []).append(seed)
        if found:
            self.details[seed] = "; ".join(f"{v.check}: {v.detail}" for v in found)
        self.faults.update(world.faults.injected)
        self.faults.update({"merge tries killed": world.kills, "zombie merge tries": world.zombies})
        self.faults.update(
            {"second merges": int("run-2" in world.batches), "earlier outputs": int(world.plan.old_output)}
        )
        if world.plan.bad:
            self.faults[f"bad shard: {world.plan.bad[0]}"] += 1
        self.faults["rewritten while merging"] += int(world.rewritten_during)
        self.coverage.update(world.s3.coverage)
        self.outcomes[f"run-1 merge {world.finals.get('run-1', 'not run (split failed)')}"] += 1
        last = world.final_tries.get("run-1")
        if (
            last is not None
            and not (last.dead or last.faults or world.plan.bad or world.rewritten_during)
            and "run-2" not in world.batches
        ):
            self.outcomes["clean last merge try"] += 1

    def merge(self, other: ShardCampaign) -> None:
        """Add another share of the seeds (``--jobs``)."""
        self.schedules += other.schedules
        for check, seeds in other.violations.items():
            self.violations[check] = sorted(self.violations.get(check, []) + seeds)
        self.details.update(other.details)
        self.faults.update(other.faults)
        self.coverage.update(other.coverage)
        self.outcomes.update(other.outcomes)

    def coverage_table(self) -> str:
        """The (merge call site x fault kind) table: faults injected at each; ``-`` where the kind does not exist."""
        kinds = ("error", "lost_response", "slow", "outage", "conflict", "kill", "zombie", "pause", "freeze")
        lines = [f"{'site':<20}" + "".join(f"{k[:8]:>9}" for k in kinds)]
        for site in MERGE_SITES:
            have = merge_site_kinds(site)
            lines.append(
                f"{site:<20}"
                + "".join(f"{self.coverage.get((site, k), 0) if k in have else '-':>9}" for k in kinds)
            )
        return "\n".join(lines)

    def format(self, first: int = 5) -> str:
        lines = [
            f"{self.schedules} shard schedules in {self.seconds:.1f}s",
            "faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()) if v),
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            f"(site, fault kind) pairs reached: {sum(1 for s in MERGE_SITES for k in merge_site_kinds(s) if self.coverage.get((s, k)))}"
            f" of {sum(len(merge_site_kinds(s)) for s in MERGE_SITES)}",
        ]
        if not self.violations:
            lines.append("violations: 0")
        for check, seeds in sorted(self.violations.items()):
            lines.append(f"{check}: {len(seeds)} schedule(s), seeds {seeds[:first]}")
            lines.append(f"  e.g. seed {seeds[0]}: {self.details[seeds[0]][:400]}")
        if self.violations:
            seed = min(s for seeds in self.violations.values() for s in seeds)
            lines.append(f"replay: python benchmarks/simulate.py --shards --seed {seed} --trace")
        return "\n".join(lines)


def run_shard_campaign(seeds: Any, workdir: Path) -> ShardCampaign:
    """Run the shard schedules of ``seeds``, checking each."""
    import time
    import traceback

    campaign = ShardCampaign()
    started = time.perf_counter()
    for seed in seeds:
        try:
            world = run_shard_schedule(seed, workdir / "schedule")
            found = check_shard_schedule(world)
        except Exception:  # noqa: BLE001 - reported with its seed
            campaign.add(seed, None, [], traceback.format_exc(limit=-3))
            continue
        campaign.add(seed, world, found)
    campaign.seconds = time.perf_counter() - started
    return campaign
