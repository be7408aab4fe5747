"""Single-point mutants of the run protocol's modules, and the machinery that runs one against the simulator.

A mutant is one realistic bug: an exact snippet of one module of ``airflow_vllm_batch`` and
its replacement (a condition dropped, a fence skipped, two steps reordered, a count or a
filter changed, a read-back removed). :func:`mutated_tree` copies the package into a
temporary directory and applies the mutant there (the worktree is never changed); the
simulator (:func:`first_violation`) then runs in a subprocess whose ``sys.path`` starts at
that copy. A snippet that is not found exactly once is an error, never a skipped mutant:
the protocol modules move, and a mutant that silently stops applying would count as
"caught" or "survived" for nothing (:class:`MutantNotAnchored`).

``benchmarks/mutate.py`` runs the whole catalogue (the figures in docs/reliability.md);
``tests/simulation/test_mutants.py`` runs a handful in the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_vllm_batch"


class MutantNotAnchored(RuntimeError):
    """A mutant's snippet is not in its module exactly once: the module changed; re-anchor the mutant."""


@dataclass(frozen=True)
class Mutant:
    """One bug: ``old`` (exactly once in ``module``) replaced by ``new``.

    :param name: short, stable name.
    :param module: the file, relative to the package.
    :param what: the bug in one line.
    :param old: the exact snippet.
    :param new: its replacement.
    :param equivalent: when set, why no schedule can tell this mutant from the real code (not scored).
    :param simulator: the scenario that runs it: ``run`` (the run protocol, :mod:`tests.simulation.world`)
        or ``shards`` (split -> shards -> merge, :mod:`tests.simulation.shards`).
    """

    name: str
    module: str
    what: str
    old: str
    new: str
    equivalent: str | None = None
    simulator: str = "run"

    def apply(self, root: Path) -> Path:
        """Mutate the copy of the package under ``root``; return the file it mutated (see :meth:`locate`)."""
        path = self.locate(root)
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(self.old, self.new), encoding="utf-8")
        return path

    def locate(self, root: Path) -> Path:
        """The file of the package under ``root`` that holds the snippet exactly once.

        Its :attr:`module` when that file exists; when it does not (the module moved, e.g. into a
        package of its own), the one file anywhere in the package that holds the snippet, exactly
        once in exactly one file, so a move does not stop the mutant from applying; re-point
        :attr:`module` to the file named (``test_mutants.py`` says which).

        :raises MutantNotAnchored: the snippet is not in the module exactly once, or (the module gone)
            not in exactly one file exactly once.
        """
        package = root / PACKAGE
        path = package / self.module
        if path.exists():
            found = path.read_text(encoding="utf-8").count(self.old)
            if found == 1:
                return path
            raise MutantNotAnchored(
                f"mutant {self.name}: its snippet occurs {found} time(s) in {PACKAGE}/{self.module} (exactly once needed). "
                f"The module changed: re-anchor the mutant in tests/simulation/mutation.py. Snippet:\n{self.old}"
            )
        counts = {
            f: n
            for f in sorted(package.rglob("*.py"))
            if "__pycache__" not in f.parts and (n := f.read_text(encoding="utf-8").count(self.old))
        }
        if len(counts) == 1 and next(iter(counts.values())) == 1:
            return next(iter(counts))
        where = ", ".join(f"{f.relative_to(root)} ({n}x)" for f, n in counts.items()) or "no file"
        raise MutantNotAnchored(
            f"mutant {self.name}: {PACKAGE}/{self.module} does not exist and its snippet is in {where} "
            f"(exactly one file, once, needed). Re-anchor the mutant in tests/simulation/mutation.py. Snippet:\n{self.old}"
        )


