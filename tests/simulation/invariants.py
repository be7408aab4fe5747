"""The run protocol's invariants (docs/protocol.md), as predicates over one schedule: after every step, and at its end.

Each check reads only what a user or an operator could look at: the fake S3's objects and
its mutation log (who changed what, and who held the lease then), the worker's disk, the
captured task log, the tries' outcomes (XCom) and exceptions. A check returns
:class:`Violation` records named ``"<Invariant>/<check>"``.

:class:`StepChecks` runs after every change S3 applies, while the schedule runs: a reader
looks at the output (a reader must never see a complete-looking output that is not), every
staging object deleted must leave its final answers somewhere, and every lease write must
follow the take-over rule. The other checks read the final state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.lease import DEFAULT_STALE_AFTER_S
from airflow_vllm_batch.manifest import Manifest
from airflow_vllm_batch.storage.layout import default_error_uri, manifest_uri
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import split_s3_uri
from tests.simulation.s3 import FakeS3Client, FakeS3Hook, Mutation

if TYPE_CHECKING:
    from tests.simulation.scheduler import TryState
    from tests.simulation.world import World

INVARIANTS = (
    "Exactly once",
    "One identity",
    "Fencing",
    "Durability",
    "No strangers",
    "No secrets",
    "Bounded",
    "Liveness",
)


@dataclass(frozen=True)
class Violation:
    check: str
    detail: str

    @property
    def invariant(self) -> str:
        return self.check.split("/")[0]


def staging_prefix(output_uri: str, short: str) -> str:
    return f"{split_s3_uri(output_uri, 'output_uri')[1]}.staging/{short}/"


def invalid_body(body: bytes, wanted: set[str]) -> bool:
    """Whether a staged part holds a line no results check accepts (unreadable, or no answer to a request of ``wanted``).

    Such a part is not durable: the results check drops it and a retry answers its requests
    again (docs/protocol.md, Durability); its other answers count as never staged.
    """
    for raw in body.splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            if not isinstance(line, dict) or line.get("custom_id") not in wanted:
                return True
            if "response" not in line and "error" not in line:
                return True
        except ValueError:
            return True
    return False


def durable_answers(body: bytes, wanted: set[str]) -> set[str]:
    """The final answers a staged object holds durably: none when it is a part the results check drops."""
    return set() if invalid_body(body, wanted) else final_answers(body)


def final_answers(body: bytes) -> set[str]:
    """The custom_ids a results file or part answers finally (a 200, or a 4xx; not an engine-dead 5xx)."""
    found = set()
    for raw in body.splitlines():
        try:
            line = json.loads(raw)
            status = (line.get("response") or {}).get("status_code", 500)
        except (ValueError, AttributeError):
            continue
        if status < 500:
            found.add(line["custom_id"])
    return found


class Outcome:
    """The final state of one schedule, read once for every check."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.objects = world.s3.buckets
        hook = FakeS3Hook(FakeS3Client(world.s3))
        self.store = OutputStore(hook, world.output_uri, world.error_uri)
        self.manifest: Manifest | None = None
        self.complete: Manifest | None = None
        raw = self.get(world.s3, *split_s3_uri(manifest_uri(world.output_uri), "output_uri"))
        if raw is not None:
            try:
                self.manifest = Manifest.from_json(raw)
            except Exception:  # noqa: BLE001 - an unreadable manifest is no complete output
                self.manifest = None
        if self.manifest is not None and self.manifest.identity:
            # What a reader (or a resume) accepts: the production check itself.
            identity = RunIdentity(dict(self.manifest.identity))
            if identity.fingerprint == self.manifest.fingerprint:
                self.complete, _ = self.store.completed(identity)
            else:
                self.complete = self.manifest
        winners = [
            t
            for t in world.tries
            if t.error is None and t.ended and not t.zombie and t.label.startswith("run-1/")
        ]
        self.winner = winners[-1] if winners else None

    @staticmethod
    def get(s3, bucket: str, key: str) -> bytes | None:
        obj = s3.buckets.get(bucket, {}).get(key)
        return obj.body if obj is not None else None

    def body(self, uri: str | None) -> bytes | None:
        if not uri:
            return None
        return self.get(self.world.s3, *split_s3_uri(uri, "uri"))


