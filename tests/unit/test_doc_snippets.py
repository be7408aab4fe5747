"""Every ```python block of README.md and docs/**/*.md runs, or is marked as a fragment on purpose (issue 43).

An unmarked block is executed inside a DAG, so the DAGs and operators it builds are built:
a wrong argument (an engine option given to the operator, a misspelt parameter) fails here.
A block that cannot run on its own (it calls a live server, or shows a part of a file) is
marked by an HTML comment on the line before its fence, which Markdown renders as nothing::

    <!-- fragment: it calls a running Airflow API server -->

and must still compile. A block runs with the names that a page's earlier blocks or its prose
give it (:data:`GIVEN`): ``task``, ``timedelta``, the operators, the engines' options, a
``prompts`` and a ``reviews`` task, a ``split`` operator and ``INPUT``/``OUTPUT``/``PREFIX``/``M``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_vllm_batch.version_compat import AIRFLOW_V_3_1_PLUS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
#: A python fence, indented or not (a block inside a list item), up to the fence that closes it.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
#: The marker of a fragment, on the last non-blank line before its fence.
FRAGMENT = re.compile(r"^\s*<!--\s*fragment:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Snippet:
    """One python block: where it is, its code (dedented) and, for a fragment, why it does not run."""

    page: Path
    line: int
    code: str
    fragment: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def snippets(pages: list[Path] = PAGES) -> list[Snippet]:
    """Every python block of ``pages``."""
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
            marker = FRAGMENT.match(before)
            found.append(
                Snippet(
                    page=page,
                    line=text.count("\n", 0, match.start()) + 1,
                    code=textwrap.dedent(match.group("code")),
                    fragment=marker.group("reason").strip() if marker else None,
                )
            )
    return found


def run_in_a_dag(code: str, where: str):
    """Execute ``code`` as a DAG file's body, inside a DAG, with :data:`GIVEN`; return the DAG."""
    from airflow.sdk import DAG, task

    from airflow_vllm_batch import engines
    from airflow_vllm_batch.operators.shards import VLLMBatchMergeOperator, VLLMBatchSplitOperator
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    dag_id = re.sub(r"[^A-Za-z0-9_]", "_", where)
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:

        @task
        def prompts() -> list[str]:
            return ["Is this review positive or negative? Great."]

        @task
        def reviews() -> list[str]:
            return ["Great."]

        given = {
            "__name__": "doc_snippet",
            "task": task,
            "timedelta": timedelta,
            "VLLMBatchOperator": VLLMBatchOperator,
            "VLLMBatchSplitOperator": VLLMBatchSplitOperator,
            "VLLMBatchMergeOperator": VLLMBatchMergeOperator,
            **{name: getattr(engines, name) for name in GIVEN_ENGINE_OPTIONS},
            "prompts": prompts,
            "reviews": reviews,
            "INPUT": "s3://my-bucket/batches/input.jsonl",
            "OUTPUT": "s3://my-bucket/batches/results.jsonl",
            "PREFIX": "s3://my-bucket/batches",
            "M": "Qwen/Qwen2.5-7B-Instruct",
        }
        given["split"] = VLLMBatchSplitOperator(
            task_id="given_split", input_uri=given["INPUT"], shard_prefix=given["PREFIX"] + "/shards/"
        )
        # Compiled apart from this module's `from __future__ import annotations`, as a DAG file is.
        exec(compile(code, where, "exec", dont_inherit=True), given)
    return dag


GIVEN_ENGINE_OPTIONS = ("VLLMRunner", "VLLMServer", "WarmVLLMServer", "YieldToInteractive")
#: The names an unmarked block may use without importing them (for the docstring and contributors).
GIVEN = (
    "task",
    "timedelta",
    "VLLMBatchOperator",
    "VLLMBatchSplitOperator",
    "VLLMBatchMergeOperator",
    *GIVEN_ENGINE_OPTIONS,
    "prompts",
    "reviews",
    "split",
    "INPUT",
    "OUTPUT",
    "PREFIX",
    "M",
)

#: What a snippet may use that the floor (Airflow 3.0.6, no optional extras) does not have.
FLOOR_GAPS = re.compile(r"No module named 'kubernetes|cannot import name '\w+' from 'airflow\.sdk'")

ALL = snippets()
RUN = [s for s in ALL if s.fragment is None]
FRAGMENTS = [s for s in ALL if s.fragment is not None]


def test_every_python_fence_of_the_pages_is_found():
    # A block the pattern missed (a fence with odd spacing) would be checked by nothing.
    fences = sum(
        len(re.findall(r"^[ \t]*```python\b", page.read_text(encoding="utf-8"), re.M)) for page in PAGES
    )
    assert fences == len(ALL)
    assert len(RUN) >= 15, "the docs' runnable snippets were not found"
    assert {s.page.name for s in RUN} >= {"README.md", "batches.md", "engines.md", "gpu-workers.md"}


@pytest.mark.parametrize("snippet", RUN, ids=lambda s: s.where)
def test_an_unmarked_snippet_runs_and_builds_its_dag(snippet):
    try:
        dag = run_in_a_dag(snippet.code, snippet.where)
    except ImportError as err:
        # The docs are written for the Airflow and the extras the suite installs. The floor's
        # unit run (Airflow 3.0, no cncf-kubernetes extra) meets what they take from newer or
        # optional parts: that is no wrong argument of ours, so it skips there, and only there.
        if AIRFLOW_V_3_1_PLUS or not FLOOR_GAPS.search(str(err)):
            raise
        pytest.skip(f"{snippet.where} needs what the floor lacks: {err}")
    assert dag.task_dict  # at least the given split operator: the block ran inside the DAG


@pytest.mark.parametrize("snippet", FRAGMENTS, ids=lambda s: s.where)
def test_a_fragment_says_why_it_does_not_run_and_compiles(snippet):
    assert len(snippet.fragment) >= 10, f"{snippet.where}: say why the block is a fragment"
    compile(snippet.code, snippet.where, "exec", dont_inherit=True)


def test_every_fragment_marker_stands_right_before_a_python_block():
    marked = {(s.page, s.line) for s in FRAGMENTS}
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if FRAGMENT.match(line):
                following = next(n for n in range(number + 1, len(lines) + 2) if lines[n - 1].strip())
                assert (page, following) in marked, (
                    f"{page.relative_to(REPO)}:{number}: a marker with no block"
                )


def test_a_wrong_operator_argument_in_a_snippet_fails_the_check():
    # The audit's first finding: an engine option given to the operator's partial().
    code = 'VLLMBatchOperator.partial(task_id="t", model=M, gpus=1).expand_kwargs(split.output)\n'
    with pytest.raises(TypeError, match="gpus"):
        run_in_a_dag(code, "wrong_argument")


def test_an_unmarked_snippet_that_cannot_run_fails_the_check(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```python\nVLLMBatchOperator(..., model=M)\n```\n\n"
        "<!-- fragment: shows one argument only -->\n```python\nVLLMBatchOperator(..., model=M)\n```\n"
    )
    unmarked, marked = snippets([page])
    assert (unmarked.fragment, unmarked.line) == (None, 3)
    assert marked.fragment == "shows one argument only"
    with pytest.raises(TypeError):
        run_in_a_dag(unmarked.code, "unmarked")
    compile(marked.code, "marked", "exec", dont_inherit=True)
