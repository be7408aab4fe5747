"""The dependency floors in pyproject.toml admit no version that lacks what the code uses."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _requirements(name: str) -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lists = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
    found = [Requirement(r) for deps in lists for r in deps if Requirement(r).name == name]
    assert found, f"{name} is not a dependency"
    return found


def test_aiohttp_floor_has_connection_timeout_error():
    # serving/stream.py tells a connect timeout (the server is gone) from a slow answer with
    # aiohttp.ConnectionTimeoutError, which aiohttp added in 3.10.
    for requirement in _requirements("aiohttp"):
        assert "3.9.5" not in requirement.specifier and "3.10.0" in requirement.specifier, requirement