def check_all(world: World) -> list[Violation]:
    outcome = Outcome(world)
    found: list[Violation] = list(world.step_violations)
    for check in (
        exactly_once,
        one_identity,
        fencing,
        durability,
        no_strangers,
        no_secrets,
        bounded,
        liveness,
    ):
        found.extend(check(outcome))
    return found


# -- after every step ---------------------------------------------------------------------


class UnleasedChanges:
    """The changes one try made without the lease, each counted once.

    One S3 call is one change (a DeleteObjects of several keys too), and so is a request sent
    again after its response was lost (the same operation, key and body: the SDK's retry).
    """

    def __init__(self) -> None:
        self.steps: set[int] = set()
        self.requests: set[tuple[str, str, str, bytes | None]] = set()
        self.count = 0

    def add(self, step: int, request: tuple[str, str, str, bytes | None]) -> bool:
        """Note one applied change; True when it is a change not seen before."""
        new = step not in self.steps and request not in self.requests
        self.steps.add(step)
        self.requests.add(request)
        self.count += new
        return new


class StepChecks:
    """The checks made after every change S3 applies while a schedule runs (see the module docs)."""

    def __init__(self, world: World) -> None:
        from tests.simulation.s3 import FakeS3

        self.world = world
        # A second view of the same objects: what a reader reads, with no step, fault or log of its own.
        view = FakeS3()
        view.buckets = world.s3.buckets
        self.store = OutputStore(FakeS3Hook(FakeS3Client(view)), world.output_uri, world.error_uri)
        self.output_keys = {
            split_s3_uri(manifest_uri(world.output_uri), "output_uri")[1],
            split_s3_uri(world.output_uri, "output_uri")[1],
            split_s3_uri(world.error_uri or default_error_uri(world.output_uri), "error_uri")[1],
        }
        self.staging_root = split_s3_uri(world.output_uri, "output_uri")[1] + ".staging/"
        self.seen: set[str] = set()
        self.last_lease: Mutation | None = None
        #: try label -> the S3 calls with which it changed the output or its staging while not holding the lease.
        self.unleased: dict[str, UnleasedChanges] = {}
        #: output key -> (the S3 call, the writer, whether it changed the bytes) of its current version.
        self.versions: dict[str, tuple[int, str | None, bool]] = {}

    def flag(self, check: str, detail: str) -> None:
        if check not in self.seen:  # the first time each check fails is enough to replay it
            self.seen.add(check)
            self.world.step_violations.append(Violation(check, f"at S3 call {self.world.s3.calls}: {detail}"))

    def after_change(self, changes: list[Mutation]) -> None:
        if self.world.plan.collision:
            return
        for m in changes:
            if m.key == self.world.lease_key[1] and m.body is not None:
                self.lease_rule(m)
            elif (
                m.try_label
                and (m.key in self.output_keys or m.key.startswith(self.staging_root))
                and m.lease_holder != m.try_label
            ):
                self.unleased_change(m)
            if m.key in self.output_keys:
                self.over_newer(m)
        if any(m.key in self.output_keys for m in changes):
            self.reader()
        dropped = [
            m
            for m in changes
            if m.key.startswith(self.staging_root) and m.before and m.op.startswith("delete")
        ]
        # After a user's tool rewrote the published output, its answers may be in no complete output: the
        # user took them out, not the run (the Durability of what the run published ends there).
        if dropped and self.world.input_version == 1 and self.world.outside_rewrite_call is None:
            self.staging_dropped(dropped)

    def lease_rule(self, m: Mutation) -> None:
        """A take-over never goes to an older try; another task instance's lease only once stale."""
        last, self.last_lease = self.last_lease, m
        try:
            new = json.loads(m.body or b"")
            old = json.loads(m.before) if m.before else None
        except ValueError:
            return
        if not old or (old["run_id"], old["try_number"]) == (new["run_id"], new["try_number"]):
            return
        if old["run_id"] == new["run_id"] and old["try_number"] > new["try_number"]:
            self.flag(
                "Fencing/lease-taken-by-older-try",
                f"try {new['try_number']} took the lease of its successor, try {old['try_number']}",
            )
        elif (
            old["run_id"] != new["run_id"] and last is not None and m.at - last.at < DEFAULT_STALE_AFTER_S - 2
        ):
            self.flag(
                "Fencing/live-lease-taken-over",
                f"{new['run_id']} took {old['run_id']}'s lease {m.at - last.at:.0f}s after its last write (stale after {DEFAULT_STALE_AFTER_S:.0f}s)",
            )

    def engine_starts(self, label: str) -> None:
        """An engine's first request: the try read the lease after its last read of the staging (docs/protocol.md, Durability).

        What the engine is given was decided by those reads; a try paused between them and its
        first request, whose successor took over and answered meanwhile, must find out first.
        """
        world = self.world
        if world.plan.collision or not label.startswith(("run-1/", "run-2/")):
            return
        staging, lease = world.last_staging_read.get(label, -1), world.last_lease_read.get(label, -1)
        if staging > lease:
            self.flag(
                "Durability/engine-started-without-lease-read",
                f"{label}'s engine began with no read of the lease since its last read of the staging",
            )

    def unleased_change(self, m: Mutation) -> None:
        """A try that does not hold the lease changes at most one thing under the output: the write its last fence let through.

        A fence is a read before the write, and a try may pause between the two while another
        takes the lease over (docs/protocol.md, step 9); but its next fence fails, so a second
        change (another S3 call) without the lease is a write no fence checked. A request sent
        again after its response was lost (the same operation, key and body: the SDK's retry of
        one write) is the same change, not a second one (seed 7243 of the merged code).
        """
        seen = self.unleased.setdefault(m.try_label or "-", UnleasedChanges())
        if not seen.add(m.step, (m.op, m.bucket, m.key, m.body)):
            return
        if seen.count > 1:
            self.flag(
                "Fencing/writes-after-lease-lost",
                f"{m.try_label} changed {m.key} ({m.op}) while {m.lease_holder or 'nobody'} held the lease, its second change without it",
            )

    def over_newer(self, m: Mutation) -> None:
        """A publishing write replaces (or deletes) only a version that was there when its try last read the lease.

        Every write of the output is conditional on what the try read before its fence
        (docs/protocol.md, step 9), so the version it replaces is older than that fence. A
        version another writer made after it (a later run that took the lease over while this
        try was paused or frozen past its fence) must make the write fail; replacing it is the
        stray write the conditions exist to refuse. A rewrite of the very same bytes is no
        change a condition could tell (nor a reader).
        """
        previous = self.versions.get(m.key)
        self.versions[m.key] = (m.step, m.try_label, m.before != m.body)
        if previous is None or m.try_label is None or m.before is None:
            return
        step, writer, changed = previous
        fenced_at = self.world.lease_read_call.get(m.try_label, -1)
        if writer != m.try_label and changed and step > fenced_at:
            self.flag(
                "Fencing/stray-write-over-newer",
                f"{m.try_label} {m.op.replace('_', ' ')} {m.key} over {writer or 'a user'}'s version of S3 call "
                f"{step}, made after {m.try_label}'s last lease read (call {fenced_at})",
            )

    def returned(self, state: TryState) -> None:
        """A try returns success only over an output whose files are the ones its manifest names (docs/protocol.md, Exactly once).

        Made when the try returns: the manifest it returns is still the one at the manifest's key
        (else a later writer replaced the output, legitimately or not, and other checks judge it).
        """
        world = self.world
        if (
            world.plan.collision
            or state.zombie
            or state.outcome is None
            or not state.label.startswith(("run-1/", "run-2/"))
        ):
            return
        returned = state.outcome.manifest
        raw = world.s3.buckets["sim"].get(self.store.manifest_key)
        try:
            current = Manifest.from_json(raw.body) if raw is not None else None
        except Exception:  # noqa: BLE001 - a tombstone: another try publishes now
            return
        if current is None or current.to_json() != returned.to_json():
            return
        bucket = world.s3.buckets["sim"]
        results = bucket.get(split_s3_uri(returned.output_uri, "uri")[1]) if returned.output_uri else None
        errors = bucket.get(split_s3_uri(returned.error_uri, "uri")[1]) if returned.error_uri else None
        wrong = []
        if returned.output_etag and (results is None or results.etag.strip('"') != returned.output_etag):
            wrong.append(returned.output_uri)
        if returned.error_etag and (errors is None or errors.etag.strip('"') != returned.error_etag):
            wrong.append(returned.error_uri)
        if wrong:
            self.flag(
                "Exactly once/success-over-changed-output",
                f"{state.label} returned success with a manifest whose files {wrong} are no longer the ones it names",
            )

    def reader(self) -> None:
        """What a reader sees now: if it takes the output as complete, the output must be complete and right."""
        raw = self.world.s3.buckets.get("sim", {}).get(self.store.manifest_key)
        if raw is None:
            return
        try:
            manifest = Manifest.from_json(raw.body)
        except Exception:  # noqa: BLE001 - a tombstone or an unreadable manifest: no complete output
            return
        if not manifest.identity or RunIdentity(dict(manifest.identity)).fingerprint != manifest.fingerprint:
            return
        complete, _ = self.store.completed(RunIdentity(dict(manifest.identity)))
        if complete is None:
            return
        body = lambda uri: Outcome.get(self.world.s3, *split_s3_uri(uri, "uri")) if uri else None
        for check, detail in output_problems(
            self.world, complete, body(complete.output_uri) or b"", body(complete.error_uri) or b""
        ):
            self.flag(check.replace("/", "/reader-saw-", 1), detail)

    def staging_dropped(self, dropped: list[Mutation]) -> None:
        """A staging object's final answers, when it is deleted, are in the rest of its staging or in a complete output of its run."""
        wanted = set(self.world.inputs.get(next(iter(self.world.inputs)), {}))
        for m in dropped:
            short = m.key[len(self.staging_root) :].split("/")[0]
            answers = durable_answers(m.before or b"", wanted) & wanted
            if not answers:
                continue
            prefix = f"{self.staging_root}{short}/"
            for key, obj in self.world.s3.buckets["sim"].items():
                if key.startswith(prefix):
                    answers -= final_answers(obj.body)
            raw = self.world.s3.buckets["sim"].get(self.store.manifest_key)
            if answers and raw is not None:
                try:
                    manifest = Manifest.from_json(raw.body)
                    complete = manifest if manifest.fingerprint[:16] == short else None
                except Exception:  # noqa: BLE001
                    complete = None
                if complete is not None:
                    for uri in (complete.output_uri, complete.error_uri):
                        if uri:
                            answers -= final_answers(
                                Outcome.get(self.world.s3, *split_s3_uri(uri, "uri")) or b""
                            )
            if answers:
                self.flag(
                    "Durability/staged-answer-dropped",
                    f"{m.try_label} deleted {m.key} whose final answers {sorted(answers)} are in no other staging object and no complete output",
                )


