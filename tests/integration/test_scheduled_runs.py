"""The pipeline DAG on its schedule, in backfills and from the UI, under a real Airflow deployment.

One LocalExecutor deployment for the module (``vllm_batch_embedded/airflow_deployment.py``: api-server, scheduler,
dag-processor on 127.0.0.1, a throw-away home; every process stopped and checked gone at
the end) on a throw-away PostgreSQL (``postgres.py``: Airflow does not support creating a
backfill on SQLite while the scheduler writes, and fails it now and then with "database is
locked") runs the repo's own ``dags/vllm_batch_pipeline.py`` and
``dags/vllm_batch_asset_consumer.py``, unedited, with a start date three days back and
catchup on (``AIRFLOW_VLLM_BATCH_START_DATE``, ``AIRFLOW_VLLM_BATCH_CATCHUP``).

The engine is one warm vLLM server (CPU, tiny model) started once by a fixture and given
to the DAGs through a ``vllm`` connection (``AIRFLOW_VLLM_BATCH_VLLM_CONN_ID``): an engine
start costs 20-25 s here, and the scheduling under test is the same for either engine.
"Starts no engine" on a re-run therefore means: the server's
``vllm:request_success_total`` does not move, and the task log says it reused the output.

* :func:`test_catchup_backfill_and_a_backfill_rerun_run_by_themselves` — the scheduler
  runs the 3 past intervals by itself; ``airflow backfill create`` over 3 more dates runs;
  each of the 6 runs publishes its own output; a backfill re-run of a completed date sends
  no request and says so; the asset consumer reports every asset event once, with counts.
* :func:`test_the_trigger_form_in_a_real_browser` — headless Chromium (Debian's, driven by
  Selenium, see ``ui_browser.py``) logs in, opens the DAG, sees an invalid Param refused
  with the Param's message, triggers with two Params changed, waits for success and follows
  the task's "vLLM batch output" link to the results object. Screenshots of every step:
  ``test-artifacts/ui/``.

Fresh processes: a deployment of its own on PostgreSQL (a scheduler running catchup and
backfills); the engine is the session's warm server (``warm_vllm``).
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.dagrun import REPO
from tests.integration.postgres import Postgres
from tests.integration.ui_browser import Browser, missing_browser
from tests.integration.vllm_metrics import requests_answered
from vllm_batch_embedded.airflow_deployment import (
    RUN_DONE,
    Deployment,
    local_executor_deployment,
    wait_until,
)

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess
    from vllm_batch_embedded.seaweedfs import SeaweedFS

pytestmark = [pytest.mark.integration, pytest.mark.engine]

PIPELINE = "vllm_batch_pipeline"
CONSUMER = "vllm_batch_asset_consumer"
TASK_ID = "vllm_batch"
#: A bucket of this module's own: the pipeline's keys are named by run id, which other modules' runs share.
BUCKET = "scheduled"
CONN_ID = "vllm_warm"
#: The pipeline's default n_requests: scheduled runs and backfills take the Params' defaults.
N_DEFAULT = 8
#: Six DAG runs of three tasks each, on two cores shared with other work: generous.
RUNS_TIMEOUT_S = 600


@dataclass
class Scheduled:
    """The deployment, its S3 and its warm vLLM server."""

    dep: Deployment
    s3: SeaweedFS
    server: VLLMServerProcess
    #: Midnight UTC of the day the module started; the catchup and backfill dates count back from it.
    today: datetime

    def airflow(self, *args: str) -> str:
        """Run the ``airflow`` CLI once against the deployment's database, as an operator would on its host.

        Not run again on failure: a command can fail after committing part of its work
        (``backfill create`` commits the backfill before its runs), and a second try then fails
        for another reason ("Another backfill is running").
        """
        airflow = str(Path(sys.executable).with_name("airflow"))
        done = subprocess.run(
            [airflow, *args],
            env=self.dep.env,
            cwd=self.dep.home,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, (
            f"airflow {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        return done.stdout

    def runs(self, dag_id: str = PIPELINE) -> list[dict]:
        return self.dep.request("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]

    def requests_answered(self) -> float:
        """What the warm server's ``/metrics`` counts as answered requests so far."""
        return requests_answered(self.server.hook.base_url)

    def manifests(self) -> dict[str, dict]:
        """Every manifest the pipeline published in this module's bucket, by its key."""
        client = self.s3.client()
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"vllm-batch/{PIPELINE}/").get("Contents", [])
        keys = [o["Key"] for o in listed if o["Key"].endswith(".manifest.json")]
        return {key: json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read()) for key in keys}

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
        path = (
            f"{self.dep.run_path(dag_id, run_id)}/taskInstances/{task_id}/xcomEntries/{key}?deserialize=true"
        )
        value = self.dep.request("GET", path)["value"]
        return json.loads(value) if isinstance(value, str) else value


