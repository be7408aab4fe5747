"""The closing summary of a batch task: failures by reason, and one table for the task log.

A long run's log is mostly the engine's own lines; the outcome must not be at the bottom
of them. :func:`tally_failures` reads the published error file (one shape for every
failed request, see :func:`airflow_vllm_batch.batchfile.models.error_object`) and counts
the failed requests by **reason**, which is the error's ``code``:

* ``invalid_request`` — a line preflight skipped (``invalid_lines="skip"``), or a request
  the engine refused with HTTP 400/422;
* ``engine_error`` — the engine failed the request (HTTP 5xx, or an error without a status);
* ``invalid_output`` — the engine answered, but the text did not fit ``output_type``;
* the other 4xx of :data:`~airflow_vllm_batch.batchfile.models.STATUS_ERROR_CODES`
  (``not_found``, ``timeout``, ``request_too_large``, ``rate_limited``, ...), else ``http_<status>``.

The counts go into the manifest (``failed_by_reason``); one example per reason (its
``custom_id`` and the start of its message, URLs redacted) goes only into the log, so
the manifest stays small. :func:`render_summary` draws the table as plain ASCII: the task
log is no terminal, and the provider needs no table library for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from airflow_vllm_batch.batchfile import redact_urls

if TYPE_CHECKING:
    from airflow_vllm_batch.manifest import Cost, Manifest

#: The longest example message shown in the table.
MAX_EXAMPLE_CHARS = 120


@dataclass(frozen=True)
class FailureExample:
    """One failed request that stands for its reason in the summary.

    :param custom_id: the request's custom_id (None when the line had none).
    :param message: the start of its error message, URLs redacted.
    """

    custom_id: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.custom_id}: {self.message}" if self.custom_id is not None else self.message


@dataclass
class FailureTally:
    """Failed requests counted by reason, with the first example of each."""

    counts: dict[str, int]
    examples: dict[str, FailureExample]


class _ErrorLine(msgspec.Struct):
    custom_id: str | None = None
    error: dict | None = None


_decode_error_line = msgspec.json.Decoder(_ErrorLine).decode


def tally_failures(error_lines: Iterable[bytes]) -> FailureTally:
    """Count the lines of an error file by reason (``error.code``); keep one example per reason.

    :param error_lines: the error file's lines (``{"custom_id", "error": {"code", "message", "line"}, ...}``).
    """
    counts: dict[str, int] = {}
    examples: dict[str, FailureExample] = {}
    for raw in error_lines:
        if not raw.strip():
            continue
        try:
            line = _decode_error_line(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Our own error file: an unreadable line would be our bug, but it is still a failure.
            line = _ErrorLine()
        error = line.error or {}
        code = error.get("code")
        reason = code if isinstance(code, str) and code else "unknown"
        counts[reason] = counts.get(reason, 0) + 1
        if reason not in examples:
            message = error.get("message")
            examples[reason] = FailureExample(
                line.custom_id, short_message(message if isinstance(message, str) else "")
            )
    return FailureTally(
        counts=dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))), examples=examples
    )


def short_message(message: str, limit: int = MAX_EXAMPLE_CHARS) -> str:
    """The first line of an error message, URLs redacted, cut to ``limit`` characters."""
    text = redact_urls(" ".join(message.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_summary(
    manifest: Manifest,
    examples: dict[str, FailureExample] | None = None,
    *,
    task_s: float | None = None,
    resumed: bool = False,
) -> str:
    """One table that tells the outcome of a batch task: counts, failures, tokens, time, files.

    :param manifest: the published (or reused) manifest.
    :param examples: one failed request per reason (from :func:`tally_failures`); a reused
        manifest has none (the error file holds them).
    :param task_s: this try's time so far; default the manifest's ``duration_s``.
    :param resumed: True when this try reused a complete output and ran no engine.
    """
    counts = manifest.request_counts
    usage = manifest.usage
    title = f"vLLM batch: {counts.completed} of {counts.total} requests completed, {counts.failed} failed"
    if resumed:
        title += " (reused: no engine ran in this try)"
    rows = [("requests", f"{counts.total} total, {counts.completed} completed, {counts.failed} failed")]
    if manifest.from_cache is not None:
        rows.append(
            ("from cache", f"{manifest.from_cache} of {counts.total} requests answered from the answer cache")
        )
    for reason, count in (manifest.failed_by_reason or {}).items():
        example = (examples or {}).get(reason)
        rows.append(
            (f"failed: {reason}", f"{count}, e.g. {example}" if example else f"{count} (see the error file)")
        )
    if manifest.invalid_output:
        rows.append(
            (
                "invalid output",
                f"{manifest.invalid_output} answer(s) did not fit output_type (raw text in the error file)",
            )
        )
    rows += [
        (
            "tokens",
            f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion = {usage.total_tokens} total",
        ),
        ("time", _time_row(manifest, task_s, resumed)),
    ]
    if manifest.cost is not None and not resumed:
        rows.append(("engine time", _cost_row(manifest.cost)))
        priced = {
            name: entry["cost"] for name, entry in (manifest.per_model or {}).items() if "cost" in entry
        }
        if len(priced) > 1:
            rows.append(
                ("cost per model", ", ".join(f"{name} {value:.4g}" for name, value in priced.items()))
            )
    rows += [
        ("results", manifest.output_uri),
        ("errors", manifest.error_uri or "none (no request failed)"),
        ("manifest", manifest.manifest_uri),
    ]
    if manifest.model:
        rows.append(("model", f"{manifest.model} (vLLM {manifest.vllm_version or 'unknown'})"))
    return title + "\n" + _ascii_box(rows)


def _ascii_box(rows: list[tuple[str, str]]) -> str:
    """Two columns in an ASCII box, as wide as the longest value: a URI is never wrapped nor cut."""
    what = max(len(name) for name, _ in rows)
    value = max(len(text) for _, text in rows)
    rule = f"+-{'-' * what}-+-{'-' * value}-+"
    return "\n".join([rule, *(f"| {name:<{what}} | {text:<{value}} |" for name, text in rows), rule])


def _time_row(manifest: Manifest, task_s: float | None, resumed: bool) -> str:
    if resumed:
        this_try = f"; this try {task_s:.1f} s" if task_s is not None else ""
        return f"no engine in this try (the output of an earlier run is complete){this_try}"
    task = manifest.duration_s if task_s is None else task_s
    engine = manifest.engine_duration_s
    share = f" ({100 * engine / task:.0f} %)" if task > 0 else ""
    return (
        f"engine {engine:.1f} s of task {task:.1f} s{share}; outside the engine {max(task - engine, 0):.1f} s"
    )


def _cost_row(cost: Cost) -> str:
    """Engine GPU-seconds (or engine-seconds), tokens per second of them, and the cost when priced."""
    if cost.device == "gpu":
        text = f"{cost.gpus} GPU(s) x {cost.engine_s:.1f} s = {cost.gpu_s:.1f} GPU-s"
        rate, unit, hour = cost.tokens_per_gpu_s, "GPU-s", "GPU-hour"
    elif cost.device == "cpu":
        text = f"cpu: {cost.engine_s:.1f} engine-s (no GPU leased)"
        rate, unit, hour = cost.tokens_per_engine_s, "engine-s", "engine-hour"
    else:
        text = (
            f"vllm connection: {cost.engine_s:.1f} s of the task (the server may be shared with other tasks)"
        )
        rate, unit, hour = cost.tokens_per_engine_s, "s", "server-hour"
    if rate is not None:
        text += f"; {rate:,.1f} tokens/{unit}"
    if cost.cost is not None:
        text += f"; cost {cost.cost:.4g} at {cost.gpu_hour_cost:g}/{hour}"
    return text