# -- Exactly once -----------------------------------------------------------------------


def exactly_once(o: Outcome) -> list[Violation]:
    found = []
    world = o.world
    # A user's tool that rewrote the published output afterwards made it incomplete; no run can prevent that
    # (a later run must notice it: ``success-over-changed-output``).
    if (
        world.final == "success"
        and o.complete is None
        and not world.plan.collision
        and world.outside_rewrite_call is None
    ):
        found.append(
            Violation(
                "Exactly once/success-without-complete-output",
                "the task succeeded but no complete output is published",
            )
        )
    m = o.complete
    if m is None or world.plan.collision:
        return found
    results = o.body(m.output_uri) or b""
    errors = o.body(m.error_uri) if m.error_uri else b""
    return found + [
        Violation(check, detail)
        for check, detail in output_problems(world, m, results, errors)
        if check.startswith("Exactly once")
    ]


def output_problems(world: World, m: Manifest, results: bytes, errors: bytes) -> list[tuple[str, str]]:
    """What is wrong with a complete output (its manifest, results and error file): Exactly once and One identity."""
    found: list[tuple[str, str]] = []
    inputs = world.inputs.get(m.input_etag or "")
    if inputs is None:
        return [("Exactly once/unknown-input", f"the manifest names input ETag {m.input_etag}")]
    seen: dict[str, int] = {}
    bad_lines = 0
    for part in (results, errors or b""):
        for raw in part.splitlines():
            try:
                seen[json.loads(raw)["custom_id"]] = seen.get(json.loads(raw)["custom_id"], 0) + 1
            except (ValueError, KeyError, TypeError):
                bad_lines += 1
    if bad_lines:
        found.append(
            ("Exactly once/unreadable-line", f"{bad_lines} published line(s) are not one JSON answer")
        )
    twice = sorted(c for c, n in seen.items() if n > 1)
    missing = sorted(set(inputs) - set(seen))
    strangers = sorted(set(seen) - set(inputs))
    if twice or missing or strangers:
        found.append(("Exactly once/answers", f"twice={twice} missing={missing} not in input={strangers}"))
    counts = m.request_counts
    lines = (len(results.splitlines()), len((errors or b"").splitlines()))
    if (counts.completed, counts.failed, counts.total) != (lines[0], lines[1], len(inputs)):
        found.append(
            (
                "Exactly once/counts",
                f"manifest {counts} vs results/errors lines {lines}, {len(inputs)} inputs",
            )
        )
    stale = stale_answers(inputs, results)
    if stale:
        found.append(("One identity/stale-answer", f"answers to another input than the manifest's: {stale}"))
    return found