M = Mutant
#: The catalogue. Keep each ``old`` as short as makes it unique, and name the protocol rule it breaks.
MUTANTS: tuple[Mutant, ...] = (
    # -- storage/: publishing and staging ---------------------------------------------------
    M(
        "manifest-if-match-dropped",
        "storage/publishing.py",
        "the manifest's write is unconditional (not If-Match the try's tombstone)",
        """manifest.to_json(), {"IfMatch": f'"{over}"'} if over is not None else {"IfNoneMatch": "*"}""",
        """manifest.to_json(), {}""",
    ),
    M(
        "tombstone-if-match-dropped",
        "storage/publishing.py",
        "the tombstone replaces whatever manifest is there (no If-Match on what was seen)",
        """return self._put_manifest_key(body, _condition(seen))""",
        """return self._put_manifest_key(body, {})""",
    ),
    M(
        "results-upload-if-match-dropped",
        "storage/publishing.py",
        "the results upload is unconditional",
        """self._fenced(), results_path, self.bucket, self.key, **_condition(seen_results)""",
        """self._fenced(), results_path, self.bucket, self.key""",
    ),
    M(
        "results-copy-if-match-dropped",
        "storage/publishing.py",
        "the server-side copy of the staged results is unconditional",
        """staging.results_key,
                    self.bucket,
                    self.key,
                    **_condition(seen_results),""",
        """staging.results_key,
                    self.bucket,
                    self.key,""",
    ),
    M(
        "errors-if-match-dropped",
        "storage/publishing.py",
        "the error file's upload is unconditional",
        """self._fenced(), errors_path, self.error_bucket, self.error_key, **_condition(seen_errors)""",
        """self._fenced(), errors_path, self.error_bucket, self.error_key""",
    ),
    M(
        "old-errors-deleted-unconditionally",
        "storage/publishing.py",
        "an old error file is deleted without If-Match",
        """self._conditional_delete(self.error_bucket, self.error_key, seen_errors, self.error_uri)""",
        """self._fenced().delete_object(Bucket=self.error_bucket, Key=self.error_key)""",
    ),
    M(
        "412-taken-as-own-write",
        "storage/publishing.py",
        "a 412 is taken as this try's own landed write without the MD5 check",
        """if error_code(err) in _PRECONDITION_CODES and landed():""",
        """if error_code(err) in _PRECONDITION_CODES:""",
    ),
    M(
        "manifest-before-results",
        "storage/publishing.py",
        "the manifest is published right after the tombstone, before the results and error file",
        """tombstone = self.mark_publishing(seen_manifest, manifest.fingerprint)\n""",
        """tombstone = self.mark_publishing(seen_manifest, manifest.fingerprint)\n        tombstone = self.write_manifest(manifest, over=tombstone)\n""",
    ),
    M(
        "staging-removed-before-manifest",
        "storage/publishing.py",
        "the run's staging is removed before the manifest is written",
        """        self.write_manifest(manifest, over=tombstone)\n        if staging is not None:\n            staging.remove()""",
        """        if staging is not None:\n            staging.remove()\n        self.write_manifest(manifest, over=tombstone)""",
    ),
    M(
        "publish-unfenced",
        "storage/publishing.py",
        "no lease check before the publishing writes (OutputStore's fence skipped)",
        """        self._fence()\n        return self.hook.get_conn()""",
        """        return self.hook.get_conn()""",
    ),
    M(
        "staging-unfenced",
        "storage/staging.py",
        "no lease check before staging writes and deletes (RunStaging's fence skipped)",
        """        if self.fence is not None:\n            self.fence()\n        return self.hook.get_conn()""",
        """        return self.hook.get_conn()""",
    ),
    M(
        "completed-ignores-etags",
        "storage/publishing.py",
        "a manifest is taken as complete although its files were overwritten since (fix 6)",
        """if published is not None and etag != bare_etag(published):""",
        """if False:""",
    ),
    M(
        "completed-ignores-identity",
        "storage/publishing.py",
        "a manifest of another identity is taken as this run's complete output",
        """        if manifest.fingerprint != identity.fingerprint:\n            changed""",
        """        if False:\n            changed""",
    ),
    M(
        "staging-shared-by-identities",
        "storage/publishing.py",
        "every identity stages under one prefix (the identity no longer names the staging)",
        """f"{self.key}.staging/{identity.short}/\"""",
        """f"{self.key}.staging/shared/\"""",
    ),
    M(
        "drop-results-every-part",
        "run/batch.py",
        "a failed results check drops every checkpoint part, not only the invalid ones (fix 5)",
        """        if engine_results.duplicates != "first":\n            job.staging.drop_results()\n""",
        """        if True:\n            job.staging.drop_results()\n""",
    ),
    # -- lease.py ------------------------------------------------------------------------
    M(
        "staleness-inverted",
        "lease.py",
        "another run's lease is taken over while live, and refused once stale",
        """not other.same_task_instance(self.holder) and age < self.stale_after_s:""",
        """not other.same_task_instance(self.holder) and age >= self.stale_after_s:""",
    ),
    M(
        "zombie-retakes-lease",
        "lease.py",
        "an older try takes the lease back from its newer successor (the bug fixed with issue 34)",
        """and other.try_number > self.holder.try_number""",
        """and False""",
    ),
    M(
        "given-back-lease-not-retaken",
        "lease.py",
        "a take-over whose lease was given back meanwhile fails the try (seed 120, fixed with issue 34)",
        """if round_ == ACQUIRE_ROUNDS or (
                    isinstance(err, ClientError) and _code(err) not in _GONE_CODES
                ):""",
        """if True:""",
    ),
    M(
        "older-try-race-fails",
        "lease.py",
        "a take-over raced by an older try of the same task fails the newer try (seed 2335 at fdc20fc, fixed with issue 34)",
        """if now is not None and not (older and now.holder.try_number < self.holder.try_number):""",
        """if now is not None:""",
    ),
    M(
        "lease-read-back-removed",
        "lease.py",
        "the lease is not read back after it was taken",
        """        self._verify()\n        self._thread = threading.Thread(""",
        """        self._thread = threading.Thread(""",
        equivalent=(
            "every lease write is conditional (If-None-Match: * to create, If-Match to take over) and S3, SeaweedFS and "
            "the fake honour conditions (tests/integration/test_s3_fake_contract.py), so a write that returned 200 holds "
            "the lease when it returns; the read-back only narrows the race on a store that ignores conditions"
        ),
    ),
    M(
        "fence-accepts-any-lease",
        "lease.py",
        "the fence passes whoever holds the lease",
        """if current is None or (current.etag != self._etag and not self._is_ours(current)):""",
        """if current is None:""",
    ),
    M(
        "heartbeat-renews-anyones-lease",
        "lease.py",
        "a renewal's 412 takes any lease found as its own and renews over it (a lost lease never noticed)",
        """                if current is not None and self._is_ours(current):""",
        """                if current is not None:""",
    ),
    M(
        "release-unconditional",
        "lease.py",
        "the lease is released without If-Match (it may delete a successor's lease)",
        """self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self._etag)""",
        """self.client.delete_object(Bucket=self.bucket, Key=self.key)""",
    ),
    # -- run/batch.py --------------------------------------------------------------------
    M(
        "resume-recheck-removed",
        "run/batch.py",
        "the resume check is not made again once the lease is taken",
        """manifest = self.published(identity, again=True)""",
        """manifest = None""",
    ),
    M(
        "no-lease-check-before-check",
        "run/batch.py",
        "no lease read between the engine and the results check",
        """                lease.ensure_held(verify=True)\n                results = self.check(job, engine_results)""",
        """                results = self.check(job, engine_results)""",
        equivalent=(
            "every S3 change after it is fenced (the drops through RunStaging's fence, publishing through OutputStore's), so "
            "a try that lost its lease changes nothing either way; only the error that ends it differs (OutputBusyError at "
            "its first fenced write instead of before the check), retryable both, and a zombie's ending is ignored"
        ),
    ),
    M(
        "cached-answers-not-added",
        "run/batch.py",
        "the cached answers are not appended to the results",
        """                    split.add_to(results, work / "results.jsonl")""",
        """                    pass""",
    ),
    M(
        "copy-staged-with-cache-hits",
        "run/batch.py",
        "the staged results are copied as the output even when cached answers were added",
        """                    and engine_results.staged_results\n                    and not manifest.from_cache\n""",
        """                    and engine_results.staged_results\n""",
    ),
    M(
        "failed-lines-not-published",
        "run/batch.py",
        "the engine's failed lines get no error file",
        """if not (results.request_counts["failed"] or self.skipped(report)):""",
        """if not self.skipped(report):""",
    ),
    # -- engines/server.py ---------------------------------------------------------------
    M(
        "skip-set-ignored",
        "engines/server.py",
        "a retry sends every request again, whatever the parts answer",
        """skip = (lambda custom_id: answered.line_of(custom_id) is not None) if answered else None""",
        """skip = None""",
    ),
    M(
        "duplicates-counted-twice",
        "engines/server.py",
        "on resume, a request answered in two parts counts twice (fix 5)",
        """done = answered_requests(job.report.custom_ids, answered, total)""",
        """done = len(answered)""",
    ),
    M(
        "no-lease-read-before-sending",
        "engines/server.py",
        "no lease read between reading the parts and the first request",
        """        job.lease.ensure_held(verify=True)\n        started = time.monotonic()""",
        """        started = time.monotonic()""",
    ),
    M(
        "parts-without-try-token",
        "engines/server.py",
        "the parts are uploaded without the try's token (two tries write the same keys)",
        """            staging.put_part(path, token)""",
        """            staging.put_part(path)""",
    ),
    M(
        "set-aside-never-journaled",
        "engines/server.py",
        "on the last try the set-aside lines are not journaled as failed",
        """        journal.write_set_aside()\n        journal.close()""",
        """        journal.close()""",
    ),
    # -- serving/journal.py ---------------------------------------------------------------
    M(
        "journal-reuses-part-numbers",
        "serving/journal.py",
        "an adopted part does not advance the part number (the journal overwrites its own parts)",
        """        part = SealedPart(target, self.next_index, data_lines, target.stat().st_size)\n        self.next_index += 1""",
        """        part = SealedPart(target, self.next_index, data_lines, target.stat().st_size)""",
    ),
    M(
        "adopted-part-not-reported",
        "serving/journal.py",
        "an adopted part is counted durable but never handed to on_part (never uploaded)",
        """        if self.on_part is not None:\n            self.on_part(part.path, part.index)\n        self.parts.append(part)""",
        """        self.parts.append(part)""",
    ),
    M(
        "set-aside-lines-dropped",
        "serving/journal.py",
        "write_set_aside journals none of the lines it set aside",
        """            for line in lines:\n                self.write(line)""",
        """            for line in lines:\n                pass""",
    ),
    # -- engines/runner.py, engines/runner_deaths.py --------------------------------------
    M(
        "dying-runner-answers-not-staged",
        "engines/runner.py",
        "a dying runner's finished answers are not staged as a part (fix 10)",
        """        if len(self._split.answered):\n            staging.put_part(part, uuid.uuid4().hex[:8])""",
        """        pass""",
    ),
    M(
        "dead-engine-lines-staged",
        "engines/runner_deaths.py",
        "the dead engine's lines are staged as answers",
        """            split.dead_lines += 1\n            continue""",
        """            split.dead_lines += 1""",
    ),
    M(
        "runner-duplicates-counted-twice",
        "engines/runner.py",
        "on resume, the runner counts answers, not requests, in the parts (seed 2169 at fdc20fc, fixed with issue 34)",
        """if parts and answered_requests(job.report.custom_ids, answered, total) >= total:""",
        """if parts and len(answered) >= total:""",
    ),
    M(
        "no-lease-read-before-engine",
        "engines/runner.py",
        "no lease read between reading the staging and starting the engine",
        """        job.lease.ensure_held(verify=True)\n        job.raise_if_stopped()\n        local = None""",
        """        job.raise_if_stopped()\n        local = None""",
    ),
    M(
        "staged-results-not-resumed",
        "engines/runner.py",
        "a retry runs the engine again although the results are staged",
        """if self.settings.resume and not parts and staging.has_results():""",
        """if False:""",
    ),
    # -- batchfile/results.py: the results check --------------------------------------------
    M(
        "failure-beats-success",
        "batchfile/results.py",
        "of a request two tries' checkpoint parts answer, the first answer is kept even when it failed and the other succeeded (seed 10097)",
        """        best = max(lines, key=lambda line: (kind.get(line, 2), -line))""",
        """        best = min(lines)""",
    ),
    # -- engines/stall.py --------------------------------------------------------------------
    M(
        "stall-bound-never-fires",
        "engines/stall.py",
        "the runner's stall bound never fires: a wedged engine holds its GPUs until execution_timeout (issue 35)",
        """        return self.silent_s() >= self.timeout_s""",
        """        return False""",
    ),
    # -- run/answer_cache.py --------------------------------------------------------------
    M(
        "cache-newline-fix-removed",
        "run/answer_cache.py",
        "cached answers are appended without the newline fix (fix 7)",
        """            if _lacks_final_newline(results_path):\n                out.write(b"\\n")""",
        """            pass""",
    ),
    M(
        "cache-hits-counted-twice",
        "run/answer_cache.py",
        "the cached hits are counted twice as completed",
        """        results.completed += self.hits""",
        """        results.completed += 2 * self.hits""",
    ),
    M(
        "cache-hits-sent-too",
        "run/answer_cache.py",
        "the requests the cache answered are sent to the engine as well",
        """                if db.execute("SELECT 1 FROM hit WHERE custom_id = ?", (custom_id,)).fetchone():\n                    continue""",
        """                pass""",
    ),
    M(
        "cache-hits-not-staged",
        "run/answer_cache.py",
        "the hits are not staged for a retry (it looks the cache up again)",
        """        staging.put_file(cached_path, hits_key)""",
        """        pass""",
    ),
    # -- operators/shards.py: the merge (run by the shard scenario) ---------------------------
    M(
        "merge-missing-shard-unchecked",
        "operators/shards.py",
        "the merge publishes without the split's shard files telling it a mapped shard pushed no manifest",
        """            self.check_no_shard_missing(manifests)""",
        """            pass""",
        simulator="shards",
    ),
    M(
        "merge-counts-unchecked",
        "operators/shards.py",
        "the merge skips the per-shard check of its files' lines against the shard's manifest",
        """        check_merged_counts(manifests, result_lines, error_lines)""",
        """        pass""",
        simulator="shards",
    ),
    M(
        "merge-reads-shards-unpinned",
        "operators/shards.py",
        "the merge reads each shard's files without the ETag its manifest recorded (If-Match dropped)",
        """s3_body(self.hook, bucket, key, if_match=shard.etag)""",
        """s3_body(self.hook, bucket, key)""",
        simulator="shards",
    ),
    M(
        "merge-deleted-shard-retried",
        "operators/shards.py",
        "a shard file deleted since its manifest raises a raw NoSuchKey: retried, every try alike (shard seed 18, fixed)",
        """                if error_code(err) not in ("NoSuchKey", "404"):""",
        """                if True:""",
        simulator="shards",
    ),
    M(
        "merge-publishes-without-lease",
        "operators/shards.py",
        "the merge publishes without taking the output's lease (no fence holds another writer off)",
        """with self.store.lease(LeaseHolder.of_try(task_try(context, self.retries), manifest.fingerprint)):""",
        """with contextlib.nullcontext():""",
        simulator="shards",
    ),
)


