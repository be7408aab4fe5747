"""The worker's local room for a run: one scratch directory per try, and results kept while S3 is down."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: Local results older than this are removed when the next task starts on the worker.
LOCAL_RESULTS_MAX_AGE_S = 7 * 24 * 3600


@contextlib.contextmanager
def scratch(results_dir: str, run: str) -> Iterator[Path]:
    """A local directory for this try, removed when the try ends; old leftovers are aged out.

    :param results_dir: the worker's directory for this provider's files.
    :param run: the run identity's short form, the directory's prefix.
    """
    root = Path(results_dir)
    root.mkdir(parents=True, exist_ok=True)
    age_out(root, LOCAL_RESULTS_MAX_AGE_S)
    work = Path(tempfile.mkdtemp(prefix=f"{run}-try-", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def kept_results(results_dir: str, run: str) -> Path:
    """Where this worker keeps a run's results while S3 cannot take them."""
    return Path(results_dir) / run / "results.jsonl"


def age_out(root: Path, max_age_s: float) -> None:
    """Remove entries of ``root`` not touched for ``max_age_s`` (left by killed tries)."""
    cutoff = time.time() - max_age_s
    for entry in root.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
        except OSError:
            continue


@contextlib.contextmanager
def maybe_open(path: Path, enabled: bool) -> Iterator[BinaryIO | None]:
    """``open(path, "wb")``, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    with open(path, "wb") as f:
        yield f


def concat(target: Path, *parts: Path) -> Path:
    """Write the files that exist among ``parts`` one after the other into ``target``."""
    with open(target, "wb") as out:
        for part in parts:
            if part.exists():
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
    return target
