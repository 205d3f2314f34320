"""What a user does with the spools a job leaves: find the undelivered ones, deliver them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from keras_sync.tracking.spool import SpoolDir


def _busy(spool: SpoolDir) -> bool:
    try:
        return spool.held("deliver") or spool.held("writer")
    except OSError:  # removed meanwhile (its courier delivered it all)
        return False


def undelivered(root: Path) -> list[str]:
    """The spool directories under ``root`` that hold records MLflow has not received."""
    return sorted(p.name for p in Path(root).glob("*") if p.is_dir() and SpoolDir(p).pending())


def deliver_leftovers(root: Path, timeout_s: float = 300.0) -> list[str]:
    """`keras-sync sync-spool` every spool under ``root`` with undelivered records, once no process
    holds it (a job's courier may still be making its last attempt). Returns the spools delivered."""
    done = []
    for path in sorted(p for p in Path(root).glob("*") if p.is_dir()):
        spool = SpoolDir(path)
        deadline = time.monotonic() + timeout_s
        while path.is_dir() and _busy(spool) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not path.is_dir() or not spool.pending():
            continue
        replay = subprocess.run(
            [str(Path(sys.executable).with_name("keras-sync")), "sync-spool", str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
        done.append(path.name)
    return done