def stale_answers(inputs: dict[str, str], results: bytes) -> list[str]:
    """The custom_ids whose answer does not echo the request the manifest's input holds."""
    stale = []
    for raw in results.splitlines():
        try:
            line = json.loads(raw)
            content = line["response"]["body"]["choices"][0]["message"]["content"]
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        if content != f"echo:{inputs.get(line['custom_id'])}":
            stale.append(line["custom_id"])
    return stale


# -- One identity -----------------------------------------------------------------------


def one_identity(o: Outcome) -> list[Violation]:
    if o.world.plan.collision:
        return []
    found = []
    for t in o.world.tries:
        # What a try returns (its XCom) answers the input as it was while the try ran, never an earlier one.
        if (
            t.outcome is not None
            and t.label.startswith(("run-1/", "run-2/"))
            and t.outcome.manifest.input_etag not in t.inputs_seen
        ):
            found.append(
                Violation(
                    "One identity/stale-manifest-returned",
                    f"{t.label} returned the manifest of input {t.outcome.manifest.input_etag}, not of the input it ran on",
                )
            )
            break
    m = o.complete
    if m is not None:
        stale = stale_answers(o.world.inputs.get(m.input_etag or "", {}), o.body(m.output_uri) or b"")
        if stale:
            found.append(
                Violation(
                    "One identity/stale-answer", f"answers to another input than the manifest's: {stale}"
                )
            )
    return found


