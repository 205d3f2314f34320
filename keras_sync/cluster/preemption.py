"""SIGTERM or Ctrl-C = save a backup at the current step on every worker, then exit with code 143 or 130.

Kubernetes eviction, Slurm preemption (``--signal``) and spot VMs send SIGTERM, wait a grace
period, then SIGKILL; a person stops a job with Ctrl-C (SIGINT; `keras-sync launch` forwards it
to every worker). With ``fault_tolerance.backup_dir`` set, keras-sync's `BackupAndRestore`
turns either signal into a coordinated save (a second Ctrl-C exits at once, without it):

* **One process** (any single-worker strategy): the handler only sets a flag; the next batch end
  (or epoch end) saves the backup at that position and exits.
* **Several workers** (`MultiWorkerMirroredStrategy`): every worker must take part in the save
  at the same step. The worker that got the signal announces "save after step N+1" (N = the step
  it just finished) in the coordination service's key-value store and waits until every worker
  has acknowledged it; each worker learns it from a thread blocked on that key, so no collective
  and no network call is added to a normal step. Workers differ by at most one step (each step
  ends with an all-reduce), so none can be past N+1 when the announcement is acknowledged.
  This is the protocol of TensorFlow's `PreemptionCheckpointHandler`, which Keras 3 dropped.

A SIGTERM that arrives while TensorFlow runs a long C++ call (a collective) is handled when the
call returns: Python runs signal handlers only between bytecodes of the main thread. If the save
cannot happen within ``fault_tolerance.grace_period_s`` (a peer stopped answering, a long
validation pass), a watchdog thread ends the process with the same code and a line that says no
backup was written, before the scheduler's SIGKILL.

Exit code: `PREEMPTED_EXIT_CODE` (143 = 128 + SIGTERM, TensorFlow's restartable code) or
`INTERRUPTED_EXIT_CODE` (130 = 128 + SIGINT), after flushing what the run logged (the MLflow
spool; the run ends KILLED). The handlers exist only between `PreemptionSaver.begin` and `end`,
inside `Sync.fit`. No TensorFlow import at module import time.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PREEMPTED_EXIT_CODE = 143
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: a person stopped the job (Ctrl-C)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_KEY = "keras_sync/preemption/{fit}/step"
_ACK = "keras_sync/preemption/{fit}/ack/{task}"
_NO_DEADLINE_MS = 2**31 - 1  # the watcher waits for the fit's end or a stop signal, however long
_STOP = "stop"  # posted when a fit ends without a preemption, to release the watcher threads


def signal_name(signum: int | None) -> str:
    """How the lines name a stop signal: ``Ctrl-C`` for SIGINT, else ``SIGTERM``."""
    return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"


def exit_code(signum: int | None) -> int:
    """The exit code after a stop signal: 130 for SIGINT, else 143."""
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def exit_now(code: int, message: str | None = None) -> None:
    """Print ``keras-sync: <message>``, flush what the run logged (atexit hooks), end the process.

    `os._exit`: interpreter shutdown under a multi-worker strategy can wait on TensorFlow's
    coordination service for peers that are exiting too.
    """
    if message:
        print(f"keras-sync: {message}", file=sys.stderr, flush=True)
    tracking = sys.modules.get("keras_sync.tracking")
    if code != 0 and tracking is not None:
        tracking.end_runs_at_exit_as("KILLED")  # not FINISHED: the relaunch continues the run
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_at_once(*_: Any) -> None:
    """A second Ctrl-C: say so and end the process now, with code 130 (no backup, no wait for delivery)."""
    with contextlib.suppress(Exception):
        print(
            "keras-sync: Ctrl-C again: exiting at once, without a backup at this step",
            file=sys.stderr,
            flush=True,
        )
    os._exit(INTERRUPTED_EXIT_CODE)


class StopSignalWatch:
    """Catches SIGTERM and SIGINT between `install` and `uninstall`: records the first instead of dying.

    A watchdog thread, woken by the signals themselves (`signal.set_wakeup_fd`, written by the C
    handler even while the main thread is inside TensorFlow), ends the process with the signal's
    exit code if `done` is not called within ``grace_period_s``, and at once on a second Ctrl-C.
    """

    def __init__(self, grace_period_s: float):
        self.grace_period_s = float(grace_period_s)
        self.received_at: float | None = None
        self.signum: int | None = None  # the first stop signal received
        self._previous: dict[int, Any] = {}
        self._installed = False
        self._done = threading.Event()
        self._wake_r = self._wake_w = -1
        self._old_wakeup_fd = -1

    @property
    def pending(self) -> bool:
        """True once SIGTERM or SIGINT has arrived."""
        return self.received_at is not None

    def deadline(self) -> float:
        """`time.monotonic()` by which the save must be done."""
        return (self.received_at or time.monotonic()) + self.grace_period_s

    def install(self) -> bool:
        """Handle SIGTERM and SIGINT from now on; False (nothing changed) outside the main thread."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self._installed
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        self._installed = True
        try:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        except (ValueError, OSError):  # pragma: no cover - no pipes, or not the main thread
            self._wake_r = -1
        if self._wake_r >= 0:
            threading.Thread(
                target=self._watchdog, name="keras-sync-stop-signal-watchdog", daemon=True
            ).start()
        return True

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT back to the handlers that were there before."""
        if not self._installed:
            return
        self._installed = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wake_r >= 0:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            os.close(self._wake_w)  # the watchdog's read returns b"" and it ends

    def done(self) -> None:
        """The backup is saved (or not needed): the watchdog stands down (a second Ctrl-C still exits at once)."""
        self._done.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received_at is None:
            self.signum = signum
            self.received_at = time.monotonic()

    def _watchdog(self) -> None:
        fd = self._wake_r
        deadline: float | None = None
        first: int | None = None
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], timeout)[0]:  # the grace period is over
                    deadline = None
                    if not self._done.is_set():
                        exit_now(
                            exit_code(first),
                            f"{signal_name(first)}: no backup could be saved within "
                            f"fault_tolerance.grace_period_s={self.grace_period_s:g} s (TensorFlow did not "
                            "return to Python: a peer stopped answering, or a long validation pass); exiting "
                            "without it. Relaunch the job to resume from the last backup.",
                        )
                    continue
                data = os.read(fd, 64)
                if not data:
                    return
                for sig in (b for b in data if b in STOP_SIGNALS):
                    if first is None:
                        first, deadline = sig, time.monotonic() + self.grace_period_s
                    elif sig == signal.SIGINT:  # a person who pressed Ctrl-C again does not wait
                        exit_at_once()
        finally:
            os.close(fd)


class ClusterAgreement:
    """Agree on the step to save at across workers, through the coordination service's key-value store.

    One instance per `fit` (``fit_index`` counts the fits of this process, the same on every worker).
    """

    def __init__(
        self,
        *,
        fit_index: int,
        task_index: int,
        num_workers: int,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        from keras_sync.upstream import multi_worker as _multi_worker

        self._kv = _multi_worker  # the coordination service's key-value store (set_key, get_key)
        self._key = _KEY.format(fit=fit_index)
        self._fit = fit_index
        self._task = task_index
        self._num_workers = num_workers
        self.target: int | None = None  # the optimizer step after which every worker saves
        self.signum: int | None = None  # the stop signal of the worker that announced it
        self.stopped = False
        self._on_error = on_error
        self._thread = threading.Thread(
            target=self._watch, name="keras-sync-preemption", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        try:
            value = self._kv.get_key(self._key, _NO_DEADLINE_MS)  # blocks (GIL released) until set
        except Exception as e:  # the cluster went away: the main thread hears about it too
            if self._on_error is not None:
                self._on_error(e)
            return
        if value == _STOP:
            self.stopped = True
            return
        self._take(value)
        # Set before acknowledging: the announcing worker trains step `target` only after every ack.
        with contextlib.suppress(Exception):
            self._kv.set_key(_ACK.format(fit=self._fit, task=self._task), "1")

    def _take(self, value: str) -> None:
        step, _, signum = value.partition(":")  # "<step>:<signal number>"
        self.signum = int(signum) if signum else None
        self.target = int(step)

    def announce(self, step: int, deadline: float, signum: int | None = None) -> int | None:
        """Ask every worker to save after optimizer step ``step + 1``; wait for their acks.

        Returns the agreed step (another worker's, if it announced first), or None when the fit
        is ending or the peers did not acknowledge before ``deadline`` (a `time.monotonic()`).
        """
        import tensorflow as tf

        try:
            self._kv.set_key(self._key, f"{step + 1}:{int(signum or signal.SIGTERM)}")
        except tf.errors.AlreadyExistsError:
            pass  # another worker announced first: its step is the one
        value = self._kv.get_key(self._key, _ms_left(deadline))
        if value == _STOP:
            return None
        for task in range(self._num_workers):
            try:
                self._kv.get_key(_ACK.format(fit=self._fit, task=task), _ms_left(deadline))
            except tf.errors.DeadlineExceededError:
                return None
        self._take(value)
        return self.target

    def close(self) -> None:
        """Release the watcher threads when the fit ends without a preemption."""
        with contextlib.suppress(Exception):
            self._kv.set_key(self._key, _STOP)


def training_task(cluster: dict[str, Any], task_type: str, task_id: int) -> tuple[int, int]:
    """(this task's index among the training tasks, their count): the chief first, then the workers.

    >>> training_task({"chief": ["a:1"], "worker": ["b:1", "c:1"], "ps": ["d:1"]}, "worker", 1)
    (2, 3)
    >>> training_task({"worker": ["b:1", "c:1"]}, "worker", 0)
    (0, 2)
    """
    chiefs = len(cluster.get("chief") or [])
    workers = len(cluster.get("worker") or [])
    return (int(task_id) + (chiefs if task_type == "worker" else 0), chiefs + workers)


def _ms_left(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


_fits = (
    0  # fits started in this process: the same count on every worker, so it names one fit's keys
)


class PreemptionSaver:
    """Decides, at each batch or epoch end of one `fit`, whether a SIGTERM or Ctrl-C asks for the save now.

    Used by `keras_sync.BackupAndRestore` (``grace_period_s`` argument): `begin` at
    train begin, `save_due` / `save_due_at_epoch_end` at every batch / epoch end, `end` at train end.
    """

    def __init__(self, grace_period_s: float):
        self.grace_period_s = grace_period_s
        self.watch = StopSignalWatch(grace_period_s)
        self.agreement: ClusterAgreement | None = None
        self._announced = False

    def begin(self, strategy: Any) -> None:
        global _fits
        _fits += 1
        self.watch = StopSignalWatch(self.grace_period_s)
        self._announced = False
        self.agreement = None
        if not self.watch.install():
            return  # not the main thread: SIGTERM and SIGINT keep their previous meaning
        from keras_sync.upstream.strategy_facts import in_multi_worker_mode

        if in_multi_worker_mode(strategy):
            resolver = strategy.cluster_resolver
            task_index, num_workers = training_task(
                resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id
            )
            self.agreement = ClusterAgreement(
                fit_index=_fits, task_index=task_index, num_workers=num_workers
            )

    @property
    def signum(self) -> int | None:
        """The stop signal this process exits for: its own, else the one the announcing worker got."""
        if self.watch.signum is not None:
            return self.watch.signum
        return self.agreement.signum if self.agreement is not None else None

    def save_due(self, step: Callable[[], int]) -> bool:
        """At a batch end: True when every worker saves now. ``step()`` reads the optimizer step."""
        if self.agreement is None:
            return self.watch.pending
        if self.agreement.target is None:
            if not self.watch.pending or self._announced:
                return False
            self._announce(step())
            return False  # the agreed step is the next one
        return step() >= self.agreement.target

    def save_due_at_epoch_end(self, step: Callable[[], int]) -> bool:
        """At an epoch end: True when this process saves now (one process only; workers save at the agreed step)."""
        if self.agreement is None:
            return self.watch.pending
        if self.watch.pending and self.agreement.target is None and not self._announced:
            self._announce(step())
        return False

    def _announce(self, step: int) -> None:
        self._announced = True
        assert self.agreement is not None
        target = self.agreement.announce(step, self.watch.deadline(), self.watch.signum)
        # Ctrl-C reaches every worker (the launcher forwards it): the chief's closing line is enough.
        if target is not None and self.watch.signum != signal.SIGINT:
            print(
                f"keras-sync: SIGTERM at optimizer step {step}: every worker saves a backup after step {target}, "
                "then exits",
                file=sys.stderr,
                flush=True,
            )

    def end(self, *, clean: bool = True) -> bool:
        """Stand down at train end (idempotent). True when a stop signal came but training finished
        before a save. ``clean=False`` after `fit` raised: the peers may be gone, so no network call."""
        pending = self.watch.pending
        self.watch.done()
        self.watch.uninstall()
        if self.agreement is not None and clean:
            self.agreement.close()
        self.agreement = None
        return pending
