"""The documentation builds as ``make docs`` builds it: warnings are errors, so the docs cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_the_docs_build_without_a_warning(tmp_path):
    # make docs' command, into a directory of this test's own.
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(REPO / "docs"),
            str(tmp_path / "html"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    # The reference is generated: the operator's page holds its docstring's parameters.
    operators = (tmp_path / "html" / "reference" / "operators.html").read_text()
    assert "VLLMBatchOperator" in operators
    assert "input_uri" in operators


def _contributing_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Contributing") :]
    block = section[
        section.index("```bash\n") + len("```bash\n") : section.index("```\n", section.index("```bash"))
    ]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_contributing_commands_are_the_makefile_and_pre_commit_checks_with_the_pinned_tools():
    # README's Contributing block: each make target exists, make test runs lint first, and the
    # pre-commit hooks run the tools pyproject.toml pins (the venv's), so the three cannot drift.
    import re

    import tomllib

    commands = _contributing_commands()
    makefile = (REPO / "Makefile").read_text()
    for command in commands:
        if command.startswith("make "):
            target = command.split()[1]
            assert re.search(rf"^{target}:", makefile, re.M), (
                f"README names `make {target}`, the Makefile has no such target"
            )
    lint = makefile[makefile.index("\nlint:") :].split("\n\n")[0]
    assert "ruff check ." in lint
    assert "ruff format --check ." in lint
    assert "$(BIN)/mypy" in lint
    assert re.search(r"^test: .*\blint\b", makefile, re.M), "make test must run make lint"
    assert any(c.startswith(".venv/bin/pre-commit ") for c in commands)
    config = (REPO / ".pre-commit-config.yaml").read_text()
    for entry in (".venv/bin/ruff check", ".venv/bin/ruff format", ".venv/bin/mypy"):
        assert f"entry: {entry}" in config
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = dict(d.split("==") for d in dev if "==" in d)
    ruff = subprocess.run(
        [str(REPO / ".venv/bin/ruff"), "--version"], capture_output=True, text=True, check=True
    )
    mypy = subprocess.run(
        [str(REPO / ".venv/bin/mypy"), "--version"], capture_output=True, text=True, check=True
    )
    assert ruff.stdout.split()[1] == pins["ruff"]
    assert mypy.stdout.split()[1] == pins["mypy"]
    assert f"v{pins['ruff']}" in config  # the upstream hook's version named there


def test_the_readme_is_a_page_that_starts_with_the_two_commands():
    # Issue 43: a README read in five minutes; .ci/run runs its two commands, in its order.
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the rest to docs/"
    first = "\n".join(lines[:60])
    block = first[first.index("```bash\n") : first.index("```\n", first.index("```bash\n") + 1)]
    assert [line.split("#")[0].strip() for line in block.splitlines()[1:3]] == ["make demo", "make test"]
    assert (REPO / ".ci" / "run").read_text().splitlines()[-2:] == ["make demo", "make test"]


def test_the_contributing_page_has_the_suite_times_section_the_readme_points_at():
    readme = (REPO / "README.md").read_text()
    page = (REPO / "docs" / "contributing.md").read_text()
    assert "(docs/contributing.md)" in readme
    assert re.search(r"^Suite times \(measured [\dYMD-]+\): ", readme, re.M)
    assert "## Where the suite spends its time" in page
    assert re.search(r"^contributing$", (REPO / "docs" / "index.md").read_text(), re.M)
