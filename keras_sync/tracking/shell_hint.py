"""The command a next-step hint prints, written so that it runs as printed, the venv active or not.

A hint such as "view it with: keras-sync ui FILE" fails in a shell whose PATH lacks this
environment's scripts (the README calls ``.venv/bin/python`` without activating the venv) or holds
another environment's. The bare name is given only when the PATH finds this environment's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def console_command(script: str = "keras-sync", module: str = "keras_sync") -> str:
    """The shell words that run this environment's console ``script``: ``script`` when the PATH
    finds this one, else its full path, else this interpreter with ``-m module`` (no script)."""
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
    # Beside this interpreter and the same program; not by the resolved path alone: a venv's
    # python links to the base interpreter, which runs without the venv's packages.
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