@pytest.fixture(scope="module")
def scheduled(seaweed: SeaweedFS, tiny_model: Path, tmp_path_factory, warm_vllm) -> Iterator[Scheduled]:
    """The deployment with the pipeline (catchup from 2 days back) and the asset consumer, both unpaused.

    The warm vLLM server is the session's of the plain CPU flags (conftest ``warm_vllm``); when
    no module asked for it yet, it starts while the deployment does (each takes 20-40 s here).
    Its connection is added through the REST API once it is ready, before the pipeline is unpaused.
    """
    seaweed.create_bucket(BUCKET)
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    extra_env = {
        "AIRFLOW_VLLM_BATCH_BUCKET": BUCKET,
        "AIRFLOW_VLLM_BATCH_START_DATE": (today - timedelta(days=2)).isoformat(),
        "AIRFLOW_VLLM_BATCH_CATCHUP": "true",
        "AIRFLOW_VLLM_BATCH_VLLM_CONN_ID": CONN_ID,
        # The output link opens the object in SeaweedFS's filer, which a browser can show.
        "AIRFLOW__VLLM_BATCH__OUTPUT_LINK_TEMPLATE": seaweed.filer_url + "/buckets/{bucket}/{key}",
    }
    dag_files = {name: (REPO / "dags" / name).read_text() for name in (f"{PIPELINE}.py", f"{CONSUMER}.py")}
    home = tmp_path_factory.mktemp("scheduled")
    survivors: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(warm_vllm)
        try:
            with (
                Postgres() as database,
                local_executor_deployment(
                    seaweed, tiny_model, home, dag_files, extra_env, database.url
                ) as dep,
            ):
                # The consumer first: asset events of the first pipeline runs must find it unpaused.
                dep.wait_for_dag(CONSUMER)
                server = starting.result(timeout=360)
                hook = server.hook
                assert hook is not None
                host, port = hook.base_url.removeprefix("http://").split(":")
                dep.request(
                    "POST",
                    "/api/v2/connections",
                    {
                        "connection_id": CONN_ID,
                        "conn_type": "vllm",
                        "host": host,
                        "port": int(port),
                        "password": hook.api_key,
                    },
                )
                dep.wait_for_dag(PIPELINE)
                assert not (home / "airflow.db").exists(), "the deployment fell back to SQLite"
                yield Scheduled(dep=dep, s3=seaweed, server=server, today=today)
                survivors = dep.stop()
        finally:
            concurrent.futures.wait([starting])
    assert survivors == [], f"processes of the deployment still alive after stop: {survivors}"


def _day(date: datetime) -> str:
    return date.strftime("%Y-%m-%d")