# -- Fencing ----------------------------------------------------------------------------


def fencing(o: Outcome) -> list[Violation]:
    world = o.world
    found = []
    if world.plan.collision:
        return found
    mkey = split_s3_uri(manifest_uri(world.output_uri), "output_uri")[1]
    okey = split_s3_uri(world.output_uri, "output_uri")[1]
    ekey = split_s3_uri(world.error_uri or default_error_uri(world.output_uri), "error_uri")[1]
    manifest_puts = [
        m
        for m in world.s3.mutations
        if m.key == mkey and m.op != "delete_objects" and m.op != "delete_object"
    ]
    unconditional = [m for m in manifest_puts if not m.conditional]
    if unconditional:
        found.append(
            Violation(
                "Fencing/unconditional-manifest-write",
                f"{len(unconditional)} manifest write(s) without IfMatch/IfNoneMatch",
            )
        )
    if o.complete is not None:
        last = {}
        for m in world.s3.mutations:
            if m.key in (okey, ekey, mkey):
                last[m.key] = m
        writer = last[mkey].try_label if mkey in last else None
        ebucket = split_s3_uri(world.error_uri or default_error_uri(world.output_uri), "error_uri")[0]
        # An error file the complete manifest does not name must be absent. When it is absent and the last
        # change was a delete (an earlier holder of the lease removed an old error file, then was killed
        # before its manifest), the key is as the winner's manifest says: not another try's change of the
        # output. A file another try *created* there is still flagged.
        absent_as_named = (
            last.get(ekey) is not None
            and last[ekey].op in ("delete_object", "delete_objects")
            and not o.complete.error_uri
            and o.get(world.s3, ebucket, ekey) is None
        )

        def same_bytes_as_writers(key: str, change) -> bool:
            # A paused try whose If-Match held because its successor wrote the very same bytes
            # (same identity, same answers: the same MD5 ETag, seed 5260) changes nothing a
            # reader can see: no condition can tell the two writes apart, and none needs to. The
            # writer may have no landed write of its own there: its write met 412 and it adopted the
            # identical bytes it found (the MD5 check); what it *asked* to write is what counts.
            if change.body is None:
                return False
            return hashlib.md5(change.body).hexdigest() in world.s3.attempted.get((writer, key), set())

        # Left open by the protocol (docs/protocol.md, step 9): a try that lost the lease past its last fence
        # *creates* an error file beside an output whose manifest names none. No S3 condition refuses a
        # creation where nothing was; no reader takes the file (the manifest names its files); the next
        # publish deletes it. Reached by the frozen processes (seed 820 of issue 34's simulator).
        stray_creation = (
            last.get(ekey) is not None
            and last[ekey].before is None
            and last[ekey].body is not None
            and last[ekey].lease_holder != last[ekey].try_label
            and not o.complete.error_uri
        )
        mixed = {
            k: m.try_label
            for k, m in last.items()
            if m.try_label != writer
            and not (k == ekey and (absent_as_named or stray_creation))
            and not (k != mkey and same_bytes_as_writers(k, m))
        }
        if mixed:
            found.append(
                Violation(
                    "Fencing/mixed-writers",
                    f"the complete output's manifest is {writer}'s, but the last change of {mixed} is another try's",
                )
            )
    elif world.final == "success" and o.winner is not None:
        win = o.winner.label
        wrote = [
            i
            for i, m in enumerate(world.s3.mutations)
            if m.key == mkey and m.try_label == win and m in manifest_puts
        ]
        if wrote:
            # A try that holds the lease may replace the output (a later run of another identity, legitimately).
            after = [
                m
                for m in world.s3.mutations[wrote[-1] + 1 :]
                if m.key in (okey, ekey, mkey) and m.try_label != win and m.lease_holder != m.try_label
            ]
            if after:
                found.append(
                    Violation(
                        "Fencing/published-output-undone",
                        f"{after[0].try_label} ({after[0].op} {after[0].key}, lease held by {after[0].lease_holder}) "
                        f"undid {win}'s published output",
                    )
                )
    return found


