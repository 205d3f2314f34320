"""Running tests/_mwr_train.py and reading what it writes, for the tests that train with it.

- `result(out_dir, task)`: worker ``task``'s ``OUT_DIR/w<task>.json`` (final weights, replica and
  worker counts, epoch losses, where it resumed).
- `max_diff(a, b)`: the largest absolute difference between two lists of weight arrays.
- `kill_and_resume(tmp, config, kill_at=N)`: one process trained three times: uninterrupted, then
  SIGKILLed after optimizer step N, then relaunched from its backup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

TRAIN = Path(__file__).with_name("_mwr_train.py")


def result(out_dir: Path, task: int = 0) -> dict:
    """What worker ``task`` of a finished run wrote to ``out_dir``."""
    return json.loads((out_dir / f"w{task}.json").read_text())


def max_diff(a: list, b: list) -> float:
    """Largest absolute difference between two lists of weight arrays (as `model.get_weights()` gives)."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def kill_and_resume(
    tmp: Path, config: dict, *, kill_at: int, timeout: float, args: tuple[str, ...] = ()
) -> tuple[dict, dict, subprocess.CompletedProcess[str]]:
    """Train ``config`` alone as 'ref', then as 'res' SIGKILLed after optimizer step ``kill_at`` and relaunched.

    Each run gets its own ``fault_tolerance.backup_dir`` (``tmp/<name>_bk``) next to the
    ``save_freq`` that ``config`` sets; ``args`` go to every run of the script. Returns the reference's result, the resumed run's result
    and the relaunch's completed process (its stdout lists the steps it trained).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    env["TF_CPP_MIN_LOG_LEVEL"] = (
        "2"  # the script sets 2 itself; given, the suite's zygote can start it
    )

    def run(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        cfg = {
            **config,
            "fault_tolerance": {
                **config.get("fault_tolerance", {}),
                "backup_dir": str(tmp / f"{name}_bk"),
            },
        }
        return subprocess.run(
            [sys.executable, str(TRAIN), json.dumps(cfg), str(tmp / name), *args, *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    ref = run("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    kill = ("--kill-at", str(kill_at), "--marker", str(tmp / "killed"))
    killed = run("res", *kill)
    assert killed.returncode == -9, killed.stderr[-3000:]
    second = run("res", *kill)
    assert second.returncode == 0, second.stderr[-3000:]
    return result(tmp / "ref"), result(tmp / "res"), second
