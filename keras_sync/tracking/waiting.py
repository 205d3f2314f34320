"""Waiting for delivery while it makes progress, with one line at exit saying what is left.

Writers not closed by their user are closed at interpreter exit (`close_at_exit`): FAILED after
an uncaught exception, KILLED after a preemption (`end_runs_at_exit_as`), else FINISHED.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from keras_sync.errors import TrackingError
from keras_sync.tracking.spooler import STALL_S, Spooler, answering

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
#: How long a wait allows before the courier's first attempt (it imports MLflow, may build a store).
STARTUP_S = 120.0
#: How long the exit waits for delivery before a line says what it waits for (seconds).
EXIT_QUIET_S = 2.0
#: The longest a preempted process (its run ending KILLED) waits at exit for delivery (seconds).
PREEMPTED_EXIT_WAIT_S = 10.0

live_writers: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_status: str | None = None


def check_status(status: str) -> None:
    if status not in RUN_STATUSES:
        raise TrackingError(
            f"Invalid value for argument `status`. Received: status={status!r}. "
            f"Expected one of {', '.join(RUN_STATUSES)}."
        )


def end_runs_at_exit_as(status: str) -> None:
    """Make the exit's close of open writers end their runs with ``status`` instead of FINISHED.

    `keras_sync.cluster.preemption.exit_now` sets KILLED: the relaunch that restores the backup
    reopens that run (a FINISHED run is only reopened for an explicit job id).
    """
    global _exit_status
    check_status(status)
    _exit_status = status


@atexit.register
def close_at_exit() -> None:
    """Close the writers left open, waiting while delivery makes progress (briefly if preempted)."""
    # An uncaught exception has been printed by now, and left sys.last_type behind.
    failed = getattr(sys, "last_type", None) is not None
    status = "FAILED" if failed else (_exit_status or "FINISHED")
    limit = PREEMPTED_EXIT_WAIT_S if status == "KILLED" else None
    for w in list(live_writers):
        w.close(timeout_s=limit, status=status, at_exit=True)


def wait_delivered(
    sp: Spooler,
    timeout_s: float | None,
    stall_s: float = STALL_S,
    progress: Callable[[], None] | None = None,
) -> bool:
    """Wait until MLflow has everything spooled so far; True if it has.

    False at once when the courier's last attempt failed and MLflow answered nothing for
    ``stall_s`` (a server that answers some requests is waited for), after ``stall_s`` without
    progress (`STARTUP_S` before the courier's first attempt), or after ``timeout_s``.
    """
    target = sp.target()
    last_move = time.monotonic()
    deadline = last_move + timeout_s if timeout_s is not None else float("inf")
    seen = sp.progress()
    while not sp.reached(target):
        failed = sp.failure()
        if (failed is not None and not answering(failed, stall_s)) or sp.dead:
            return False
        now = time.monotonic()
        if now >= deadline or now - last_move > (STARTUP_S if sp.status() is None else stall_s):
            return False
        time.sleep(0.02)
        pos = sp.progress()
        if pos != seen:
            seen, last_move = pos, time.monotonic()
        if progress is not None:  # also while nothing moves: the exit's line says what it waits for
            progress()
    return True


class ExitLine:
    """The one line shown while the exit waits for delivery: at once when metric points are left,
    else once the wait passes `EXIT_QUIET_S`."""

    def __init__(self, sp: Spooler):
        self._sp, self._start, self._shown = sp, time.monotonic(), False
        left = sp.points_left()
        if left:
            self._show(left)

    def _show(self, left: int) -> None:
        self._shown = True
        uri, spool = self._sp.shown_uri, self._sp.spool.path
        if left:
            what = f"{left} metric point(s) not in MLflow yet ({uri}); delivering them before exit"
        else:
            what = (
                f"waiting for MLflow ({uri}) to receive the run's last records (the sync report "
                "picture, drawn now, and the run's end) before exit"
            )
        print(
            f"keras-sync: {what}. They are kept in {spool}: Ctrl-C leaves them there for "
            f"`keras-sync sync-spool {spool}`",
            file=sys.stderr,
            flush=True,
        )

    def update(self) -> None:
        if not self._shown and time.monotonic() - self._start >= EXIT_QUIET_S:
            self._show(self._sp.points_left())