# -- Durability -------------------------------------------------------------------------


def durability(o: Outcome) -> list[Violation]:
    world = o.world
    found = []
    if world.plan.collision:
        return found
    staging_root = split_s3_uri(world.output_uri, "output_uri")[1] + ".staging/"
    durable: dict[str, set[str]] = {}
    last_short = None
    for m in world.s3.mutations:
        if m.key.startswith(staging_root) and m.body is not None:
            short = m.key[len(staging_root) :].split("/")[0]
            durable.setdefault(short, set()).update(durable_answers(m.body, first_input(world)))
            last_short = short
    live = (
        o.winner.outcome.manifest.fingerprint[:16]
        if o.winner is not None and o.winner.outcome
        else lease_identity(world) or last_short
    )
    if live in durable and world.outside_rewrite_call is None:
        prefix = f"{staging_root}{live}/"
        now = set()
        for key, obj in world.s3.buckets["sim"].items():
            if key.startswith(prefix):
                now |= final_answers(obj.body)
        published = set()
        if o.complete is not None and o.complete.fingerprint[:16] == live:
            published = final_answers(o.body(o.complete.output_uri) or b"") | final_answers(
                o.body(o.complete.error_uri) or b""
            )
        lost = sorted(c for c in durable[live] - now - published if answers_current_input(world, c))
        if lost:
            found.append(
                Violation(
                    "Durability/durable-answer-lost",
                    f"final answers once staged under {live} and now nowhere: {lost}",
                )
            )
    resent = sorted({(t, c) for t, s, c, before in world.sent if before and s == live})
    if resent:
        found.append(
            Violation(
                "Durability/durable-answer-resent",
                f"(try, custom_id) sent again although durable: {resent[:5]}",
            )
        )
    return found


def first_input(world: World) -> set[str]:
    """The custom_ids of the task instance's first input (Durability is checked only while it stands)."""
    return set(world.inputs.get(next(iter(world.inputs)), {})) if world.inputs else set()


def answers_current_input(world: World, custom_id: str) -> bool:
    """Whether a staged answer to ``custom_id`` still answers the input as it is now (else the identity changed)."""
    return world.input_version == 1


