"""The provider as a user gets it: the wheel, installed with the oldest supported Airflow.

The wheel is built from this clone and installed into a venv of ``tests/floor/requirements.txt``
(Airflow 3.0.6 and the amazon provider of its time, pinned by ``tests/floor/constraints.txt``),
cached under ``.cache/`` by a hash of the two files. Nothing runs from the clone's package:
the checks run from a copy of the clone without ``airflow_vllm_batch/`` (the tests, the DAGs
and the embedded default), so every import of the provider is the installed wheel's. vLLM
is not in that venv: the example DAG's engine runs in this (the main) venv, through the
engine's ``python`` (``VLLMRunner(python=...)``).

The wheel, the venv and the unit tests' run on it are prepared in the background from
collection (``floor_venv.py``); the tests here wait for them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import zipfile
from pathlib import Path

import pytest

from tests.integration.floor_venv import FLOOR, REPO, run, user_env
from vllm_batch_embedded.demo import BUCKET, embedded_env

pytestmark = [pytest.mark.integration, pytest.mark.floor]

#: What importing the operators may add to importing Airflow and the amazon provider.
MAX_IMPORT_OVERHEAD_S = 0.3
#: Loaded by the engine or the server client only, never by a DAG file's imports.
ENGINE_MODULES = ("vllm", "torch", "transformers", "aiohttp")


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The wheel of this clone's committed and working-tree files (``floor_venv.build_wheel``)."""
    return FLOOR.wait().wheel


@pytest.fixture(scope="module")
def floor() -> Path:
    """The floor venv's bin directory, with this wheel installed and its requirements met."""
    return FLOOR.wait().bin


@pytest.fixture(scope="module")
def clone_without_provider() -> Path:
    """A copy of what a clone holds besides the provider: tests, DAGs, the embedded default."""
    return FLOOR.wait().clone


def test_the_wheel_holds_the_provider_and_nothing_of_the_clone(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"airflow_vllm_batch", "airflow_vllm_batch-0.1.0.dist-info"}
    assert not [
        name for name in zipfile.ZipFile(wheel).namelist() if "embedded" in name or "examples" in name
    ]
    # Exactly the clone's modules: none that a move or a deletion left in an old build directory.
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    assert shipped == {
        path.relative_to(REPO).as_posix() for path in (REPO / "airflow_vllm_batch").rglob("*.py")
    }


