"""A small real filesystem for the tests and the chaos campaign of a full disk: a tmpfs mounted as root."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


class MountError(OSError):
    """``mount`` refused (not root, or no tmpfs here); its message is mount's own."""


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size_mib: int, mode: str = "0700") -> Iterator[Path]:
    """Mount a tmpfs of ``size_mib`` MiB on the existing directory ``where``; unmount it at the end (also on an error).

    :raises MountError: ``mount`` failed.
    """
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode={mode}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        raise MountError(mounted.stderr.strip())
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@contextlib.contextmanager
def small_tmpfs(where: Path, size_mib: int = 4) -> Iterator[Path]:
    """:func:`mounted_tmpfs` on ``where`` (made here) for a test; the test is skipped where ``mount`` is not allowed."""
    import pytest

    where.mkdir()
    try:
        with mounted_tmpfs(where, size_mib) as disk:
            yield disk
    except MountError as err:
        pytest.skip(f"a small filesystem needs mount (root): {err}")