def test_catchup_backfill_and_a_backfill_rerun_run_by_themselves(scheduled: Scheduled):
    dep, today = scheduled.dep, scheduled.today
    started = time.monotonic()
    catchup_dates = {_day(today - timedelta(days=d)) for d in (2, 1, 0)}
    backfill_dates = {_day(today - timedelta(days=d)) for d in (5, 4, 3)}

    def runs_done(kinds: tuple[str, ...], count: int) -> Callable[[], list[dict] | None]:
        def done() -> list[dict] | None:
            runs = [r for r in scheduled.runs() if r["run_type"] in kinds]
            return runs if len(runs) >= count and all(r["state"] in RUN_DONE for r in runs) else None

        return done

    # The scheduler catches up by itself; then a backfill of three earlier dates is created
    # from the CLI.
    wait_until("the 3 catchup runs to end", runs_done(("scheduled",), 3), RUNS_TIMEOUT_S, dep, interval=2)
    scheduled.airflow(
        "backfill", "create", "--dag-id", PIPELINE,
        "--from-date", _day(today - timedelta(days=5)), "--to-date", _day(today - timedelta(days=3)),
    )  # fmt: skip
    runs = wait_until(
        "the 3 backfill runs to end", runs_done(("scheduled", "backfill"), 6), RUNS_TIMEOUT_S, dep, interval=2
    )
    by_type = {
        kind: {r["logical_date"][:10]: r for r in runs if r["run_type"] == kind}
        for kind in ("scheduled", "backfill")
    }
    assert set(by_type["scheduled"]) == catchup_dates, runs
    assert set(by_type["backfill"]) == backfill_dates, runs
    failed = [r["dag_run_id"] for r in runs if r["state"] != "success"]
    assert not failed, dep.diagnose(PIPELINE, failed[0], TASK_ID)
    print(f"\n6 runs (3 catchup, 3 backfill) ended in {time.monotonic() - started:.0f}s")

    # Every run published its own output, each answering all its requests.
    manifests = scheduled.manifests()
    assert len(manifests) == 6
    outputs = {m["output_uri"] for m in manifests.values()}
    assert len(outputs) == 6
    for run in runs:
        manifest = scheduled.xcom(PIPELINE, run["dag_run_id"], TASK_ID)
        assert manifest["request_counts"] == {"total": N_DEFAULT, "completed": N_DEFAULT, "failed": 0}
        assert manifest["identity"]["engine"] == "vllm_connection"
        assert manifest["output_uri"] in outputs

    # A backfill re-run of a completed date: the same run, cleared and run again, reuses its output.
    rerun = by_type["scheduled"][_day(today - timedelta(days=1))]
    before = scheduled.requests_answered()
    tries_before = dep.task_instance(PIPELINE, rerun["dag_run_id"], TASK_ID)["try_number"]
    day = _day(today - timedelta(days=1))
    # One running backfill per DAG: the scheduler marks the first one complete a loop after its last run.
    wait_until(
        "the first backfill to be marked complete",
        lambda: (
            (backfills := dep.request("GET", f"/api/v2/backfills?dag_id={PIPELINE}")["backfills"])
            and all(b["completed_at"] for b in backfills)
        ),
        120,
        dep,
    )
    scheduled.airflow(
        "backfill",
        "create",
        "--dag-id",
        PIPELINE,
        "--from-date",
        day,
        "--to-date",
        day,
        "--reprocess-behavior",
        "completed",
    )

    def rerun_done() -> dict | None:
        ti = dep.task_instance(PIPELINE, rerun["dag_run_id"], TASK_ID)
        state = dep.dag_run(PIPELINE, rerun["dag_run_id"])["state"]
        return ti if ti["try_number"] > tries_before and state in RUN_DONE else None

    ti = wait_until("the backfill re-run to end", rerun_done, RUNS_TIMEOUT_S, dep, interval=2)
    assert dep.dag_run(PIPELINE, rerun["dag_run_id"])["state"] == "success", dep.diagnose(
        PIPELINE, rerun["dag_run_id"], TASK_ID
    )
    assert dep.dag_run(PIPELINE, rerun["dag_run_id"])["run_type"] == "backfill"
    assert scheduled.requests_answered() == before, "the re-run sent requests to the engine"
    log = dep.task_log(PIPELINE, rerun["dag_run_id"], TASK_ID, ti["try_number"])
    assert "Not running the engine again" in log
    assert "(reused: no engine ran in this try)" in log
    assert len(scheduled.manifests()) == 6
    print(f"catchup, backfill and re-run took {time.monotonic() - started:.0f}s")

    # The asset consumer reports every asset event of the pipeline once, with its counts.
    events = dep.request("GET", f"/api/v2/assets/events?source_dag_id={PIPELINE}&limit=100")["asset_events"]
    pipeline_runs = {r["dag_run_id"] for r in runs}
    assert {e["source_run_id"] for e in events} >= pipeline_runs
    assert sum(1 for e in events if e["source_run_id"] == rerun["dag_run_id"]) == 2

    def every_event_reported() -> list[dict] | None:
        consumer_runs = scheduled.runs(CONSUMER)
        if not consumer_runs or any(r["state"] not in RUN_DONE for r in consumer_runs):
            return None
        reports = [
            s
            for r in consumer_runs
            for s in scheduled.xcom(CONSUMER, r["dag_run_id"], "report_results") or []
        ]
        return reports if len(reports) >= len(events) else None

    reports = wait_until(
        "the consumer to report every asset event", every_event_reported, 180, dep, interval=2
    )
    assert len(reports) == len(events)
    reported = [r["source"].removeprefix(f"{PIPELINE}/") for r in reports]
    assert sorted(reported) == sorted(e["source_run_id"] for e in events)
    for report in reports:
        assert report["request_counts"] == {"total": N_DEFAULT, "completed": N_DEFAULT, "failed": 0}
        assert report["output_uri"] in outputs


@pytest.fixture
def browser() -> Iterator[Browser]:
    if reason := missing_browser():
        print(f"\nSKIPPED the browser test: {reason}")
        pytest.skip(reason)
    chromium = Browser()
    try:
        yield chromium
    finally:
        chromium.close()
        print(f"\nScreenshots of the UI test: {chromium.artifacts}/ ({len(chromium.screenshots)} files)")


