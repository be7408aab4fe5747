"""The dependency floors in pyproject.toml admit no version that lacks what the code uses.

A floor is checked against the package itself: the lowest release the floor admits is
installed (its wheel only, cached under ``.cache/`` as the floor stage caches its venv,
``tests/integration/test_floor_wheel.py``) and asked for every name the provider uses.
The floor stage's own venv cannot show this: Airflow's constraints pin a much newer
aiohttp there.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

import airflow_vllm_batch

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
#: The provider imported (the floor stage's is the installed wheel's, not the clone's).
PROVIDER = Path(airflow_vllm_batch.__file__).parent


def _requirements(name: str) -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lists = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
    found = [Requirement(r) for deps in lists for r in deps if Requirement(r).name == name]
    assert found, f"{name} is not a dependency"
    return found


def _floor(requirement: Requirement) -> Version:
    """The lowest release ``requirement`` admits: its ``>=``, ``~=`` or ``==`` bound."""
    bounds = [Version(spec.version) for spec in requirement.specifier if spec.operator in (">=", "~=", "==")]
    assert bounds, f"{requirement} has no floor"
    return max(bounds)


def _names_used(module: str) -> set[str]:
    """Every ``<module>.<name>`` the provider's code reads, annotations included."""
    names = set()
    for path in PROVIDER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == module
            ):
                names.add(node.attr)
    return names


def _installed_at(name: str, version: Version) -> Path:
    """A directory holding ``name==version`` (the wheel only: its own requirements come from this venv)."""
    target = REPO / ".cache" / f"floor-{name}-{version}"
    if not (target / ".complete").exists():
        argv = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--target",
            str(target),
            f"{name}=={version}",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, (
            f"could not install {name}=={version} to check the floor: {done.stderr[-2000:]}"
        )
        (target / ".complete").touch()
    return target


ASK = """
import importlib, json, sys
module = importlib.import_module(sys.argv[1])
print(json.dumps({"version": module.__version__, "file": module.__file__,
                  "missing": sorted(n for n in sys.argv[2:] if not hasattr(module, n))}))
"""


def test_aiohttp_at_its_floor_has_every_name_the_provider_uses(tmp_path):
    names = _names_used("aiohttp")
    # serving/stream.py tells a connect timeout (the server is gone) from a slow answer with
    # aiohttp.ConnectionTimeoutError; the floor exists for it.
    assert "ConnectionTimeoutError" in names
    for requirement in _requirements("aiohttp"):
        floor = _floor(requirement)
        target = _installed_at("aiohttp", floor)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        done = subprocess.run(
            [sys.executable, "-c", ASK, "aiohttp", *sorted(names)],
            env={**env, "PYTHONPATH": str(target)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        asked = json.loads(done.stdout.splitlines()[-1])
        assert asked["file"].startswith(str(target)), asked
        assert Version(asked["version"]) == floor, asked
        assert asked["missing"] == [], (
            f"{requirement}: aiohttp {floor} lacks {asked['missing']}; raise the floor"
        )
