"""The worker's local room for a run: one scratch directory per try, and results kept while S3 is down.

Whatever directory the user names as ``results_dir`` (a data disk may hold their models
and notes), the runs own only one subdirectory of it, :data:`OWNED_DIR_NAME`, and in it
only the entries whose names they make (:data:`_OWN_ENTRY`): nothing else there is ever
aged out or removed (invariant: No strangers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from airflow_vllm_batch.exceptions import ConfigurationError, ScratchFullError

#: Local results older than this are removed when the next task starts on the worker.
LOCAL_RESULTS_MAX_AGE_S = 7 * 24 * 3600
#: The subdirectory of ``results_dir`` that the runs own.
OWNED_DIR_NAME = "airflow-vllm-batch"
#: The names of the entries a run makes in its owned directory: a try's scratch
#: (``<run>-try-<random>``), a run's kept results (``<run>/``) and the engine-argument
#: markers that releases before the engine launcher made (still ours to age out);
#: ``<run>`` is 16 hex digits.
#: A run's directory, a try's, and the flags an engine's parser knows (``engine-options-<digest>.json``,
#: :meth:`~airflow_vllm_batch.engines.local.LocalEngine.options_file`, and the temporary file it is
#: written through, left behind by a kill between the write and the rename).
_OWN_ENTRY = re.compile(
    r"^(?:[0-9a-f]{16}(?:-try-[A-Za-z0-9_]+)?|engine-options-[0-9a-f]{16}\.json(?:\.[0-9]+\.tmp)?)$"
)


def owned_dir(results_dir: str) -> Path:
    """The subdirectory of ``results_dir`` that this provider's runs own (made by :func:`ensure_owned_dir`)."""
    return Path(results_dir) / OWNED_DIR_NAME


def ensure_owned_dir(results_dir: str) -> Path:
    """Make the runs' own directory private to the worker's user (mode 0700), or refuse one another user owns.

    Kept results are the users' data: on a shared worker (the default ``results_dir`` is the
    system's temporary directory) another local user must not read them, nor have made the
    directory first to read or plant what the runs write there.

    :param results_dir: the worker's directory the user named.
    :raises ConfigurationError: the directory exists and belongs to another user, or is not a directory.
    """
    root = owned_dir(results_dir)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700, parents=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        owner = (
            "is not a directory"
            if not stat.S_ISDIR(info.st_mode)
            else f"belongs to uid {info.st_uid}, not this worker's uid {os.getuid()}"
        )
        raise ConfigurationError(
            f"results_dir: {root} {owner}. Remove it, or set results_dir to a directory of the worker's own user."
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, 0o700)  # ours, made by an older release with the umask's mode
    return root


@contextlib.contextmanager
def scratch(results_dir: str, run: str) -> Iterator[Path]:
    """A local directory for this try, removed when the try ends; old leftovers of runs are aged out.

    :param results_dir: the worker's directory the user named; the scratch goes in its :func:`owned_dir`.
    :param run: the run identity's short form, the directory's prefix.
    """
    with disk_full_named(owned_dir(results_dir)):
        root = ensure_owned_dir(results_dir)
        age_out(root, LOCAL_RESULTS_MAX_AGE_S)
        work = Path(tempfile.mkdtemp(prefix=f"{run}-try-", dir=root))
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


#: A write that failed because the disk is full, or the user's quota on it is used up.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_full_named(root: Path) -> Iterator[None]:
    """Turn a full disk under ``root`` (``ENOSPC``, ``EDQUOT``) into a retryable error that names the directory and the fix.

    A bare ``OSError: [Errno 28] No space left on device`` from a write names no file: the
    user could not tell the worker's scratch disk from any other. Raised from anywhere in the
    try's scope (the journal of a server engine writes its parts there), it is retryable:
    the try publishes nothing, its scratch is removed as it ends (space back for the retry),
    and what the run already made durable in S3 stays for the retry (Bounded, Durability).

    :param root: the runs' own directory (:func:`owned_dir`), which the message names.
    :raises ScratchFullError: for a full disk; any other error passes through.
    """
    try:
        yield
    except OSError as err:
        if err.errno not in _DISK_FULL:
            raise
        where = f" (writing {err.filename})" if err.filename else ""
        raise ScratchFullError(
            f"The worker's disk is full at {root}{where}: {os.strerror(err.errno)}. This try publishes "
            "nothing; the task's retry resumes from what the run made durable in S3. Free space on that "
            "disk, or set the operator's results_dir to a larger one."
        ) from err


def kept_results(results_dir: str, run: str) -> Path:
    """Where this worker keeps a run's results while S3 cannot take them."""
    return owned_dir(results_dir) / run / "results.jsonl"


def age_out(root: Path, max_age_s: float) -> None:
    """Remove the runs' own entries of ``root`` not touched for ``max_age_s`` (left by killed tries); nothing else."""
    cutoff = time.time() - max_age_s
    for entry in root.iterdir():
        if not _OWN_ENTRY.match(entry.name):
            continue
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