def lease_identity(world: World) -> str | None:
    """The run identity (short) of the last lease this task instance's tries wrote: the run's identity by then."""
    lease_key = world.lease_key[1]
    for m in reversed(world.s3.mutations):
        if m.key == lease_key and m.body and m.try_label and m.try_label.startswith("run-1/"):
            try:
                return str(json.loads(m.body)["fingerprint"])[:16]
            except (ValueError, KeyError):
                return None
    return None


# -- No strangers -----------------------------------------------------------------------


def no_strangers(o: Outcome) -> list[Violation]:
    world = o.world
    found = []
    input_key = split_s3_uri(world.input_uri, "input_uri")[1]
    if o.get(world.s3, "sim", input_key) != world.input_bytes:
        found.append(Violation("No strangers/input-changed", "the run overwrote or deleted its own input"))
    okey = split_s3_uri(world.output_uri, "output_uri")[1]
    stem = okey.removesuffix(".jsonl")
    ekey = split_s3_uri(world.error_uri or default_error_uri(world.output_uri), "error_uri")[1]
    owned_keys = {okey, ekey, f"{stem}.manifest.json", f"{stem}.lease.json"}
    owned_prefixes = (f"{okey}.staging/", f"{stem}.requests/", f"{okey}.probe-", f"{ekey}.probe-")
    if world.plan.cache_prior:
        owned_prefixes = (*owned_prefixes, "cache/")
    foreign = sorted(
        {
            m.key
            for m in world.s3.mutations
            if m.try_label
            and m.try_label.startswith("run-1/")
            and (m.key not in owned_keys or m.key == input_key)
            and not m.key.startswith(owned_prefixes)
        }
    )
    if foreign:
        found.append(
            Violation("No strangers/foreign-object", f"the run changed objects it does not own: {foreign}")
        )
    gone = sorted(
        str(p.relative_to(world.workdir))
        for p, data in world.user_files.items()
        if not p.exists() or p.read_bytes() != data
    )
    if gone:
        found.append(Violation("No strangers/user-file-deleted", f"files beside results_dir removed: {gone}"))
    if world.plan.collision:
        engine_ran = world.task_engine_steps > 0
        if world.final == "success" or engine_ran:
            found.append(
                Violation(
                    "No strangers/collision-not-refused",
                    f"{world.plan.collision} was accepted (engine ran: {engine_ran}, task {world.final})",
                )
            )
    return found


# -- No secrets -------------------------------------------------------------------------


def no_secrets(o: Outcome) -> list[Violation]:
    world = o.world
    secret = world.plan.secret
    if not secret:
        return []
    from airflow.sdk.log import _secrets_masker  # the masker Airflow's task log goes through

    masker = _secrets_masker()
    found = []
    leaked_logs = [line.message for line in world.logs if secret in masker.redact(line.message)]
    if leaked_logs:
        found.append(
            Violation("No secrets/task-log", f"{len(leaked_logs)} log line(s), e.g. {leaked_logs[0][:120]!r}")
        )
    input_key = split_s3_uri(world.input_uri, "input_uri")[1]
    in_s3 = sorted(
        k for k, obj in world.s3.buckets["sim"].items() if k != input_key and secret.encode() in obj.body
    )
    if in_s3:
        found.append(Violation("No secrets/s3", f"in {in_s3}"))
    for t in world.tries:
        if t.outcome is not None and secret in t.outcome.manifest.to_json().decode():
            found.append(Violation("No secrets/xcom", f"{t.label}'s returned manifest holds the secret"))
            break
    for t in world.tries:
        if t.error is not None and secret in str(t.error):
            found.append(Violation("No secrets/exception", f"{t.label}: {type(t.error).__name__}"))
            break
    return found


# -- Bounded ----------------------------------------------------------------------------

#: Exceptions no fault the simulator injects can cause: a try ending in one is a bug in the code under test.
PROGRAMMING_ERRORS = (
    AttributeError,
    TypeError,
    NameError,
    KeyError,
    IndexError,
    AssertionError,
    ImportError,
    UnboundLocalError,
)


