"""``airflow-vllm-batch``: check batch files from a terminal, with the operator's own code.

::

    airflow-vllm-batch validate input.jsonl [--model M] [--supported-url URL ...] [--json]
    airflow-vllm-batch stats results.jsonl [--input input.jsonl] [--json]

Sources are local paths, ``http(s)://`` URLs, ``s3://bucket/key`` (read with
Airflow's ``S3Hook`` and ``--aws-conn-id``, imported only then) or ``-`` for
stdin; gzip files are read as they are (recognised by content). ``stats`` refuses
a file that is not a results file (a request file, other JSON, an empty file) and
says what it found. Exit status: 0 clean, 1 problems found, 2 the file could not
be read, is not the kind of file the command reads, or the arguments are wrong. A progress bar goes to stderr when it is a terminal and
the file is large (or its size is unknown); ``--progress``/``--no-progress`` override.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

from airflow_vllm_batch.batchfile import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_SUPPORTED_URLS,
    RUNNER_URL_ADVICE,
    Lines,
    PreflightOptions,
    PreflightReport,
    ResultsReport,
    check_results,
    describe_source,
    line_kind,
    open_lines,
    preflight,
    source_size,
)
from airflow_vllm_batch.exceptions import VLLMBatchError

#: Below this size a progress bar would only flicker.
PROGRESS_MIN_BYTES = 32 << 20


def main(argv: Sequence[str] | None = None) -> int:
    """
    Run the CLI; return the exit status.

    :param argv: arguments without the program name; default ``sys.argv[1:]``.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VLLMBatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``airflow-vllm-batch``."""
    parser = argparse.ArgumentParser(
        prog="airflow-vllm-batch",
        description="Validate vLLM / OpenAI batch JSONL files and summarise results.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    common.add_argument("--aws-conn-id", default="aws_default", help="Airflow connection for s3:// URIs")
    progress = common.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show a progress bar"
    )
    progress.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show a progress bar"
    )

    validate = sub.add_parser("validate", parents=[common], help="preflight-check a batch input file")
    validate.add_argument("source", help="path, http(s) URL, s3://bucket/key or - for stdin")
    validate.add_argument("--model", help="model every request must name in body.model")
    validate.add_argument(
        "--rewrite-model", action="store_true", help="accept other models (the operator would rewrite them)"
    )
    validate.add_argument(
        "--supported-url",
        action="append",
        dest="supported_urls",
        metavar="URL",
        help=(
            "URL the engine serves (repeatable); default: what the operator's default engine (engine=VLLMRunner()) "
            f"accepts, {', '.join(sorted(DEFAULT_SUPPORTED_URLS))}"
        ),
    )
    validate.add_argument("--max-lines", type=int, help="most requests allowed")
    validate.add_argument(
        "--max-line-bytes",
        type=int,
        default=DEFAULT_MAX_LINE_BYTES,
        help=f"longest line allowed, in bytes (the operator's max_line_bytes); default {DEFAULT_MAX_LINE_BYTES:,}",
    )
    validate.add_argument("--max-problems", type=int, default=50, help="problems listed (all are counted)")
    validate.set_defaults(func=run_validate)

    stats = sub.add_parser(
        "stats", parents=[common], help="summarise a results file (and check it against its input)"
    )
    stats.add_argument("source", help="results: path, http(s) URL, s3://bucket/key or - for stdin")
    stats.add_argument(
        "--input", dest="input_source", help="the input file, to check every request is answered once"
    )
    stats.set_defaults(func=run_stats)
    return parser


# -- commands ------------------------------------------------------------------------


def run_validate(args: argparse.Namespace) -> int:
    """Run ``validate``; 0 when the file is clean, 1 otherwise."""
    try:
        options = PreflightOptions(
            supported_urls=frozenset(args.supported_urls or DEFAULT_SUPPORTED_URLS),
            model=args.model,
            rewrite_model=args.rewrite_model,
            max_lines=args.max_lines,
            max_line_bytes=args.max_line_bytes,
            max_problems_listed=args.max_problems,
            # No engine runs here: the messages name where the list came from.
            urls_from="the engine --supported-url describes" if args.supported_urls else URLS_FROM_DEFAULT,
            url_advice={} if args.supported_urls else RUNNER_URL_ADVICE,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = display_name(args.source)
    with contextlib.ExitStack() as stack:
        again, copy = args.source, None
        if args.source == "-":
            # stdin is copied to disk as it is read, so that repeated custom_ids can be
            # named by a second pass, as they are for a file.
            again = os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="airflow-vllm-batch-")), "stdin"
            )
            copy = stack.enter_context(open(again, "wb"))

        def reread() -> contextlib.AbstractContextManager[Iterator[bytes]]:
            if copy is not None:
                copy.flush()
            return reading(again, args.aws_conn_id, False)

        lines = stack.enter_context(
            reading(args.source, args.aws_conn_id, args.progress, options.max_line_bytes, copy)
        )
        lines, kind = peek_kind(lines)
        if kind == "result":
            # Anything else is validated line by line: the messages say what each line lacks.
            print(
                f"error: {name} is {_FOUND[kind]}, not {_FOUND['request']}{_hint(kind, 'request')}",
                file=sys.stderr,
            )
            return 2
        report = preflight(lines, options, source=name, reread=reread)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_preflight(report)
    return 0 if report.ok else 1


def run_stats(args: argparse.Namespace) -> int:
    """Run ``stats``; 0 when every line was read (and, with ``--input``, every request answered once), else 1."""
    name = display_name(args.source)
    with contextlib.ExitStack() as stack:
        results = stack.enter_context(reading(args.source, args.aws_conn_id, args.progress))
        results, wrong = expect_kind(results, name, "result")
        inputs = None
        if args.input_source and wrong is None:
            inputs = stack.enter_context(reading(args.input_source, args.aws_conn_id, args.progress))
            inputs, wrong = expect_kind(inputs, f"--input {display_name(args.input_source)}", "request")
        if wrong is not None:
            print(f"error: {wrong}", file=sys.stderr)
            return 2
        report = check_results(
            results,
            inputs,
            reread_input=(lambda: reading(args.input_source, args.aws_conn_id, False))
            if args.input_source
            else None,
            reread_results=None
            if args.source == "-"
            else (lambda: reading(args.source, args.aws_conn_id, False)),
            source=name,
            input_source=display_name(args.input_source) if args.input_source else None,
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_results(report)
    return 0 if report.ok else 1


#: How a message names the URL list when ``--supported-url`` is not given.
URLS_FROM_DEFAULT = "engine=VLLMRunner(), the operator's default"


# -- kinds of file ---------------------------------------------------------------------

#: What each kind of first line says the file is.
_FOUND = {
    "result": "a results file",
    "request": "a request (input) file",
    "object": "a file of JSON objects that are neither requests nor results",
    "json": "a JSON file whose lines are not objects",
    "text": "not a JSON Lines file (its first line is not JSON)",
}


def expect_kind(lines: Iterable[bytes], name: str, wanted: str) -> tuple[Lines, str | None]:
    """
    Look at the first non-blank line; return the lines (all of them still to read) and why the file is the wrong kind, if it is.

    :param lines: the file's lines.
    :param name: how to name the file in the message.
    :param wanted: ``"result"`` or ``"request"``.
    """
    lines, kind = peek_kind(lines)
    if kind == wanted:
        return lines, None
    if kind == "blank":
        return (
            lines,
            f"{name} is empty (no lines), not {_FOUND[wanted]} — check that the right file was given",
        )
    return lines, f"{name} is {_FOUND[kind]}, not {_FOUND[wanted]}{_hint(kind, wanted)}"


def peek_kind(lines: Iterable[bytes]) -> tuple[Lines, str]:
    """
    Return the lines (all of them still to read) and the kind of the first non-blank one (``"blank"`` if none).

    :param lines: the file's lines; the :class:`Lines` returned keeps their ``compression``.
    """
    it = iter(lines)
    compression = getattr(lines, "compression", None)
    blanks: list[bytes] = []
    for raw in it:
        kind = line_kind(raw)
        if kind != "blank":
            return Lines(chain(blanks, [raw], it), compression), kind
        blanks.append(raw)
    return Lines(iter(blanks), compression), "blank"


def _hint(found: str, wanted: str) -> str:
    """What to run instead, when the file is the other kind of batch file."""
    if found == "request" and wanted == "result":
        return " — did you mean `airflow-vllm-batch validate`? (`stats` reads the engine's output)"
    if found == "result" and wanted == "request":
        return " — did you mean `airflow-vllm-batch stats`? (`validate` and --input take the requests)"
    if wanted == "result":
        return ' — a results line has "custom_id" and "response" or "error"'
    return ' — a request line has "custom_id", "method", "url" and "body"'


# -- reading -------------------------------------------------------------------------


class _Tee:
    """A binary reader that copies what it reads to ``copy``."""

    def __init__(self, stream: Any, copy: Any) -> None:
        self.stream, self.copy = stream, copy

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self.copy.write(data)
        return data


def display_name(source: str) -> str:
    """Return a printable name for a source argument (presigned query strings removed)."""
    return "<stdin>" if source == "-" else describe_source(source)


@contextlib.contextmanager
def reading(
    source: str,
    aws_conn_id: str,
    progress: bool | None,
    max_line_bytes: int | None = None,
    copy_stdin: Any = None,
) -> Iterator[Iterator[bytes]]:
    """
    Open any CLI source as lines, with a progress bar on stderr when wanted.

    :param source: a path, an http(s) URL, ``s3://bucket/key`` or ``-``.
    :param aws_conn_id: Airflow connection used for ``s3://``.
    :param progress: True / False to force the bar, None to decide from the tty and the size.
    :param max_line_bytes: passed to the reader so an endless line is cut, not held whole.
    :param copy_stdin: a binary file that receives a copy of what is read from stdin (``-``).
    """
    kwargs: dict[str, Any] = {}
    if max_line_bytes is not None:
        kwargs["max_line_bytes"] = max_line_bytes
    with contextlib.ExitStack() as stack:
        size: int | None
        if source == "-":
            target: Any = sys.stdin.buffer if copy_stdin is None else _Tee(sys.stdin.buffer, copy_stdin)
            size = None
        elif source.startswith("s3://"):
            target, size = open_s3(source, aws_conn_id)
            stack.callback(target.close)
        else:
            target, size = source, source_size(source)
        show = (
            progress
            if progress is not None
            else (sys.stderr.isatty() and (size is None or size >= PROGRESS_MIN_BYTES))
        )
        if show:
            kwargs["on_bytes"] = stack.enter_context(progress_bar(display_name(source), size))
        yield stack.enter_context(open_lines(target, **kwargs))


def open_s3(uri: str, aws_conn_id: str) -> tuple[Any, int | None]:
    """
    Return the streaming body and size of an S3 object, read with Airflow's ``S3Hook``.

    :param uri: ``s3://bucket/key``.
    :param aws_conn_id: the Airflow connection id.
    """
    # Whatever Airflow still logs goes to stderr: stdout is the report's, which scripts
    # parse with --json.
    with contextlib.redirect_stdout(sys.stderr):
        hook = s3_hook(aws_conn_id)
        bucket, key = hook.parse_s3_url(uri)
        try:
            obj = hook.get_key(key, bucket_name=bucket)
            response = obj.get()
        except Exception as exc:  # botocore raises many types; the message is what matters here
            raise VLLMBatchError(_s3_read_problem(hook, uri, bucket, key, aws_conn_id, exc)) from exc
    return response["Body"], response.get("ContentLength")


def _s3_read_problem(hook: Any, uri: str, bucket: str, key: str, aws_conn_id: str, exc: Exception) -> str:
    """Say why an S3 object could not be read, and what to do: a missing bucket and a missing key are told apart."""
    error = getattr(exc, "response", {}).get("Error", {})
    code = str(error.get("Code", ""))
    if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound"):
        try:
            bucket_exists = hook.check_for_bucket(bucket)
        except Exception:  # noqa: BLE001 - the first error is the one reported then
            bucket_exists = True
        if not bucket_exists:
            return (
                f"{uri}: bucket {bucket!r} does not exist (or connection {aws_conn_id!r} cannot see it) — "
                "check the bucket's name, create it, or pass the connection of the account that has it with --aws-conn-id"
            )
        return f"{uri}: bucket {bucket!r} has no object {key!r} — check the key (the path after the bucket)"
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return (
            f"{uri}: access denied ({code}) — connection {aws_conn_id!r} may not read bucket {bucket!r}; "
            "check its credentials or pass another with --aws-conn-id"
        )
    return f"{uri}: cannot read the object ({exc})."


def s3_hook(aws_conn_id: str) -> Any:
    """Return an ``S3Hook``; Airflow is imported only here, so the rest of the CLI works without it."""
    if "airflow" not in sys.modules:
        # Airflow logs its connection look-ups and the secrets masker's notes at INFO and
        # WARNING; in a terminal command they are noise around the report. Its errors still show.
        os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "ERROR"
    try:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise VLLMBatchError(
            "s3:// needs apache-airflow-providers-amazon; install it or pass a local path or URL."
        ) from exc
    return S3Hook(aws_conn_id=aws_conn_id)


@contextlib.contextmanager
def progress_bar(name: str, size: int | None) -> Iterator[Any]:
    """Yield a callback that advances a rich progress bar (bytes read) on stderr."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(name, total=size)
        yield lambda n: bar.advance(task, n)