@pytest.mark.browser
def test_the_trigger_form_in_a_real_browser(scheduled: Scheduled, browser: Browser):
    """A person's path: log in, open the DAG, trigger it with two Params changed, follow the output link."""
    dep = scheduled.dep
    api = dep.api_url
    password = json.loads((dep.home / "passwords.json").read_text())["admin"]
    dialog = "//div[@role='dialog']"

    # Log in on the simple auth manager's own page.
    browser.driver.get(api + "/")
    browser.find("//input[@name='username']").send_keys("admin")
    browser.find("//input[@name='password']").send_keys(password)
    browser.screenshot("login")
    browser.click("//button[@type='submit']")
    browser.wait(lambda d: "/auth/login" not in d.current_url)

    browser.driver.get(f"{api}/dags/{PIPELINE}")
    browser.find(f"//a[normalize-space()='{TASK_ID}']")
    browser.screenshot("dag")

    # An invalid value is refused with the Param's message, and no run is created. The form's
    # number fields clamp to the Param's range, so the value goes in through the conf editor.
    manual_runs = sum(1 for r in scheduled.runs() if r["run_type"] == "manual")
    browser.click("//button[normalize-space()='Trigger']")
    browser.click(f"{dialog}//button[normalize-space()='Advanced Options']")
    n_requests_value = browser.find(
        f"{dialog}//div[contains(@class,'view-line')][.//span[contains(., '\"n_requests\"')]]//span[normalize-space()='8']",
        clickable=True,
    )
    browser.double_click_and_type(n_requests_value, "0")
    browser.click(f"{dialog}//button[normalize-space()='Trigger']")
    alert = browser.find(f"{dialog}//*[@data-testid='error-alert']")
    browser.scroll_to(alert)
    browser.wait(lambda d: "less than the minimum" in alert.text)
    browser.settle()
    browser.screenshot("invalid-param-refused")
    assert "Invalid input for param n_requests: 0 is less than the minimum of 1" in alert.text
    assert sum(1 for r in scheduled.runs() if r["run_type"] == "manual") == manual_runs

    # A fresh form: two Params changed in their fields, then Trigger.
    browser.driver.get(f"{api}/dags/{PIPELINE}")
    browser.click("//button[normalize-space()='Trigger']")
    browser.type_into(browser.find(f"{dialog}//input[@name='element_n_requests']"), "5")
    browser.type_into(browser.find(f"{dialog}//input[@name='element_max_tokens']"), "4")
    browser.scroll_to(browser.find(f"{dialog}//input[@name='element_model']"))
    browser.driver.execute_script("document.activeElement.blur()")
    browser.settle()
    browser.screenshot("trigger-form")
    browser.click(f"{dialog}//button[normalize-space()='Trigger']")
    browser.wait(lambda d: "/runs/" in d.current_url)
    run_id = urllib.parse.unquote(browser.driver.current_url.split("/runs/", 1)[1].split("/")[0])
    assert dep.wait_for_run(PIPELINE, run_id, RUNS_TIMEOUT_S) == "success", dep.diagnose(
        PIPELINE, run_id, TASK_ID
    )
    conf = dep.dag_run(PIPELINE, run_id)["conf"]
    assert (conf["n_requests"], conf["max_tokens"]) == (5, 4)
    manifest = scheduled.xcom(PIPELINE, run_id, TASK_ID)
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    browser.driver.refresh()
    browser.find("//*[normalize-space()='Success' or normalize-space()='success']")
    browser.settle()
    browser.screenshot("run-success")

    # The inference task's details hold the "vLLM batch output" link; it opens the results object.
    browser.driver.get(
        f"{api}/dags/{PIPELINE}/runs/{urllib.parse.quote(run_id, safe='')}/tasks/{TASK_ID}/details"
    )
    link = browser.find("//a[normalize-space()='vLLM batch output']", clickable=True)
    bucket, key = manifest["output_uri"].removeprefix("s3://").split("/", 1)
    assert link.get_attribute("href") == f"{scheduled.s3.filer_url}/buckets/{bucket}/{key}"
    browser.settle()
    browser.screenshot("task-extra-link")
    windows = set(browser.driver.window_handles)
    link.click()
    browser.wait(lambda d: len(d.window_handles) > len(windows))
    browser.driver.switch_to.window((set(browser.driver.window_handles) - windows).pop())
    shown = browser.wait(lambda d: d.find_element("tag name", "body").text.strip())
    browser.screenshot("output-object")
    published = scheduled.s3.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert shown.splitlines() == published.strip().splitlines()
    lines = [json.loads(line) for line in shown.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"request-{i}" for i in range(5)]
    assert all(line["response"]["body"]["usage"]["completion_tokens"] <= 4 for line in lines)
    assert [p.name for p in browser.screenshots] == [
        "01-login.png", "02-dag.png", "03-invalid-param-refused.png", "04-trigger-form.png",
        "05-run-success.png", "06-task-extra-link.png", "07-output-object.png",
    ]  # fmt: skip
