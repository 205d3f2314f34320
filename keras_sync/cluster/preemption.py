"""SIGTERM or Ctrl-C during `Sync.fit`: a backup at one step on every worker, then exit 143 or 130.

`BackupAndRestore` holds a `PreemptionSaver` from train begin to train end; without a backup,
`ctrl_c_ends_fit` turns Ctrl-C into the same exit, in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import training_tasks
from keras_sync.cluster.collective_calls import PeerCalls, peer_calls

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, TensorFlow's restartable code
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: a person stopped the job (Ctrl-C)
_STOP = "stop"  # posted when a fit ends without a preemption, to release the watcher threads
_fit_numbers = itertools.count(1)  # the same on every worker, so it names one fit's keys


def signal_name(signum: int | None) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"


def exit_code(signum: int | None) -> int:
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def _say(message: str) -> None:
    with contextlib.suppress(Exception):
        print(f"keras-sync: {message}", file=sys.stderr, flush=True)


def exit_now(code: int, message: str | None = None) -> None:
    """Say ``message``, run the atexit hooks (the run's delivery), then `os._exit` (peers may be gone)."""
    if message:
        _say(message)
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
    """A second Ctrl-C: exit 130 now, without a backup or the wait for delivery."""
    _say("Ctrl-C again: exiting at once, without a backup at this step")
    os._exit(INTERRUPTED_EXIT_CODE)


class PreemptionSaver:
    """A SIGTERM or Ctrl-C during one `fit`: when every worker saves (after the signalled worker's
    step + 1, agreed in the coordination service), and the exit if `done` comes too late."""

    def __init__(self, grace_period_s: float):
        self.grace_period_s = float(grace_period_s)
        self._previous: dict[int, Any] = {}  # the handlers `install` replaced
        self._wake_w = self._old_wakeup_fd = -1
        self._reset()

    def _reset(self) -> None:
        self.received_at: float | None = None
        self._own_signum: int | None = None  # the first stop signal this process received
        self._done = threading.Event()
        self.target: int | None = None  # the optimizer step after which every worker saves
        self._peer_signum: int | None = None  # the stop signal of the worker that announced it
        self._workers = self._task = 0  # training tasks when several agree on the step, else 0
        self._calls: PeerCalls | None = None  # the strategy's meetings, with several workers
        self._key = ""  # this fit's prefix in the coordination service's key-value store
        self._announced = False

    @property
    def pending(self) -> bool:
        return self.received_at is not None

    @property
    def signum(self) -> int | None:
        """The stop signal this process exits for: its own, else the one the announcing worker got."""
        return self._own_signum if self._own_signum is not None else self._peer_signum

    def install(self) -> bool:
        """Handle SIGTERM and SIGINT from now on; False (nothing changed) outside the main thread."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return bool(self._previous)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        name = "keras-sync-stop-signal-watchdog"
        threading.Thread(target=self._watchdog, args=(wake_r,), name=name, daemon=True).start()
        return True

    def uninstall(self) -> None:
        if not self._previous:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self._wake_w)  # the watchdog's read returns b"" and it ends

    def done(self) -> None:
        """The watchdog stands down (a second Ctrl-C still exits)."""
        self._done.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received_at is None:
            self._own_signum, self.received_at = signum, time.monotonic()

    def _watchdog(self, fd: int) -> None:
        first: int | None = None
        try:
            while data := os.read(fd, 64):  # b"": `uninstall` closed the pipe
                for sig in (b for b in data if b in (signal.SIGTERM, signal.SIGINT)):
                    if first is None:
                        first = sig
                        args = (sig, self._done)
                        threading.Thread(target=self._expire, args=args, daemon=True).start()
                    elif sig == signal.SIGINT:  # a person who pressed Ctrl-C again does not wait
                        exit_at_once()
        finally:
            os.close(fd)

    def _expire(self, signum: int, done: threading.Event) -> None:
        if not done.wait(self.grace_period_s):
            grace = f"fault_tolerance.grace_period_s={self.grace_period_s:g} s"
            exit_now(
                exit_code(signum),
                f"{signal_name(signum)}: no backup could be saved within {grace}; "
                "exiting without it. Relaunch the job to resume from the last backup.",
            )

    def begin(self, strategy: Any) -> None:
        self._reset()
        key = f"keras_sync/preemption/{next(_fit_numbers)}"
        if not self.install():
            return  # not the main thread: SIGTERM and SIGINT keep their previous meaning
        from keras_sync.upstream.strategy_facts import in_multi_worker_mode

        if in_multi_worker_mode(strategy):
            resolver = strategy.cluster_resolver
            tasks = list(training_tasks(resolver.cluster_spec().as_dict()))
            self._task = tasks.index((resolver.task_type, int(resolver.task_id)))
            self._workers, self._key = len(tasks), key
            self._calls = peer_calls(strategy)
            name = "keras-sync-preemption"
            threading.Thread(target=self._watch, args=(key,), name=name, daemon=True).start()

    def _watch(self, key: str) -> None:
        from keras_sync.upstream import multi_worker

        try:  # blocks, the GIL released, until a worker announces or the fit ends
            value = multi_worker.get_key(f"{key}/step", 2**31 - 1)
        except Exception:  # the cluster went away: the main thread hears about it too
            return
        if value == _STOP or key != self._key:
            return
        self._take(value)
        # Set before acknowledging: the announcing worker trains step `target` only after every ack.
        with contextlib.suppress(Exception):
            multi_worker.set_key(f"{key}/ack/{self._task}", "1")

    def _take(self, value: str) -> None:
        step, _, signum = value.partition(":")  # "<step>:<signal number>"
        self._peer_signum, self.target = int(signum) if signum else None, int(step)

    def save_due(self, step: Callable[[], int]) -> bool:
        """At a batch end: True when every worker saves now. ``step()`` reads the optimizer step."""
        if not self._workers:
            return self.pending
        if self.target is None:
            if self.pending and not self._announced:
                self._announce(step())
            return False  # the agreed step is the next one
        return step() >= self.target

    def save_due_at_epoch_end(self, step: Callable[[], int]) -> bool:
        """At an epoch end: True when one process saves now (workers save at the agreed step)."""
        return self.save_due(step) and not self._workers

    def _announce(self, step: int) -> None:
        """Ask every worker to save after step ``step + 1`` (or another's step); wait for the acks."""
        import tensorflow as tf

        from keras_sync.upstream import multi_worker

        self._announced = True
        deadline = (self.received_at or time.monotonic()) + self.grace_period_s

        def ms_left() -> int:
            return max(1, int((deadline - time.monotonic()) * 1000))

        signum = self._own_signum or signal.SIGTERM
        with contextlib.suppress(tf.errors.AlreadyExistsError):  # another worker announced first
            multi_worker.set_key(f"{self._key}/step", f"{step + 1}:{int(signum)}")
        try:
            value = multi_worker.get_key(f"{self._key}/step", ms_left())
            if value == _STOP:
                return
            for task in range(self._workers):
                multi_worker.get_key(f"{self._key}/ack/{task}", ms_left())
        except tf.errors.DeadlineExceededError:
            return
        self._take(value)
        # Ctrl-C reaches every worker (the launcher forwards it): the chief's closing line is enough.
        if self._own_signum != signal.SIGINT:
            _say(
                f"SIGTERM at optimizer step {step}: every worker saves a backup after step "
                f"{self.target}, then exits"
            )

    def leave_together(self) -> None:
        """After the save: wait (up to the grace period) until every worker has saved, so that none
        exits while a peer still reads its buffers."""
        if self._workers and self._calls is not None:
            self._calls.all_done("the preemption save", timeout_s=self.grace_period_s)

    def end(self, *, clean: bool = True) -> bool:
        """Stand down at train end; True when a signal came but no save. ``clean=False``: no network."""
        pending = self.pending
        self.done()
        self.uninstall()
        if self._workers and clean:
            from keras_sync.upstream import multi_worker

            with contextlib.suppress(Exception):
                multi_worker.set_key(f"{self._key}/step", _STOP)
        self._workers = 0
        return pending


@contextlib.contextmanager
def ctrl_c_ends_fit(model: Any, *, is_chief: bool, backup_dir: str | None) -> Iterator[None]:
    """Around `model.fit`: a `KeyboardInterrupt` ends the process with one line (chief) and code 130."""
    try:
        yield
    except KeyboardInterrupt:
        with contextlib.suppress(ValueError):  # not the main thread, which Ctrl-C never reaches
            signal.signal(signal.SIGINT, exit_at_once)
        at = ""
        with contextlib.suppress(Exception):
            at = f" at optimizer step {int(model.optimizer.iterations.numpy())}"
        resume = (
            "Set fault_tolerance.backup_dir to save a backup where Ctrl-C stops and resume there."
        )
        if backup_dir:
            at += " before keras-sync could save a backup at this step"
            resume = f"A relaunch resumes from the newest backup in {backup_dir}, if there is one."
        message = f"Ctrl-C: training stopped{at}; exiting with code 130. {resume}"
        exit_now(INTERRUPTED_EXIT_CODE, message if is_chief else None)
