"""The command a next-step hint prints, written so that it runs as printed, the venv active or not.

A hint such as "view it with: keras-sync ui FILE" fails in a shell whose PATH does not hold this
environment's scripts (the README's commands call ``.venv/bin/python`` and never activate the
venv), or holds another environment's ``keras-sync``. `console_command` gives the bare name only
when the one on the PATH is this environment's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def console_command(script: str = "keras-sync", module: str = "keras_sync") -> str:
    """The shell words that run this environment's console ``script``, for a hint to print.

    ``script`` itself when the PATH finds this environment's; else that script's full path (the
    venv is not active); else this interpreter's full path and ``-m module`` (no script installed
    beside the interpreter, e.g. a source checkout on ``PYTHONPATH``).
    """
    ours = Path(sys.executable).parent / script
    if ours.is_file():
        return _as_found(script, ours)
    return f"{python_command()} -m {module}"


def python_command() -> str:
    """The shell word that runs this interpreter: ``python`` when the PATH finds this one, else its full path."""
    ours = Path(sys.executable)
    found = shutil.which("python")
    # Beside this interpreter (a venv's bin/python next to its bin/python3.11) and the same program.
    # Not by the resolved path alone: a venv's python links to the base interpreter, which runs
    # without the venv's packages.
    if (
        found is not None
        and os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(ours))
        and _same_file(found, ours)
    ):
        return "python"
    sibling = ours.with_name("python")  # the venv's bin/python reads better than its bin/python3.11
    return shlex.quote(str(sibling if _same_file(sibling, ours) else ours))


def _as_found(name: str, ours: Path) -> str:
    found = shutil.which(name)
    if found is not None and os.path.abspath(found) == os.path.abspath(ours):
        return name
    return shlex.quote(str(ours))


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
