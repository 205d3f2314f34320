"""The command a next-step hint prints, so that it runs as printed, the venv active or not:
the bare name only when the PATH finds this environment's own."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def console_command(script: str = "keras-sync", module: str = "keras_sync") -> str:
    """``script`` when the PATH finds this environment's, else its full path, else ``python -m module``."""
    ours = Path(sys.executable).parent / script
    if not ours.is_file():
        return f"{python_command()} -m {module}"
    found = shutil.which(script)
    if found is not None and os.path.abspath(found) == os.path.abspath(ours):
        return script
    return shlex.quote(str(ours))


def python_command() -> str:
    """``python`` when the PATH finds this interpreter, else its full path."""
    ours = Path(sys.executable)
    found = shutil.which("python")
    # Same directory too: a venv's python links to the base one, which lacks the venv's packages.
    if (
        found is not None
        and os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(ours))
        and _same_file(found, ours)
    ):
        return "python"
    sibling = ours.with_name("python")  # the venv's bin/python reads better than bin/python3.11
    return shlex.quote(str(sibling if _same_file(sibling, ours) else ours))


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
