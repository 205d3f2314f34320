"""Small and read-only filesystems for fault tests: a real tmpfs mounted in the test's folder.

Tests run as root, which ignores file permissions; a read-only mount refuses root too (EROFS),
and a tmpfs of a few KB fills up (ENOSPC) as a full disk does.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, *, size: str = "64k", read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``path`` (created) for the block; unmounted after it."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