def test_airflow_on_the_floor_lists_the_provider(floor, tmp_path):
    done = run(
        [str(floor / "airflow"), "providers", "list", "-o", "plain"],
        env=user_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    # Log lines may precede the table; the provider's row names the distribution and its version.
    assert [line for line in done.stdout.splitlines() if "airflow-vllm-batch" in line and "0.1.0" in line]


PLUGINS = """
import json
from airflow import plugins_manager
plugins_manager.ensure_plugins_loaded()
found = [p for p in plugins_manager.plugins or [] if p.name == "vllm_batch_openai_api"]
print(json.dumps({"loaded": len(found), "apps": [len(p.fastapi_apps) for p in found]}))
"""


def test_airflow_on_the_floor_loads_the_plugin_which_mounts_no_api_below_3_1(floor, tmp_path):
    done = run([str(floor / "python"), "-c", PLUGINS], env=user_env(tmp_path), cwd=tmp_path, timeout=300)
    # The API needs Airflow 3.1 (docs/openai-api.md): on the floor's 3.0 the plugin loads and mounts nothing.
    assert json.loads(done.stdout.splitlines()[-1]) == {"loaded": 1, "apps": [0]}


PARSE = """
import json, sys
sys.path.append(sys.argv[1])  # as the dag processor puts the bundle's root on sys.path
from airflow.models.dagbag import DagBag
bag = DagBag(sys.argv[1], include_examples=False)
import airflow_vllm_batch
print(json.dumps({"errors": bag.import_errors, "dags": sorted(bag.dag_ids), "provider": airflow_vllm_batch.__file__}))
"""


def test_the_example_dags_parse_with_only_the_wheel_installed(floor, clone_without_provider, tmp_path):
    dags = clone_without_provider / "dags"
    done = run(
        [str(floor / "python"), "-c", PARSE, str(dags)], env=user_env(tmp_path), cwd=tmp_path, timeout=300
    )
    parsed = json.loads(done.stdout.splitlines()[-1])
    assert parsed["errors"] == {}
    assert parsed["provider"].startswith(str(floor.parent))  # the wheel's, not the clone's
    # The Kubernetes example defines no DAG without the Kubernetes client (the cncf-kubernetes extra).
    assert parsed["dags"] == sorted(
        p.stem
        for p in dags.glob("vllm_batch_*.py")
        if p.stem not in ("vllm_batch_examples", "vllm_batch_sharded_k8s")
    )


IMPORT = f"""
import gc, json, sys, time
import airflow
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
# Airflow leaves a full collection of its ~150k objects due (~0.2 s): whatever allocates
# next pays it, any provider's import or the DAG file itself. It is Airflow's cost, so it is
# settled before the clock starts; what is left is what the operators' import adds.
gc.collect()
cpu, wall = time.process_time(), time.perf_counter()
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.operators.shards import VLLMBatchMergeOperator, VLLMBatchSplitOperator
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
print(json.dumps({{"cpu_s": cpu, "wall_s": wall, "modules": sorted(m for m in sys.modules if m.split(".")[0] in {ENGINE_MODULES!r})}}))
"""


def test_importing_the_operators_loads_no_engine_library_and_adds_at_most_0_3_s(floor, tmp_path):
    def measure() -> dict:
        done = run([str(floor / "python"), "-c", IMPORT], env=user_env(tmp_path), cwd=tmp_path, timeout=300)
        return json.loads(done.stdout.splitlines()[-1])

    # CPU time, not wall: on a loaded machine the wall clock counts other processes' turns.
    runs = [measure() for _ in range(7)]
    assert runs[0]["modules"] == []
    cpu = statistics.median(run["cpu_s"] for run in runs)
    wall = statistics.median(run["wall_s"] for run in runs)
    print(
        f"importing the operators after Airflow and amazon: median {cpu:.3f} s CPU ({wall:.3f} s wall) of 7 runs"
    )
    assert cpu <= MAX_IMPORT_OVERHEAD_S


def test_the_unit_tests_that_need_no_vllm_pass_on_the_floor():
    # Run in the background from collection (floor_venv.py): `pytest -q tests/unit -m "not vllm"`
    # with the floor venv's Python, from the copy of the clone without the provider.
    done = FLOOR.unit_run()
    assert done.returncode == 0, done.stdout[-6000:]
    print(done.stdout.splitlines()[-1])


def test_an_example_dag_runs_end_to_end_on_the_floor_with_the_engine_from_the_main_venv(
    floor, clone_without_provider, seaweed, tiny_model, tmp_path
):
    home = tmp_path / "airflow"
    home.mkdir()
    env = embedded_env(seaweed, tiny_model, home, base=user_env(home))
    env.update(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(clone_without_provider / "dags"),
            # The embedded default's modules from the copy, and the DAG folder, which Airflow
            # 3.0's `dags test` does not put on sys.path; never the clone's provider.
            "PYTHONPATH": os.pathsep.join(
                [str(clone_without_provider), str(clone_without_provider / "dags")]
            ),
            "AIRFLOW_VLLM_BATCH_ENGINE_PYTHON": sys.executable,
        }
    )
    airflow = str(floor / "airflow")
    client = seaweed.client()

    def manifests() -> set[str]:
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix="vllm-batch/vllm_batch_prompts/").get(
            "Contents", []
        )
        return {o["Key"] for o in listed if o["Key"].endswith(".manifest.json")}

    # The session's S3 is shared: test_example_dags may have run this DAG on it already.
    before = manifests()
    run([airflow, "db", "migrate"], env=env, cwd=tmp_path, timeout=600)
    run([airflow, "dags", "test", "vllm_batch_prompts"], env=env, cwd=tmp_path, timeout=900)
    (manifest_key,) = manifests() - before
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read())
    assert manifest["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
