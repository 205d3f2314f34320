"""Ctrl-C during `Sync.fit` is a person stopping the job: one line, exit code 130, the MLflow run KILLED.

With ``fault_tolerance.backup_dir`` set, keras-sync's `BackupAndRestore` catches SIGINT as it
catches SIGTERM (`keras_sync.cluster.preemption`): every worker saves a backup at one step, then
exits with code 130. Without it, Python's own handler raises `KeyboardInterrupt` wherever the
main thread is, and `ctrl_c_ends_fit` turns it into the same exit without a backup, instead of a
traceback (one per worker under `keras-sync launch`). Only the chief prints the line.

Nothing is installed while `fit` runs: the context manager only catches what `fit` raises. Once
it has caught a Ctrl-C, the process is ending: a second Ctrl-C then exits at once (the exit's wait
for MLflow delivery is skipped; what is left stays in the spool). Pure Python; no TensorFlow import.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from keras_sync.cluster.preemption import INTERRUPTED_EXIT_CODE, exit_at_once, exit_now


def interrupted_message(step: int | None, backup_dir: str | None) -> str:
    """The line a chief exits with after a Ctrl-C that no backup caught (without the ``keras-sync:`` prefix).

    >>> interrupted_message(17, None)
    'Ctrl-C: training stopped at optimizer step 17; exiting with code 130. Set fault_tolerance.backup_dir to save a backup at the step Ctrl-C stops and resume from it.'
    >>> interrupted_message(None, "/bk")
    'Ctrl-C: training stopped before keras-sync could save a backup at this step; exiting with code 130. A relaunch resumes from the newest backup in /bk, if there is one.'
    """
    at = f" at optimizer step {step}" if step is not None else ""
    if backup_dir:
        return (
            f"Ctrl-C: training stopped{at} before keras-sync could save a backup at this step; exiting with "
            f"code {INTERRUPTED_EXIT_CODE}. A relaunch resumes from the newest backup in {backup_dir}, if there "
            "is one."
        )
    return (
        f"Ctrl-C: training stopped{at}; exiting with code {INTERRUPTED_EXIT_CODE}. Set "
        "fault_tolerance.backup_dir to save a backup at the step Ctrl-C stops and resume from it."
    )


@contextlib.contextmanager
def ctrl_c_ends_fit(model: Any, *, is_chief: bool, backup_dir: str | None) -> Iterator[None]:
    """Around `model.fit`: a `KeyboardInterrupt` ends the process with one line (chief only) and code 130."""
    try:
        yield
    except KeyboardInterrupt:
        with contextlib.suppress(
            ValueError
        ):  # ValueError: not the main thread, which Ctrl-C never reaches
            signal.signal(signal.SIGINT, exit_at_once)
        step = None
        with contextlib.suppress(Exception):
            step = int(model.optimizer.iterations.numpy())
        exit_now(INTERRUPTED_EXIT_CODE, interrupted_message(step, backup_dir) if is_chief else None)
