"""Run the `keras-sync` console script for real, without the caller's keras-sync settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))
#: Environment variables that set a config value or a verify run: a test sets them itself.
SETTINGS_ENV = (
    "KERAS_SYNC_CONFIG",
    "MLFLOW_TRACKING_URI",
    "TF_CONFIG",
    "KERAS_SYNC_VERIFY_RECORD",
    "KERAS_SYNC_VERIFY_REPLAY",
    "KERAS_SYNC_VERIFY_STEPS",
)


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without `SETTINGS_ENV`, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    env.update(extra)
    return env


def run(
    *args: str, cwd: Path | str | None = None, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """``keras-sync ARGS...`` with `cli_env` (``env`` added), its output captured as text."""
    return subprocess.run(
        [KERAS_SYNC, *args],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