def bounded(o: Outcome) -> list[Violation]:
    world = o.world
    found = []
    if world.scheduler.out_of_time or world.scheduler.deadlocked:
        why = (
            "deadlocked"
            if world.scheduler.deadlocked
            else f"still running after {world.scheduler.time_limit_s:.0f} virtual s"
        )
        found.append(Violation("Bounded/try-did-not-end", why))
    if world.final is None:
        found.append(Violation("Bounded/task-did-not-end", "no try ended the task instance"))
    if any(t.run == "run-2" for t in world.tries) and "run-2" not in world.finals:
        found.append(Violation("Bounded/task-did-not-end", "no try ended run-2's task instance"))
    last = next((t for t in reversed(world.tries) if not t.zombie), None)
    if world.final == "failed" and not world.plan.collision and last is not None and last.error is not None:
        from tests.simulation.world import retryable

        if not retryable(last.error):
            found.append(
                Violation(
                    "Bounded/terminal-on-transient-faults",
                    f"{last.label}: {type(last.error).__name__}: {str(last.error)[:160]}",
                )
            )
    # A try that ends in a programming error ends the task no better than a bug would: Airflow
    # retries it, and the simulator would count a schedule where nothing ran as clean (the
    # server engine's schedules did, after a refactor, until this check).
    for t in world.tries:
        if isinstance(t.error, PROGRAMMING_ERRORS):
            found.append(
                Violation(
                    "Bounded/programming-error", f"{t.label}: {type(t.error).__name__}: {str(t.error)[:160]}"
                )
            )
            break
    found.extend(stall_bound(world))
    for line in world.logs:
        if line.message.startswith("Lost the lease") and line.lease_holder == line.try_label:
            found.append(
                Violation(
                    "Bounded/lease-lost-to-nobody",
                    f"{line.try_label} declared its lease lost while the lease named it",
                )
            )
            break
    return found


def stall_bound(world: World) -> list[Violation]:
    """The runner's stall bound: a wedged engine is stopped within it; an engine that progresses is never stopped for it.

    A wedged runner (no progress ever again) must be stopped (its hook's ``terminate``) at most the
    bound and two of the check's polls after it wedged, so its try ends; a try whose engine only stalled for
    less than the bound (or answered steadily) must not fail as stalled.
    """
    from airflow_vllm_batch.engines.stall import STALL_POLL_S
    from airflow_vllm_batch.exceptions import EngineStalledError
    from tests.simulation.world import SIM_STALL_TIMEOUT_S

    found = []
    for label, at in world.wedged.items():
        stopped = world.engine_stopped_at.get(label)
        # The answers the stand-in writes as it wedges are seen as progress at the next poll: two polls of slack.
        if stopped is None or stopped - at > SIM_STALL_TIMEOUT_S + 2 * STALL_POLL_S:
            late = "never" if stopped is None else f"{stopped - at:.0f} virtual s later"
            found.append(
                Violation(
                    "Bounded/stall-not-stopped",
                    f"{label}: its engine wedged at {at:.0f} s and was stopped {late} (bound {SIM_STALL_TIMEOUT_S:.0f} s)",
                )
            )
            break
    for t in world.tries:
        if isinstance(t.error, EngineStalledError) and t.label not in world.wedged and not t.zombie:
            found.append(
                Violation(
                    "Bounded/stopped-while-progressing",
                    f"{t.label}: its engine never stalled longer than the bound, yet: {str(t.error)[:160]}",
                )
            )
            break
    return found


# -- Liveness -----------------------------------------------------------------------------


def liveness(o: Outcome) -> list[Violation]:
    """A task instance whose last try met no fault succeeds.

    The last try met no fault when it was not killed, none of its S3 calls or engine requests
    met an injected fault, the input was never rewritten, and no other task instance used the
    output (its lease may legitimately keep this one off). Earlier tries' faults, zombies
    included, do not excuse it: whatever they left, a clean try must finish the batch.
    """
    world = o.world
    last = world.final_try
    if world.plan.collision or last is None or world.final != "failed" or last.dead or last.faults:
        return []
    if (
        world.input_version != 1
        or world.plan.second_run_at
        or any(t.run == "run-2" for t in world.tries)
        or world.scheduler.out_of_time
    ):
        return []
    error = last.error
    return [
        Violation(
            "Liveness/clean-last-try-failed", f"{last.label}: {type(error).__name__}: {str(error)[:200]}"
        )
    ]