# -- printing ------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def print_preflight(report: PreflightReport) -> None:
    """Print a preflight report for a terminal."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    status = "[green]OK[/green]" if report.ok else f"[red]{report.problem_count} problem(s)[/red]"
    console.print(f"[bold]{report.source}[/bold]: {status}")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("requests", str(report.total_lines))
    table.add_row("valid", str(report.valid_lines))
    table.add_row("invalid", str(report.invalid_lines))
    if report.blank_lines:
        table.add_row("blank lines", str(report.blank_lines))
    for url, count in sorted(report.url_counts.items()):
        table.add_row(f"  {url}", str(count))
    for model, count in report.models.items():
        table.add_row("model", f"{model} ({count})")
    console.print(table)
    for problem in report.problems:
        console.print(f"[red]✗[/red] {escape(str(problem))}", soft_wrap=True)
    if report.problem_count > len(report.problems):
        console.print(f"... and {report.problem_count - len(report.problems)} more")


def print_results(report: ResultsReport) -> None:
    """Print a results report for a terminal."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    status = "[green]OK[/green]" if report.ok else "[red]MISMATCH[/red]"
    console.print(f"[bold]{report.source}[/bold]: {status}")
    table = Table(title="Outcomes", show_header=True)
    table.add_column("")
    table.add_column("count", justify="right")
    for key, value in report.request_counts.items():
        table.add_row(key, str(value))
    for status_code, count in sorted(report.status_counts.items()):
        table.add_row(f"HTTP {status_code}", str(count))
    for endpoint, count in sorted(report.endpoint_counts.items()):
        table.add_row(endpoint, str(count))
    console.print(table)
    usage = Table(title="Usage (tokens)")
    for key in report.usage:
        usage.add_column(key, justify="right")
    usage.add_row(*(f"{value:,}" for value in report.usage.values()))
    console.print(usage)
    if report.engine_failure:
        console.print(
            f"[red bold]Engine failure:[/red bold] vLLM reports its engine core died ({report.engine_dead_lines} lines)."
        )
    for message in report.sample_errors:
        console.print(f"[yellow]error[/yellow] {escape(message)}", soft_wrap=True)
    for line in report.mismatch_lines():
        console.print(escape(line), soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