def by_name(names: list[str] | None = None) -> list[Mutant]:
    """The mutants named (all when None); an unknown name is an error."""
    if not names:
        return list(MUTANTS)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"no such mutant: {', '.join(unknown)} (see tests/simulation/mutation.py)")
    return [known[n] for n in names]


def mutated_tree(mutant: Mutant | None, into: Path) -> Path:
    """A copy of the package under ``into`` with ``mutant`` applied, and of ``tests`` beside it."""
    shutil.copytree(REPO / PACKAGE, into / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    # A copy, not a link: the tests in the worktree may change while a campaign runs.
    shutil.copytree(REPO / "tests", into / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", into / "pyproject.toml")
    # What the unit tests import beside the package: the embedded SeaweedFS, the example DAGs' settings.
    for extra in ("vllm_batch_embedded", "dags"):
        shutil.copytree(REPO / extra, into / extra, ignore=shutil.ignore_patterns("__pycache__"))
    (into / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "simulate.py", into / "benchmarks" / "simulate.py")
    if mutant is not None:
        mutant.apply(into)
    return into


#: Run in the mutated tree: the simulator over the seeds, stopping at the first violation.
_WORKER = r"""
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd())
import tests.conftest  # the throw-away AIRFLOW_HOME, before Airflow is imported
import airflow_vllm_batch
assert airflow_vllm_batch.__file__.startswith(os.getcwd()), airflow_vllm_batch.__file__
from pathlib import Path
from tests.simulation.mutation import first_violation
start, count, simulator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with tempfile.TemporaryDirectory(prefix="vllm-batch-mutant-") as work:
    print(json.dumps(first_violation(range(start, start + count), Path(work), simulator)))
"""


def first_violation(seeds, workdir: Path, simulator: str = "run") -> dict:
    """Run the schedules of ``seeds`` until one violates an invariant; say which, and after how many.

    :param simulator: ``run`` (the run protocol's schedules) or ``shards`` (split -> shards -> merge).
    """
    import traceback

    if simulator == "shards":
        from tests.simulation.shards import (
            check_shard_schedule as check_all,
            run_shard_schedule as run_schedule,
        )
    else:
        from tests.simulation.invariants import check_all
        from tests.simulation.world import run_schedule

    ran = 0
    for seed in seeds:
        ran += 1
        try:
            world = run_schedule(seed, workdir / "schedule")
            found = check_all(world)
        except Exception:  # noqa: BLE001 - the simulator itself failed under the mutant
            return {
                "caught": True,
                "schedules": ran,
                "seed": seed,
                "checks": ["simulator-crash"],
                "detail": traceback.format_exc(limit=-2)[-600:],
            }
        if found:
            return {
                "caught": True,
                "schedules": ran,
                "seed": seed,
                "checks": sorted({v.check for v in found}),
                "detail": found[0].detail[:300],
            }
    return {"caught": False, "schedules": ran}


def run_simulator(mutant: Mutant | None, schedules: int, start: int = 0, timeout_s: float = 3600) -> dict:
    """The simulator against ``mutant`` (None: the real code) in a subprocess on a mutated copy of the package."""
    with tempfile.TemporaryDirectory(prefix="vllm-batch-mutation-") as tmp:
        root = mutated_tree(mutant, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _WORKER,
                str(start),
                str(schedules),
                mutant.simulator if mutant is not None else "run",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        # A mutant that breaks the import of the package is caught by anything that imports it.
        return {
            "caught": True,
            "schedules": 0,
            "checks": ["import-error"],
            "detail": done.stderr[-600:],
            "seconds": seconds,
        }
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "seconds": seconds}


#: The unit tests of each protocol module (fast ones: SeaweedFS, no engine).
UNIT_TESTS: dict[str, list[str]] = {
    "storage/publishing.py": ["tests/unit/test_storage.py"],
    "storage/staging.py": ["tests/unit/test_storage.py"],
    "lease.py": ["tests/unit/test_lease.py", "tests/unit/test_storage.py"],
    "run/batch.py": [
        "tests/unit/operators/test_vllm_batch.py",
        "tests/unit/operators/test_vllm_batch_server.py",
        "tests/unit/operators/test_vllm_batch_cache.py",
    ],
    "engines/server.py": [
        "tests/unit/engines/test_lease_before_sending.py",
        "tests/unit/operators/test_vllm_batch_server.py",
    ],
    "serving/journal.py": [
        "tests/unit/serving/test_journal.py",
        "tests/unit/operators/test_vllm_batch_server.py",
    ],
    "engines/runner.py": [
        "tests/unit/engines/test_runner_deaths.py",
        "tests/unit/engines/test_lease_before_sending.py",
        "tests/unit/operators/test_vllm_batch.py",
    ],
    "engines/runner_deaths.py": ["tests/unit/engines/test_runner_deaths.py"],
    "engines/stall.py": ["tests/unit/engines/test_stall.py", "tests/unit/operators/test_vllm_batch_stall.py"],
    "operators/shards.py": ["tests/unit/operators/test_shards.py", "tests/unit/test_sharding.py"],
    "run/answer_cache.py": [
        "tests/unit/run/test_answer_cache.py",
        "tests/unit/operators/test_vllm_batch_cache.py",
    ],
}


def run_unit_tests(mutant: Mutant, timeout_s: float = 1800) -> dict:
    """The module's unit tests against ``mutant`` (stopping at the first failure)."""
    files = UNIT_TESTS.get(mutant.module, [])
    with tempfile.TemporaryDirectory(prefix="vllm-batch-mutation-") as tmp:
        root = mutated_tree(mutant, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "not engine and not integration",
                *files,
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    failed = [
        line.split(" ")[1]
        for line in done.stdout.splitlines()
        if line.startswith("FAILED ") or line.startswith("ERROR ")
    ]
    if done.returncode not in (0, 1):
        # 2-5: interrupted, internal error, usage error, nothing collected: the harness failed, not the mutant.
        raise RuntimeError(
            f"the unit tests could not run against mutant {mutant.name} (pytest exit {done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
        )
    return {
        "caught": done.returncode == 1,
        "failed": failed[:3],
        "seconds": time.perf_counter() - started,
        "tail": done.stdout[-300:],
    }


def replay(mutant: Mutant | None, seed: int, trace: bool = False) -> str:
    """``benchmarks/simulate.py --seed N`` on a mutated copy of the package: the schedule that caught it, call by call."""
    with tempfile.TemporaryDirectory(prefix="vllm-batch-mutation-") as tmp:
        root = mutated_tree(mutant, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [
                sys.executable,
                "benchmarks/simulate.py",
                "--seed",
                str(seed),
                *(["--shards"] if mutant is not None and mutant.simulator == "shards" else []),
                *(["--trace"] if trace else []),
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    return done.stdout + done.stderr[-2000:]
