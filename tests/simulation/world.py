"""One schedule: a seed's plan (configuration, faults, kills, zombies) and the task instance that runs under it.

:func:`make_plan` draws everything from the seed: the engine (runner or server), a batch
of 3-12 requests, the configuration (a ``results_dir`` on a disk that holds a user's old
files, an ``output_uri`` or ``error_uri`` colliding with the input, a secret
``--hf-token`` in ``engine_args``), the S3 fault rate, the engine's behaviour, and for each
try the step at which it is killed or becomes a zombie (Airflow starts its successor while
it runs on). :class:`World` then runs the task instance the way Airflow would: try 1,
and a new try (``try_number + 1``, same task instance) after every retryable failure or
kill, up to ``max_tries``, each try the real :class:`~airflow_vllm_batch.run.batch.BatchRun`
with real settings, preflight, lease, staging, check and publish, on the fake S3.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import shutil
import string
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_vllm_batch.exceptions import VLLMBatchError
from airflow_vllm_batch.lease import TaskTry
from airflow_vllm_batch.run.batch import BatchRun
from airflow_vllm_batch.run.settings import BatchSettings
from airflow_vllm_batch.storage.layout import default_error_uri
from tests.simulation.engines import SIM_ENGINES, SimRunnerProcess
from tests.simulation.s3 import FakeS3, FakeS3Client, FakeS3Hook, FaultPlan
from tests.simulation.scheduler import Scheduler, TryKilled, TryState, virtual_threading

BUCKET = "sim"
INPUT_KEY = "in/batch.jsonl"
OUTPUT_KEY = "out/results.jsonl"
#: The earlier DAG run that fills the answer cache.
PRIOR_INPUT_KEY = "earlier/batch.jsonl"
PRIOR_OUTPUT_KEY = "earlier/results.jsonl"
#: The runner's stall bound in the schedules (virtual seconds): above the longest finite stall (900 s).
SIM_STALL_TIMEOUT_S = 1000.0
#: How old the user's files beside a shared ``results_dir`` are (older than the 7-day clean-up).
USER_FILE_AGE_S = 30 * 24 * 3600


@dataclass
class Plan:
    """Everything a seed decides before the schedule runs (the interleaving is decided as it runs)."""

    seed: int
    engine: str
    requests: int
    collision: str | None
    shared_results_dir: bool
    secret: str | None
    fault_rate: float
    max_tries: int
    kill_at: dict[int, int] = field(default_factory=dict)
    zombie_at: dict[int, int] = field(default_factory=dict)
    rewrite_input_at: int | None = None
    #: With the answer cache: an earlier DAG run answered the first ``cache_prior`` requests (into the cache).
    cache_prior: int = 0
    engine_faults: dict[str, float] = field(default_factory=dict)
    #: The scheduler's chance to keep the running actor at a step (swarm testing).
    stay: float = 0.5
    #: A targeted fault: ``(site, kind, n, try)``: the ``n``-th call of try ``try`` at ``site`` meets ``kind``
    #: (an S3 fault, or ``kill``, ``zombie``, ``pause``: the try is given up there and its successor starts).
    target: tuple[str, str, int, int] | None = None
    #: With a ``pause`` target: the paused try goes on once its successor made its ``n``-th call at this site
    #: (``end``: once every later try ended).
    resume_at: tuple[str, int] | None = None
    #: A second DAG run's task instance writing the same output starts at this global step (None: none).
    second_run_at: int | None = None
    #: The fake S3 lists keys in a random order.
    shuffle_lists: bool = False
    #: The second run's input is re-uploaded first (a new identity).
    second_run_new_input: bool = False
    #: An error file an earlier run left at the error URI before this task instance began (its publish
    #: then deletes it, ``If-Match``, when it has no failures of its own).
    old_errors: bool = False
    #: A user's tool rewrites the published results (keeps all but the last line) after run-1 succeeded;
    #: a second DAG run on the same input then starts (it must notice the output changed).
    outside_rewrite: bool = False
    #: The engine's chance to fail a request (400) once the input was re-uploaded (None: as before it):
    #: another identity's answers may have failures where the first had none (an error file to race).
    fail_after_rewrite: float | None = None
    #: The chance that the worker's disk is full when the engine writes its results or a checkpoint.
    disk_full: float = 0.0
    #: With the answer cache: its entries expire (an S3 lifecycle rule on the cache's prefix) whenever a later
    #: try of run-1 starts, so the cache a retry would look up is not the one its predecessor split on.
    cache_expires: bool = False
    #: An aimed schedule (:func:`aim`): its target was drawn by the pair's rarity, its preconditions arranged.
    aimed: bool = False
    #: ``(site, try)``: try ``try`` is killed at its first step after its first call to ``site`` (what that call
    #: left in S3, staged results or staged cached answers, is there for its successor: an aimed target's
    #: precondition).
    setup_kill: tuple[str, int] | None = None

    def describe(self) -> str:
        bits = [f"engine={self.engine}", f"requests={self.requests}", f"s3_fault_rate={self.fault_rate}"]
        if self.collision:
            bits.append(f"collision={self.collision}")
        if self.shared_results_dir:
            bits.append("results_dir=shared disk")
        if self.secret:
            bits.append("secret --hf-token")
        if self.kill_at:
            bits.append(f"kill(try:step)={self.kill_at}")
        if self.zombie_at:
            bits.append(f"zombie(try:step)={self.zombie_at}")
        if self.rewrite_input_at:
            bits.append(f"input rewritten at step {self.rewrite_input_at}")
        if self.fail_after_rewrite is not None:
            bits.append(f"requests fail {self.fail_after_rewrite} once the input is re-uploaded")
        if self.disk_full:
            bits.append(f"disk full at {self.disk_full} of the engine's writes")
        if self.cache_prior:
            bits.append(f"answer cache (an earlier run answered {self.cache_prior})")
        if self.cache_expires:
            bits.append("the cache's entries expire as each retry starts")
        if self.stay != 0.5:
            bits.append(f"scheduler stay={self.stay}")
        if self.setup_kill:
            bits.append(
                f"try {self.setup_kill[1]} killed right after its first call to {self.setup_kill[0]!r}"
            )
        if self.target:
            site, kind, n, number = self.target
            bits.append(
                f"{'aimed ' if self.aimed else ''}target: {kind} at call {n} of try {number} to {site!r}"
            )
            if self.resume_at:
                bits.append(f"paused until its successor's call {self.resume_at[1]} to {self.resume_at[0]!r}")
        if self.second_run_at:
            bits.append(
                f"run-2 starts at step {self.second_run_at}"
                + (" on a re-uploaded input" if self.second_run_new_input else "")
            )
        if self.shuffle_lists:
            bits.append("listings in random order")
        if self.old_errors:
            bits.append("an earlier run's error file")
        if self.outside_rewrite:
            bits.append("a user's tool rewrites the published results, then run-2 on the same input")
        return ", ".join(bits)


def make_plan(seed: int) -> Plan:
    """Draw one schedule's plan from its seed."""
    rng = random.Random(f"plan-{seed}")
    engine = rng.choice(("sim-runner", "sim-server"))
    max_tries = 4
    plan = Plan(
        seed=seed,
        engine=engine,
        requests=rng.randint(3, 12),
        collision=rng.choice(("output=input", "error=input", "error=output"))
        if rng.random() < 0.08
        else None,
        shared_results_dir=rng.random() < 0.15,
        secret="hf_" + "".join(rng.choices(string.ascii_letters + string.digits, k=24))
        if rng.random() < 0.2
        else None,
        fault_rate=rng.choice((0.0, 0.01, 0.03, 0.06)),
        max_tries=max_tries,
    )
    for number in range(1, max_tries + 1):
        roll = rng.random()
        if roll < 0.25:
            plan.kill_at[number] = rng.randint(1, 45)
        elif roll < 0.45 and number < max_tries:
            plan.zombie_at[number] = rng.randint(1, 45)
    if rng.random() < 0.05:
        plan.rewrite_input_at = rng.randint(1, 80)
    if rng.random() < 0.15:
        plan.cache_prior = rng.randint(1, plan.requests)
    if engine == "sim-runner":
        plan.engine_faults = {
            "crash": rng.choice((0, 0.02)),
            "die": rng.choice((0, 0.03)),
            "fail": rng.choice((0, 0.1)),
            "stall": 0.02,
        }
    else:
        plan.engine_faults = {
            "die": rng.choice((0, 0.03)),
            "transient": rng.choice((0, 0.08)),
            "twice": rng.choice((0, 0.15)),
            "fail": rng.choice((0, 0.1)),
            "stall": 0.02,
        }
    # Drawn after the rest, so that the fields above stay what they were for every seed.
    plan.stay = rng.choice((0.1, 0.5, 0.5, 0.9))
    # Biased search: a third of the schedules pause one try at one call site until its successor reaches
    # another (the narrow windows of two tries around a step), a third target one fault at one site.
    mode = rng.random()
    if mode < 0.75:
        sites = [
            s
            for s in SITES
            if s not in ENGINE_NEVER[engine]
            and (plan.cache_prior or ("cached" not in s and "cache" not in s))
        ]
        pause = mode < 0.45
        site = rng.choice([s for s in PUBLISH_SITES if s in sites] if pause and rng.random() < 0.6 else sites)
        kind = "pause" if pause else rng.choice([k for k in site_kinds(site) if k != "pause"])
        nth = rng.choice((1, 2)) if site == "put manifest" else rng.choices((1, 2, 3), weights=(8, 1, 1))[0]
        plan.target = (site, kind, nth, rng.choices((1, 2, 3), weights=(6, 3, 1))[0])
        # The targeted try meets its target: no random kill or zombie of its own comes first.
        plan.kill_at.pop(plan.target[3], None)
        plan.zombie_at.pop(plan.target[3], None)
        if kind == "pause":
            # Often only once the successor ended: a try paused right after its lease check then writes over a finished output.
            roll = rng.random()
            # Once the successor ended; or at the very step the paused try is at (two tries at one step); or elsewhere.
            resume = "end" if roll < 0.45 else site if roll < 0.65 else rng.choice(RESUME_SITES)
            plan.resume_at = (resume, rng.choices((1, 2), weights=(3, 1))[0])
    if rng.random() < 0.12:
        plan.second_run_at = rng.randint(1, 120)
        # Half of them run on a re-uploaded input: another identity, which legitimately replaces the output.
        plan.second_run_new_input = rng.random() < 0.5
    plan.shuffle_lists = rng.random() < 0.3
    # Drawn last (the fields above stay what they were for every seed). A frozen process: the targeted
    # try and all its threads (the heartbeat too) stop right after the fence of one of its writes, for
    # longer than the lease's staleness, while a later DAG run on a re-uploaded input (another identity,
    # other answers) takes the stale lease over and publishes; then it goes on. The window each
    # publishing write's condition exists for (docs/protocol.md, step 9).
    roll = rng.random()
    if roll < 0.12 and plan.collision is None:
        sites = [s for s in FREEZE_SITES if s not in ENGINE_NEVER[engine]]
        site = rng.choice(sites)
        plan.target = (site, "freeze", 1, rng.choices((1, 2), weights=(3, 1))[0])
        plan.kill_at.pop(plan.target[3], None)
        plan.zombie_at.pop(plan.target[3], None)
        plan.resume_at = ("end", 1) if rng.random() < 0.6 else (rng.choice(RESUME_SITES), 1)
        plan.second_run_at, plan.second_run_new_input = None, True
        # The frozen step exists only with failed lines (an error file to write) or an earlier one to delete.
        plan.old_errors = site == "delete errors" or rng.random() < 0.3
        if site == "put errors":
            plan.engine_faults["fail"] = 0.15
        elif site == "delete errors":
            # The frozen try has no failed lines (it deletes the earlier error file); the other identity has some.
            plan.engine_faults["fail"], plan.fail_after_rewrite = 0.0, 0.3
    elif roll < 0.18 and plan.collision is None:
        plan.outside_rewrite = True
        plan.second_run_at = None
    elif roll < 0.22:
        plan.old_errors = True
    elif roll < 0.34:
        # Two tries' engines at once: a try given up (or paused) while its engine answers, its successor
        # starting from the same staging, engines that die often (each death checkpoints what was answered):
        # the window where two tries checkpoint the same requests, or the same part number.
        # Or paused right after the fence of its checkpoint, until its successor listed the parts (and began).
        number = rng.choice((1, 2))
        kind = rng.choice(("zombie", "pause"))
        if rng.random() < 0.5:
            plan.target = ("engine request", kind, rng.randint(1, max(1, plan.requests // 2)), number)
        else:
            plan.target = ("put staging parts", "pause", 1, number)
        plan.kill_at.pop(number, None)
        plan.zombie_at.pop(number, None)
        plan.resume_at = (
            rng.choice(
                ("engine request", "list staging parts", "put staging parts", "put staging results", "end")
            ),
            1,
        )
        plan.engine_faults["die"] = rng.choice((0.1, 0.2))
    elif roll < 0.42:
        # Two tries taking over one lease at the same call: the lease's holder dies (its lease stays),
        # its successor is paused right before its take-over until the next try reaches that same write.
        # Try 4, the last, is the newer of the two: losing that race must not fail the task.
        number = 3
        plan.kill_at[1], plan.kill_at[2] = rng.randint(4, 30), rng.randint(8, 30)
        plan.zombie_at.pop(1, None)
        plan.zombie_at.pop(2, None)
        plan.target = ("put lease", "pause", 1, number)
        plan.kill_at.pop(number, None)
        plan.zombie_at.pop(number, None)
        plan.resume_at = ("put lease", 1)
    if engine == "sim-server":
        # An answer the results check cannot accept (cut short, or to a request not in the input).
        plan.engine_faults["garbled"] = rng.choice((0, 0, 0.05))
    plan.disk_full = rng.choice((0.0, 0.0, 0.0, 0.15))
    if engine == "sim-runner":
        # Last, and last of the engine's faults.
        plan.engine_faults["wedge"] = rng.choice((0, 0.04))
    if plan.cache_prior:
        # Drawn after everything else but the aim (and only with a cache), so every other seed's plan
        # stays as it was.
        # A cache that changes between two tries of one run: the retry must still give the engine the
        # misses of the try whose staged answers it resumes (the staged hits, docs/protocol.md step 6).
        plan.cache_expires = rng.random() < 0.5
    # Drawn last of all, so that every field above stays what it was for every seed (the seeds named in
    # docs/contributing/simulator.md replay as before unless this draw aims them).
    if rng.random() < AIM_SHARE:
        aim(plan, rng)
    return plan


#: The share of schedules whose target is aimed at a (site, fault kind) pair by its rarity (:func:`aim`).
AIM_SHARE = 0.1
#: The sites whose call only happens when an earlier try of the run left something in S3: the call of that
#: earlier try that leaves it (the aimed target is then in try 2, and try 1 is killed right after that call).
AIM_NEEDS_PREDECESSOR = {
    # The runner's resume: no parts, but results an earlier try staged (runner.produce), read by the check.
    "get staging results": "put staging results",
    # The answer cache's resume: hits an earlier try staged (AnswerCache.split).
    "get staging cached": "put staging cached",
}


@functools.cache
def reference_coverage() -> dict[tuple[str, str], int]:
    """How often the un-aimed generator reached each (site, fault kind) pair in 20,000 schedules (a static table)."""
    saved = json.loads((Path(__file__).parent / "coverage_reference.json").read_text())
    return {(site, kind): n for site, kind, n in saved["coverage"]}


def aim(plan: Plan, rng: random.Random) -> None:
    """Aim the plan's target at a (site, fault kind) pair drawn by rarity, and arrange what the site needs.

    The weights are ``1 / (1 + n)``, ``n`` the pair's count in :func:`reference_coverage` (a pair
    missing from it, a new site, weighs most): a static table, not the running campaign's counts,
    so that a plan still depends on its seed alone (replay is exact, chunks of a campaign run in
    any order). The freeze pairs are left to their own mode (a second DAG run on another input).

    A site is reached only when its step happens: the runner's sites need the runner engine, the
    answer cache's an earlier run's cached answers, ``put errors`` failed lines, ``delete errors``
    an earlier error file and no failed line, ``copy results`` a staged results file with no failed
    line and no cached answer, ``put staging deaths`` an engine that dies, and the two resume reads
    (:data:`AIM_NEEDS_PREDECESSOR`) an earlier try killed right after it staged what they read.
    """
    reference = reference_coverage()
    pairs = [(s, k) for s in SITES for k in site_kinds(s) if k != "freeze"]
    site, kind = rng.choices(pairs, weights=[1 / (1 + reference.get(p, 0)) for p in pairs])[0]
    plan.aimed = True
    if site in ENGINE_NEVER["sim-server"] and plan.engine != "sim-runner":
        plan.engine = "sim-runner"
        plan.engine_faults = {"crash": 0, "die": 0, "fail": 0, "stall": 0.02, "wedge": 0}
    faults = plan.engine_faults
    if "cache" in site and not plan.cache_prior:
        plan.cache_prior = rng.randint(1, plan.requests)
    number = 1
    if site in AIM_NEEDS_PREDECESSOR:
        # The earlier try must stage them: an engine that lives, a disk with room.
        number = 2
        plan.setup_kill = (AIM_NEEDS_PREDECESSOR[site], 1)
        faults.update(dict.fromkeys(set(faults) & {"crash", "die", "wedge"}, 0))
        plan.disk_full = 0.0
        plan.kill_at.pop(1, None)
        plan.zombie_at.pop(1, None)
    elif site in ("delete errors", "copy results"):
        # No failed line (and for the copy, no cached answer: the staged results file is the output).
        faults.update(
            dict.fromkeys(set(faults) & {"crash", "die", "wedge", "fail", "garbled", "transient"}, 0)
        )
        plan.disk_full, plan.fail_after_rewrite = 0.0, None
        if site == "delete errors":
            plan.old_errors, plan.collision = True, None
        else:
            plan.cache_prior = 0
    elif site == "put errors":
        faults["fail"] = max(faults.get("fail", 0), 0.3)
    elif site == "put staging deaths":
        faults["die"] = max(faults.get("die", 0), 0.3)
    if site == "engine request":
        nth = rng.randint(1, plan.requests)
    else:
        nth = rng.choice((1, 2)) if site == "put manifest" else 1
    plan.target = (site, kind, nth, number)
    plan.kill_at.pop(number, None)
    plan.zombie_at.pop(number, None)
    plan.resume_at = None
    if kind == "pause":
        roll = rng.random()
        resume = "end" if roll < 0.45 else site if roll < 0.65 else rng.choice(RESUME_SITES)
        plan.resume_at = (resume, rng.choices((1, 2), weights=(3, 1))[0])


#: The S3 call sites of a run (operation, object), as :func:`site_of` names them; the heartbeat's lease
#: writes and the engine's requests included. Every one is a step boundary of docs/protocol.md.
SITES: tuple[str, ...] = (
    "head bucket",
    "put probe",
    "delete probe",
    "head input",
    "get input",
    "get manifest",
    "head manifest",
    "put manifest",
    "head results",
    "put results",
    "copy results",
    "head errors",
    "put errors",
    "delete errors",
    "get lease",
    "put lease",
    "delete lease",
    "list staging parts",
    "get staging parts",
    "put staging parts",
    "head staging results",
    "get staging results",
    "put staging results",
    "delete staging results",
    "head staging cached",
    "get staging cached",
    "put staging cached",
    "list staging deaths",
    "put staging deaths",
    "list staging",
    "delete staging",
    "list cache",
    "get cache",
    "put cache",
    "engine request",
)
#: The sites one engine never reaches (its staging is parts, or one results file).
ENGINE_NEVER = {
    "sim-server": frozenset(
        {
            "copy results",
            "head staging results",
            "get staging results",
            "put staging results",
            "delete staging results",
            "list staging deaths",
            "put staging deaths",
        }
    ),
    "sim-runner": frozenset(),
}
#: Publishing's steps (and the lease read of each one's fence): half the pauses are at one of these.
PUBLISH_SITES: tuple[str, ...] = (
    "head manifest",
    "put manifest",
    "head results",
    "put results",
    "copy results",
    "head errors",
    "put errors",
    "delete errors",
    "list staging",
    "delete staging",
)
#: Where a process may be frozen (the whole try, its heartbeat too): right after the fence of a write.
FREEZE_SITES: tuple[str, ...] = (
    "put manifest",
    "put results",
    "copy results",
    "put errors",
    "delete errors",
    "delete staging",
    "put staging parts",
    "put staging results",
)
#: Where a paused try may go on: its successor at a step of taking the lease, staging or publishing.
RESUME_SITES: tuple[str, ...] = (
    "put lease",
    "list staging parts",
    "put staging parts",
    "put staging results",
    "head manifest",
    "put manifest",
    "put results",
    "copy results",
    "put errors",
    "delete errors",
    "delete staging",
    "engine request",
)
#: The fault kinds of a try: killed at the call, given up there (a zombie beside its successor), paused there
#: (and, at :data:`FREEZE_SITES`, its process frozen there while another DAG run publishes).
TRY_KINDS = ("kill", "zombie", "pause")
#: The sites whose writes are conditional (409 there is S3's answer to a racing conditional write).
CONDITIONAL_SITES = frozenset(
    {
        "put manifest",
        "put results",
        "copy results",
        "put errors",
        "delete errors",
        "put lease",
        "delete lease",
    }
)


def site_kinds(site: str) -> tuple[str, ...]:
    """The fault kinds that exist at ``site``."""
    if site == "engine request":
        return TRY_KINDS
    kinds = ("error", "lost_response", "slow", "outage", *TRY_KINDS)
    if site in FREEZE_SITES:
        kinds += ("freeze",)
    if site in CONDITIONAL_SITES:
        kinds += ("conflict",)
    if site in ("delete staging", "delete staging results"):
        kinds += ("partial",)
    return kinds


def site_of(op: str, key: str, output_key: str, input_key: str) -> str:
    """The call site of an S3 call: its operation and the kind of object (see :data:`SITES`)."""
    verb = {
        "get_object": "get",
        "head_object": "head",
        "put_object": "put",
        "upload_file": "put",
        "upload_fileobj": "put",
        "copy_object": "copy",
        "copy": "copy",
        "delete_object": "delete",
        "delete_objects": "delete",
        "list_objects_v2": "list",
        "head_bucket": "head",
    }.get(op, op)
    stem = output_key.removesuffix(".jsonl")
    if op == "head_bucket":
        what = "bucket"
    elif ".probe-" in key:
        what = "probe"
    elif key.startswith("cache/"):
        what = "cache"
    elif ".staging/" in key:
        rest = key.split(".staging/", 1)[1].split("/", 1)[1] if "/" in key.split(".staging/", 1)[1] else ""
        what = "staging" + (
            " parts"
            if rest.startswith("parts/")
            else " deaths"
            if rest.startswith("deaths/")
            else " results"
            if rest == "results.jsonl"
            else " cached"
            if rest.startswith("cached-")
            else " input"
            if rest == "input.jsonl"
            else ""
        )
    elif key == input_key:
        what = "input"
    elif key.endswith(".lease.json"):
        what = "lease"
    elif key.endswith(".manifest.json"):
        what = "manifest"
    elif key == output_key:
        what = "results"
    elif key.endswith(".errors.jsonl") or key == f"{stem}.errors.jsonl":
        what = "errors"
    elif ".requests/" in key:
        what = "requests"
    else:
        what = "other"
    return f"{verb} {what}"


def request_lines(n: int, version: int) -> bytes:
    """The batch file: ``n`` chat requests; ``version`` changes their content (a user re-uploading the input).

    Two of every three are greedy (``temperature: 0``): the answer cache keeps those (a sampling request is not cacheable).
    """
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"hi {i} v{version}"}],
                    **({"temperature": 0} if i % 3 != 2 else {}),
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


@dataclass
class LogLine:
    try_label: str | None
    message: str
    lease_holder: str | None
    #: The S3 calls made before this line: orders it among ``FakeS3.mutations`` (their ``step``).
    step: int = 0


class _Capture(logging.Handler):
    def __init__(self, world: World) -> None:
        super().__init__(logging.DEBUG)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        actor = self.world.scheduler.current_actor()
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is not the simulator's failure
            message = str(record.msg)
        self.world.logs.append(
            LogLine(
                actor.try_label if actor else None, message, self.world.s3.lease_holder(), self.world.s3.calls
            )
        )
        self.world.s3.note(
            f"{(actor.try_label or actor.name) if actor else '-':<14} log {record.levelname}: {message[:300]}"
        )


class World:
    """The task instance of one plan, run on the fake S3 under the scheduler.

    :param plan: the plan.
    :param workdir: an empty directory: the worker's disk.
    """

    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.scheduler = Scheduler(self.rng, on_step=self.on_step, stay=plan.stay)
        self.faults = FaultPlan(self.rng, plan.fault_rate)
        self.lease_key = (BUCKET, OUTPUT_KEY.removesuffix(".jsonl") + ".lease.json")
        self.s3 = FakeS3(self.scheduler, self.faults, lease_key=self.lease_key)
        self.s3.shuffle_lists = plan.shuffle_lists
        #: ``(try label, site) -> calls`` of each try at each site (targets and pauses count them).
        self.site_calls: dict[tuple[str, str], int] = {}
        #: try label -> the global step of its last read of the lease, and of its staging.
        self.last_lease_read: dict[str, int] = {}
        #: try label -> the S3 call count at its main thread's last read of the lease (a fence, or taking it).
        self.lease_read_call: dict[str, int] = {}
        #: The S3 call count when the user's tool rewrote the published results (None: it did not).
        self.outside_rewrite_call: int | None = None
        #: How many times the answer cache's entries expired (``Plan.cache_expires``).
        self.cache_expiries = 0
        self.last_staging_read: dict[str, int] = {}
        #: Tries whose engine began answering.
        self.engine_started: set[str] = set()
        #: try label -> virtual time its runner wedged (no progress ever again), and when its engine was stopped.
        self.wedged: dict[str, float] = {}
        self.engine_stopped_at: dict[str, float] = {}
        #: The outcome of each task instance (``run-1``, and ``run-2`` when the plan has one).
        self.finals: dict[str, str] = {}
        #: Violations the per-step checks found while the schedule ran (:mod:`tests.simulation.invariants`).
        self.step_violations: list[Any] = []
        self.hook = FakeS3Hook(FakeS3Client(self.s3))
        self.workdir = workdir
        self.tries: list[TryState] = []
        self.logs: list[LogLine] = []
        self.final: str | None = None
        #: The try whose ending ended the task instance (run-1).
        self.final_try: TryState | None = None
        self.global_steps = 0
        self.input_version = 1
        #: The input's content by ETag (what each manifest's input_etag names).
        self.inputs: dict[str, dict[str, str]] = {}
        #: (try, run short, custom_id, whether its final answer was durable before the try's engine began).
        self.sent: list[tuple[str, str, str, bool]] = []
        self.engine_events: dict[str, int] = {}
        self.kills = 0
        #: Engine steps of this task instance's tries (not the earlier run's that filled the cache).
        self.task_engine_steps = 0
        self.zombies = 0
        #: What each try had read of staging when its engine began (key -> body), for the no-resend check.
        self.seen_at_engine_start: dict[str, dict[str, bytes]] = {}
        self.user_files: dict[Path, bytes] = {}
        self.settings_values = self._settings_values()
        output_key, input_key = self.output_uri.split("/", 3)[3], INPUT_KEY
        self.s3.site_of = lambda op, bucket, key: site_of(op, key, output_key, input_key)
        from tests.simulation.invariants import StepChecks

        self.step_checks = StepChecks(self)
        self.s3.on_change = self.step_checks.after_change

    # -- set-up -------------------------------------------------------------------

    def _settings_values(self) -> dict[str, Any]:
        plan = self.plan
        self.s3.create_bucket(BUCKET)
        input_uri = f"s3://{BUCKET}/{INPUT_KEY}"
        output_uri = f"s3://{BUCKET}/{OUTPUT_KEY}"
        error_uri = None
        if plan.collision == "output=input":
            output_uri = input_uri
            self.lease_key = (BUCKET, INPUT_KEY.removesuffix(".jsonl") + ".lease.json")
            self.s3.lease_key = self.lease_key
        elif plan.collision == "error=input":
            error_uri = input_uri
        elif plan.collision == "error=output":
            error_uri = output_uri
        self.input_uri, self.output_uri, self.error_uri = input_uri, output_uri, error_uri
        self.write_input()
        if plan.shared_results_dir:
            results_dir = self.workdir / "disk"
            for name, data in (("notes.txt", b"my notes\n"), ("models/llama/weights.bin", b"\x00weights")):
                path = results_dir / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                old = time.time() - USER_FILE_AGE_S
                os.utime(path, (old, old))
                self.user_files[path] = data
            old = time.time() - USER_FILE_AGE_S
            os.utime(results_dir / "models/llama", (old, old))
            os.utime(results_dir / "models", (old, old))
        else:
            results_dir = self.workdir / "results"
        engine_args = ["--max-model-len", "512"] + (["--hf-token", plan.secret] if plan.secret else [])
        bound = {"stall_timeout": SIM_STALL_TIMEOUT_S} if plan.engine == "sim-runner" else {}
        if plan.old_errors and plan.collision is None:
            # An earlier run's error file (its run was killed before its manifest, or its manifest was removed).
            ekey = default_error_uri(output_uri).split("/", 3)[3]
            self.s3.put(
                BUCKET, ekey, b'{"custom_id": "old-0", "response": null, "error": {"message": "old"}}\n'
            )
            self.s3.buckets[BUCKET][ekey].writer = "earlier"
        if plan.cache_prior:
            self.s3.put(
                BUCKET,
                PRIOR_INPUT_KEY,
                b"".join(request_lines(plan.requests, 1).splitlines(keepends=True)[: plan.cache_prior]),
            )
        return {
            "answer_cache_uri": f"s3://{BUCKET}/cache/" if plan.cache_prior else None,
            "input_uri": input_uri,
            "output_uri": output_uri,
            "error_uri": error_uri,
            "model": "m",
            "engine": SIM_ENGINES[plan.engine](args=engine_args, **bound),
            "results_dir": str(results_dir),
            "max_failed_ratio": 1.0,
        }

    def write_input(self) -> None:
        """The user writes (or re-writes) the input: outside every try, no step, no fault."""
        data = request_lines(self.plan.requests, self.input_version)
        self.s3.put(BUCKET, INPUT_KEY, data)
        etag = self.s3.buckets[BUCKET][INPUT_KEY].etag.strip('"')
        self.inputs[etag] = {
            json.loads(line)["custom_id"]: json.loads(line)["body"]["messages"][-1]["content"]
            for line in data.splitlines()
        }
        self.s3.buckets[BUCKET][INPUT_KEY].writer = "user"
        self.input_bytes = data
        for t in getattr(self, "tries", []):
            if not t.ended:
                t.inputs_seen.add(etag)
        self.input_etag = etag

    # -- the task instance -----------------------------------------------------------

    def run(self) -> None:
        """Run the task instance to its end: every try, zombie and heartbeat thread (after the earlier run, with the cache)."""
        if self.plan.cache_prior:
            prior = TryState(1, "prior/try-1")
            self.tries.append(prior)
            self.scheduler.spawn(
                prior.label, lambda: self.run_try(prior), prior, on_exit=lambda *_: self.start_try(1)
            )
        else:
            self.start_try(1)
        self.scheduler.run()

    def start_try(self, number: int, run: str = "run-1", delay_s: float = 0.0) -> None:
        plan = self.plan
        if plan.cache_expires and run == "run-1" and number > 1:
            self.expire_cache()
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
            state.inputs_seen.add(self.input_etag)
            self.run_try(state)

        self.scheduler.spawn(state.label, body, state, on_exit=self.try_ended)

    def run_try(self, state: TryState) -> None:
        log = logging.getLogger("sim.task")
        values = self.settings_values
        if state.label.startswith("prior/"):
            values = {
                **values,
                "input_uri": f"s3://{BUCKET}/{PRIOR_INPUT_KEY}",
                "output_uri": f"s3://{BUCKET}/{PRIOR_OUTPUT_KEY}",
                "error_uri": None,
            }
        settings = BatchSettings.from_rendered(**values)
        engine = settings.engine.engine_class()(settings, log)
        engine.world = self  # type: ignore[attr-defined]
        task = TaskTry(
            dag_id="sim",
            run_id=state.run if state.run != "prior" else "run-1",
            map_index=-1,
            task_id="batch" if not state.label.startswith("prior/") else "earlier_batch",
            try_number=state.number,
            last_try=state.number >= self.plan.max_tries,
        )
        state.outcome = BatchRun(settings, s3_hook=self.hook, engine=engine, task=task, log=log).execute()

    def try_ended(self, actor: Any, error: BaseException | None) -> None:
        state: TryState = actor.owner
        state.error, state.ended = error, True
        if state.zombie:
            return  # Airflow gave up on it and started its successor already; its ending is ignored.
        if error is None:
            self.finals[state.run] = "success"
            self.step_checks.returned(state)
            if self.plan.outside_rewrite and state.run == "run-1" and self.outside_rewrite_call is None:
                self.rewrite_output()
                self.start_second_run()
        elif retryable(error) and state.number < self.plan.max_tries:
            self.start_try(
                state.number + 1,
                state.run,
                delay_s=0.0 if state.run == "run-1" else 60.0 + self.rng.random() * 240,
            )
        else:
            self.finals[state.run] = "failed"
        if state.run == "run-1":
            self.final = self.finals.get("run-1")
            self.final_try = state

    def on_step(self, actor: Any) -> None:
        """Kills, zombies, pauses, targeted faults and input rewrites happen at steps."""
        self.global_steps += 1
        state: TryState = actor.owner
        if self.plan.second_run_at == self.global_steps:
            self.start_second_run()
        if state.label.startswith("prior/"):
            return
        site = self.s3.current_site
        if site == "get lease":
            self.last_lease_read[state.label] = self.global_steps
            if actor.name == state.label:
                self.lease_read_call[state.label] = self.s3.calls
        elif site is not None and site.split(" ")[0] in ("list", "get", "head") and " staging" in site:
            self.last_staging_read[state.label] = self.global_steps
        setup = self.plan.setup_kill
        if (
            setup is not None
            and state.label == f"run-1/try-{setup[1]}"
            and self.site_calls.get((state.label, setup[0]))
            and not state.dead
            and not state.ended
        ):
            # An aimed target's precondition: this try dies right after it staged what its successor resumes from.
            state.dead = True
            self.kills += 1
        if site is not None:
            calls = self.site_calls[(state.label, site)] = self.site_calls.get((state.label, site), 0) + 1
            target = self.plan.target
            if (
                target is not None
                and state.run == "run-1"
                and (site, calls, state.number) == (target[0], target[2], target[3])
                and not state.zombie
            ):
                self.targeted(actor, state, site, target[1])
        if state.kill_at is not None and state.steps >= state.kill_at and not state.dead and not state.ended:
            state.dead = True
            self.kills += 1
        elif state.zombie_at is not None and state.steps == state.zombie_at and not state.zombie:
            state.zombie = True
            self.zombies += 1
            self.start_try(state.number + 1)
        if self.plan.rewrite_input_at == self.global_steps and self.plan.collision is None:
            self.input_version += 1
            self.write_input()

    def start_second_run(self) -> None:
        """A second DAG run's task instance on the same output (on a re-uploaded input when the plan says so)."""
        if any(t.run == "run-2" for t in self.tries):
            return
        if self.plan.second_run_new_input and self.plan.collision is None:
            self.input_version += 1
            self.write_input()
        self.start_try(1, "run-2")

    def expire_cache(self) -> None:
        """The cache's lifecycle rule removes its entries: outside every try, no step, no fault."""
        for key in [k for k in self.s3.buckets[BUCKET] if k.startswith("cache/")]:
            del self.s3.buckets[BUCKET][key]
        self.cache_expiries += 1

    def rewrite_output(self) -> None:
        """A user's tool rewrites the published results (drops the last line): outside every try, no fault."""
        bucket, key = BUCKET, self.output_uri.split("/", 3)[3]
        obj = self.s3.buckets[bucket].get(key)
        if obj is None:
            return
        lines = obj.body.splitlines(keepends=True)
        self.s3.put(bucket, key, b"".join(lines[:-1]) if len(lines) > 1 else b"")
        self.s3.buckets[bucket][key].writer = "user"
        self.outside_rewrite_call = self.s3.calls
        self.step_checks.versions[key] = (self.s3.calls, None, True)

    def targeted(self, actor: Any, state: TryState, site: str, kind: str) -> None:
        """The plan's targeted fault, at this call of this try."""
        if kind in (*TRY_KINDS, "freeze"):
            # An S3 fault is counted where it is injected (FakeS3.note_fault), as the kind it became there.
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
                    later = [t for t in self.tries if t.run == "run-1" and t.number > state.number]
                    if resume_site != "end" and self.site_calls.get((successor, resume_site), 0) >= n:
                        return True
                    return all(t.ended for t in later)

                # Paused right before this call, until the successor reaches its step: the narrow window between them.
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
        elif site != "engine request":
            self.s3.forced = kind

    # -- what the engine stand-ins ask -------------------------------------------------

    def engine_fate(self, runner: bool) -> str:
        """One request's step: maybe killed or preempted here; then what the engine does with it."""
        self.s3.current_site = "engine request"
        actor = self.scheduler.current_actor()
        if actor is not None and actor.owner is not None and actor.try_label not in self.engine_started:
            self.engine_started.add(actor.try_label)
            self.step_checks.engine_starts(actor.try_label)
        self.scheduler.step("engine.request")
        if actor is not None and actor.try_label not in self.seen_at_engine_start:
            # What the try knew of staging: what its reads of it returned before the engine began.
            self.seen_at_engine_start[actor.try_label] = dict(self.s3.staging_seen.get(actor.try_label, {}))
        self.scheduler.sleep(0.5 + self.rng.random() * 4)
        fate = "ok"
        for kind, planned in self.plan.engine_faults.items():
            chance = planned
            if kind == "fail" and self.plan.fail_after_rewrite is not None and self.input_version > 1:
                chance = self.plan.fail_after_rewrite
            if chance and self.rng.random() < chance:
                fate = kind
                break
        self.engine_events[fate] = self.engine_events.get(fate, 0) + 1
        if fate in ("die", "crash", "wedge", "garbled") and actor is not None and actor.owner is not None:
            # Failed (400), repeated and transient (429/5xx) answers are the protocol's to settle: a last try with
            # only those publishes (its set-aside lines as failed lines). A dying engine is a fault.
            actor.owner.faults += 1
        if actor is not None and actor.try_label and actor.try_label.startswith("run-1/"):
            self.task_engine_steps += 1
        if fate == "stall":
            # Slow but within the runner's stall bound (SIM_STALL_TIMEOUT_S): never stopped for it.
            self.scheduler.sleep(100 + self.rng.random() * 800)
            fate = "ok"
        if fate == "wedge" and actor is not None and actor.try_label:
            self.wedged[actor.try_label] = self.scheduler.now
        return fate

    def engine_stopped(self, process: Any) -> None:
        """The runner's engine was stopped (its stall bound, or an ending try): when, for Bounded."""
        actor = self.scheduler.current_actor()
        if actor is not None and actor.try_label:
            self.engine_stopped_at.setdefault(actor.try_label, self.scheduler.now)

    def disk_is_full(self) -> bool:
        """Whether the worker's disk is full at this write of the engine's (a fault of the try that meets it)."""
        if not self.plan.disk_full or self.rng.random() >= self.plan.disk_full:
            return False
        actor = self.scheduler.current_actor()
        if actor is not None and actor.owner is not None:
            actor.owner.faults += 1
        self.engine_events["disk_full"] = self.engine_events.get("disk_full", 0) + 1
        return True

    def note_sent(self, custom_id: str, work: Path) -> None:
        """The engine gave ``custom_id`` a final answer in this try (for the no-resend check)."""
        actor = self.scheduler.current_actor()
        label = actor.try_label if actor is not None else "-"
        short = work.name.split("-try-")[0]
        seen = self.seen_at_engine_start.get(label, self.s3.staging_seen.get(label, {}))
        durable = self.durable_before(short, custom_id, seen)
        self.sent.append((label, short, custom_id, durable))
        self.s3.trace.append(
            f"{self.s3.calls:5d} {label:<14} engine answered {custom_id}{' (durable in what it read)' if durable else ''}"
        )

    def durable_before(self, short: str, custom_id: str, seen: dict[str, bytes]) -> bool:
        """Whether a staging object the try read (``seen``: key -> body as read) holds a final answer to ``custom_id`` and is still there.

        Only what the try's reads returned counts: a part a paused zombie wrote after the try
        listed the parts is in no listing the try made, and no try can skip what it cannot see.
        """
        from tests.simulation.invariants import durable_answers, first_input, staging_prefix

        prefix = staging_prefix(self.output_uri, short)
        for key, body in seen.items():
            obj = self.s3.buckets[BUCKET].get(key)
            if (
                key.startswith(prefix)
                and obj is not None
                and obj.body == body
                and custom_id in durable_answers(body, first_input(self))
            ):
                return True
        return False

    def read_engine_input(self, location: str) -> list[dict]:
        """What the runner reads: a presigned GET of the fake S3, or a local cleaned copy."""
        if location.startswith("http://s3.sim/"):
            bucket, key = location.removeprefix("http://s3.sim/").split("?")[0].split("/", 1)
            data = self.s3.buckets[bucket][key].body
        else:
            data = Path(location).read_bytes()
        return [json.loads(line) for line in data.splitlines() if line.strip()]


def engine_argv(argv: list[str], env: dict[str, str] | None) -> list[str]:
    """The runner's arguments as vLLM sees them (``conceal_arguments`` moves them into the environment)."""
    hidden = (env or {}).get("AIRFLOW_VLLM_BATCH_ENGINE_ARGV")
    return [*argv[:1], "-m", argv[-1], *json.loads(hidden)] if hidden else list(argv)


def retryable(error: BaseException) -> bool:
    """Whether Airflow retries a try that ended with ``error`` (the operator fails a non-retryable VLLMBatchError)."""
    if isinstance(error, TryKilled):
        return True
    if isinstance(error, VLLMBatchError):
        return error.retryable
    from airflow_vllm_batch.version_compat import AirflowFailException

    return not isinstance(error, AirflowFailException)


@contextlib.contextmanager
def simulation(world: World) -> Iterator[None]:
    """Install the schedule's stand-ins: the engines, the runner's process, the lease's threads, log capture."""
    from airflow_vllm_batch.hooks import vllm as vllm_engine

    saved_start = vllm_engine.start_bound_process
    vllm_engine.start_bound_process = lambda argv, env=None, **_: SimRunnerProcess(
        world, engine_argv(argv, env)
    )  # type: ignore[assignment]
    # Object names the run code draws at random (probes, the parts' try tokens) come from the seed too.
    saved_uuid4 = uuid.uuid4
    uuid.uuid4 = lambda: uuid.UUID(int=world.rng.getrandbits(128), version=4)  # type: ignore[assignment]
    capture = _Capture(world)
    loggers = [logging.getLogger(name) for name in ("sim.task", "airflow_vllm_batch", "airflow.task.hooks")]
    saved_levels = [(lg, lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(capture)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        with virtual_threading(world.scheduler):
            yield
    finally:
        for lg, level, propagate in saved_levels:
            lg.removeHandler(capture)
            lg.setLevel(level)
            lg.propagate = propagate
        vllm_engine.start_bound_process = saved_start
        uuid.uuid4 = saved_uuid4  # type: ignore[assignment]


def run_schedule(seed: int, workdir: Path) -> World:
    """Run the schedule of ``seed`` in ``workdir`` (emptied first); return its world for the invariants."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    world = World(make_plan(seed), workdir)
    with simulation(world):
        world.run()
    world.s3.scheduler = None  # the checks read the final state: no steps, no faults
    world.s3.faults = None
    return world
