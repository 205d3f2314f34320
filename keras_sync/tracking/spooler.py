"""The writer's background side: a thread moves queued records into the spool and keeps a courier
process delivering it.

The training thread only appends to `Spooler.queue`. Every `SPOOL_INTERVAL_S` (or when woken) the
thread cleans the queued records, appends them to the spool, and starts the courier again if it
died. What the spool refuses (its disk is full) is handed to the courier from memory
(`keras_sync.tracking.handover`). The spool files are the only interface between the two
processes, so a killed training process loses at most one interval of records.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from keras_sync.errors import TrackingError
from keras_sync.tracking import causes
from keras_sync.tracking import courier as _courier
from keras_sync.tracking.clean import RecordCleaner
from keras_sync.tracking.handover import Handover
from keras_sync.tracking.records import (
    BEGIN,
    CREDENTIALS,
    END,
    MAX_TAG_VALUE_LENGTH,
    METRICS,
    STORE_FAILING,
    TAGS,
    is_last_record,
)
from keras_sync.tracking.spool import Position, SpoolDir, SpoolFull

_log = logging.getLogger("keras_sync.tracking")

#: How often the thread moves queued records to the spool (seconds).
SPOOL_INTERVAL_S = 0.2
#: Kept free in the spool directory (the file ``reserve``) for the records that end a run whose
#: spool filled its disk: which steps were lost, and the run's status.
RESERVE_BYTES = 16 * 1024
LOST_TAG = "keras_sync.metrics_lost"


def _lower_thread_priority() -> None:
    """Nice the spooling thread a little (Linux threads have their own nice value): when the cores
    are busy, the training goes first; moving records to a file is never urgent."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class Spooler:
    """Queue -> spool -> courier for one writer; the courier's news read back for the writer.

    ``on_run`` is called once from the thread when the run is known, or MLflow failed before it
    was, once a run has begun (a writer started with its begin deferred may never begin one).
    """

    def __init__(
        self,
        spool: SpoolDir,
        uri: str,
        header: dict[str, Any],
        cleaner: RecordCleaner,
    ) -> None:
        self.spool, self.uri, self.header = spool, uri, header
        self.shown_uri: str = header["tracking_uri"]
        self._clean = cleaner
        self.on_run: Callable[[], None] | None = None
        self._begun = False
        self.queue: deque[tuple[int, dict[str, Any]]] = deque()
        self._seq = itertools.count(1)
        self.last_seq = self._spooled_seq = 0
        self.spooled_pos: Position = (0, 0)
        self.wake = threading.Event()
        self._spooled = threading.Condition()
        self.thread: threading.Thread | None = None
        self._launcher: _courier.Launcher | None = None
        self.courier: subprocess.Popen[bytes] | None = None
        self.closing = self.dead = self._end_spooled = self._finished = False
        self.handover = Handover()  # records the spool could not take (disk full), for the courier
        self.spool_error: str | None = None  # why the spool stopped taking records
        self._begin_ms: int | None = None
        self._status: dict[str, Any] | None = None
        self._run: dict[str, Any] = {}
        self._said_refused = False
        self._said_lock = threading.Lock()

    # ---- the writer's side ----
    def start(self, begin_ms: int | None) -> None:
        """Start the thread (it opens the spool, spooling a "begin" at ``begin_ms`` unless None)."""
        if self.thread is None:
            self._begin_ms = begin_ms
            self._begun |= begin_ms is not None
            self._launcher = _courier.Launcher()  # here: the courier is not niced with the thread
            self.thread = threading.Thread(target=self._loop, name="keras-sync-mlflow", daemon=True)
            self.thread.start()

    def put(self, rec: dict[str, Any]) -> None:
        self._begun |= rec["k"] == BEGIN
        seq = next(self._seq)
        self.queue.append((seq, rec))
        self.last_seq = seq

    def flush_to_spool(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is in the spool."""
        target = self.last_seq
        if self.thread is None or not self.thread.is_alive():
            return not self.queue
        self.wake.set()
        with self._spooled:
            return self._spooled.wait_for(
                lambda: self._spooled_seq >= target or self.dead, timeout=timeout_s
            )

    def status(self) -> dict[str, Any] | None:
        """The courier's last outcome: from its pipe when it has one (a full disk keeps the file old)."""
        return self.handover.news.get("status") or self.spool.status()

    def failure(self) -> dict[str, Any] | None:
        status = self.status()
        return status if status is not None and not status.get("ok") else None

    def run(self) -> dict[str, Any]:
        """What the courier said of the run (``run_id``, ``experiment_id``); empty before it knows."""
        if not self._run.get("run_id"):
            self._run = self.spool.run() or self.handover.news.get("run", {})
        return self._run

    def progress(self) -> tuple[Position, int]:
        """How far delivery got: the spool position, and the number of held records MLflow has."""
        pos = self.spool.delivered()
        news = self.handover.news
        if "pos" in news:
            pos = max(pos, (int(news["pos"][0]), int(news["pos"][1])))
        return pos, self.handover.acked()

    def target(self) -> tuple[Position, int]:
        """The progress at which MLflow has everything spooled or held so far."""
        return self.spooled_pos, self.handover.last

    def reached(self, target: tuple[Position, int]) -> bool:
        pos, held = self.progress()
        return pos >= target[0] and held >= target[1]

    def pending(self) -> list[dict[str, Any]]:
        """Records MLflow does not have yet: spooled, held, or still queued (in this order)."""
        recs = [rec for _, rec in self.spool.read(self.progress()[0], max_records=10**9)]
        return recs + self.handover.unacknowledged() + [rec for _, rec in self.queue]

    def points_left(self) -> int:
        """Metric points queued, spooled or held that MLflow does not have yet."""
        return sum(len(rec.get("d", ())) for rec in self.pending() if rec.get("k") == METRICS)

    def all_delivered(self) -> bool:
        return not self.handover.unacknowledged() and not self.spool.read(
            self.progress()[0], max_records=1
        )

    def say_refused_once(self) -> bool:
        """If the credentials were refused, say so in one line (once); True if they were."""
        failed = self.failure()
        if failed is None or failed.get("cause") != CREDENTIALS:
            return False
        with self._said_lock:
            if self._said_refused:
                return True
            self._said_refused = True
        _log.warning(causes.refused_line(self.uri, self.shown_uri, failed, self.spool.path))
        return True

    def cause(self) -> str:
        """Why delivery is behind, in words."""
        running = self.courier is not None and self.courier.poll() is None
        return causes.cause(self.failure(), self.shown_uri, running, self.status() is not None)

    def undelivered_message(self, final: bool) -> str | None:
        """Why some records are not in MLflow, and where they are; None if everything arrived."""
        spooled = [rec for _, rec in self.spool.read(self.progress()[0], max_records=10**9)]
        return causes.undelivered_message(
            spooled,
            self.handover.unacknowledged(),
            [rec for _, rec in self.queue],
            self.cause(),
            spool=self.spool.path,
            spool_error=self.spool_error,
            credentials_hidden=self.shown_uri != self.uri,
            final=final,
        )

    def stop(self, delivered: bool, never_begun: bool) -> None:
        """Stop the thread; a courier that delivered the run's end is given a moment to exit."""
        self.closing = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join(5.0)
        if delivered and self.courier is not None and not never_begun:
            try:
                self.courier.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self.handover.pump()  # forget what the courier acknowledged last

    def kill_courier(self) -> None:
        """After close nothing runs in the background; the spool keeps what is left. SIGKILL: the
        courier ignores SIGTERM (meant for the trainer when a scheduler signals a whole job step)."""
        if self.courier is not None and self.courier.poll() is None:
            self.courier.kill()
            self.courier.wait()
        self.handover.settle()
        self.handover.pump()
        self.handover.disconnect()

    def spill_held(self, cause: str) -> str | None:
        """After the courier stopped: put what MLflow did not take into the spool if the disk has room
        again (None: all of it is there now); else end the spooled run FAILED with a tag naming what is
        lost, and return the line to show."""
        records = self.handover.unacknowledged()
        try:
            self.spooled_pos = self.spool.append(records)
            records = []
        except SpoolFull as e:
            self.spooled_pos = e.pos
            records = records[e.done :]
        if not records and not self.handover.dropped:
            return None
        lost = self.lost_text(*self.handover.lost_steps(records))
        (self.spool.path / "reserve").unlink(missing_ok=True)  # room for the run's end
        end: list[dict[str, Any]] = [
            {"k": TAGS, "d": {LOST_TAG: lost[:MAX_TAG_VALUE_LENGTH]}},
            {"k": END, "status": "FAILED", "ts": int(time.time() * 1000)},
        ]
        try:
            self.spooled_pos = self.spool.append(end)
            after = (
                f"the rest is in the spool: `keras-sync sync-spool {self.spool.path}` delivers it and "
                f"ends the run FAILED with the tag {LOST_TAG}"
            )
        except SpoolFull:
            after = f"nothing more fits in {self.spool.path}: the run stays RUNNING in MLflow"
        return f"keras-sync: MLflow lost {lost} ({cause}); {after}."

    def lost_text(self, steps: list[int], others: int) -> str:
        return causes.lost_text(steps, others, self.spool.path, self.spool_error)

    def loss_tag(self) -> dict[str, Any] | None:
        """The tag record naming what was dropped over the memory bound; None if nothing was."""
        if not self.handover.dropped:
            return None
        return {"k": TAGS, "d": {LOST_TAG: self.lost_text(*self.handover.lost_steps([]))}}

    def shut_down(self, delivered: bool, never_begun: bool) -> str | None:
        """After the writer's last wait: stop the thread and the courier, put what only memory holds
        into the spool, remove a spool MLflow has all of. Returns the warning to give, if any."""
        self.stop(delivered, never_begun)
        held = bool(self.handover.unacknowledged() or self.handover.dropped)
        message = None if delivered or held else self.undelivered_message(final=True)
        cause = self.cause()  # while the courier is still there to ask
        if message and self.say_refused_once():
            message = None  # said in its one line already
        self.kill_courier()
        self.run()  # read before the spool that holds it may be removed
        if held and not delivered:
            message = self.spill_held(cause) or self.undelivered_message(final=True)
        self.spool.close_segment()
        self.spool.unlock("writer")
        alive = self.thread is not None and self.thread.is_alive()
        if message is None and not alive and (never_begun or self.all_delivered()):
            self.spool.remove()  # everything is in MLflow: the spool has done its job
            from keras_sync.tracking import artifacts as _artifacts

            _artifacts.remove_staging_if_empty(self.spool.path)
        return message

    # ---- the thread ----
    def _loop(self) -> None:
        _lower_thread_priority()
        restarts, respawn_at = 0, 0.0
        try:
            self._open_spool()
            self._check_store()
            while True:
                self.wake.clear()  # before draining: a flush from now on is not lost
                self._drain()
                self.handover.pump()
                closing = self.closing
                ended = self.courier is not None and self.courier.poll() is not None
                if ended and not self._finished:
                    assert self.courier is not None
                    self.handover.settle()  # its last word, before judging its exit
                    if self._end_spooled and self.reached(self.target()):
                        self._finished = True  # it delivered the run's end and stopped
                    elif not closing:
                        restarts += 1
                        _log.warning(
                            "keras-sync's MLflow courier process exited (code %s); restarting "
                            "it (records are kept in %s).",
                            self.courier.returncode,
                            self.spool.path,
                        )
                        respawn_at = time.monotonic() + min(0.5 * 2**restarts, 30.0)
                        self.courier = None
                if self.courier is None and not closing and time.monotonic() >= respawn_at:
                    self._spawn_courier()
                self._watch_status()
                self._tell_run()
                if closing:
                    return
                self.wake.wait(SPOOL_INTERVAL_S)
        except OSError as e:  # the spool directory itself failed (removed)
            self.dead = True
            _log.error(
                "keras-sync cannot write its MLflow spool %s (%s); MLflow logging stops for this run.",
                self.spool.path,
                e,
            )
        finally:
            with self._spooled:
                self._spooled.notify_all()

    def _open_spool(self) -> None:
        """Take the job's spool directory (or continue the one a crashed process left)."""
        if not self.spool.lock("writer"):
            # The same job id is logging elsewhere right now: this writer keeps its own spool.
            busy = self.spool.path
            self.spool = SpoolDir(busy.with_name(f"{busy.name}.{os.getpid()}-{id(self):x}"))
            self.spool.lock("writer")
            _log.warning(
                "Spool %s is in use by another writer; this one writes %s.", busy, self.spool.path
            )
        (self.spool.path / "status.json").unlink(missing_ok=True)  # a predecessor's is not ours
        try:  # a full disk from the start: the courier has the header from its environment
            self.spool.write_header(self.header)
            self.spooled_pos = self.spool.start_segment()
            reserve = self.spool.path / "reserve"
            if not reserve.exists():
                reserve.write_bytes(b"\0" * RESERVE_BYTES)
        except OSError as e:
            self._spool_failed(e.strerror or str(e))
        if self._begin_ms is not None:
            self._spool_or_hold([{"k": BEGIN, "ts": self._begin_ms}])

    def _check_store(self) -> None:
        """A local sqlite store that cannot be created is known now, not after the courier imported MLflow."""
        from keras_sync.tracking.sqlite_store import check_creatable

        try:
            check_creatable(self.uri)
        except TrackingError as e:  # the courier says the same once it tries ("ok" if fixed)
            self.handover.news = {
                **self.handover.news,
                "status": {
                    "ok": False,
                    "at": time.time(),
                    "error": f"TrackingError: {e}",
                    "cause": STORE_FAILING,
                    "uri": self.shown_uri,
                },
            }

    def _spawn_courier(self) -> None:
        try:
            ends = self.handover.connect()  # its pipes: records the spool cannot take, its news
        except OSError:
            ends = None
        assert self._launcher is not None
        try:
            self.courier = self._launcher.call(
                lambda: _courier.spawn(self.spool, self.uri, header=self.header, pipe_fds=ends)
            )
        except OSError as e:
            self.courier = None
            self.handover.disconnect()
            _log.error(
                "keras-sync cannot start its MLflow courier process (%s); records are kept in %s "
                "(deliver them with: keras-sync sync-spool %s).",
                e,
                self.spool.path,
                self.spool.path,
            )
        finally:
            for fd in ends or ():
                os.close(fd)  # the courier's ends: its copies are its own

    def _tell_run(self) -> None:
        if self.on_run is None or not self._begun:
            return
        failed = self.failure()
        at = failed.get("answered_at") if failed is not None else None
        answering = isinstance(at, (int, float)) and time.time() - at < causes.STALL_S
        if self.run().get("run_id") is not None or (failed is not None and not answering):
            on_run, self.on_run = self.on_run, None
            try:
                on_run()
            except Exception as e:
                _log.debug("on_run failed: %s", e)

    def _watch_status(self) -> None:
        """Log the courier's first failure and its recovery (in this process, where logging is set up)."""
        status = self.status()
        was_ok = self._status is None or self._status.get("ok")
        if status is not None and not status.get("ok") and status.get("cause") == CREDENTIALS:
            self.say_refused_once()
        elif status is not None and not status.get("ok") and was_ok:
            _log.warning(
                "keras-sync: MLflow at %s is %s (%s); records are kept in %s, retrying in the "
                "background.",
                self.shown_uri,
                causes.cause_in_a_word(status.get("cause")),
                status.get("error"),
                self.spool.path,
            )
        elif status is not None and status.get("ok") and not was_ok:
            _log.info(
                "keras-sync: MLflow at %s is reachable again; the spool backlog is being delivered.",
                self.shown_uri,
            )
        self._status = status

    def _drain(self) -> None:
        recs: list[dict[str, Any]] = []
        last = None
        while self.queue:
            seq, rec = self.queue.popleft()
            last = seq
            cleaned = self._clean(rec)
            if cleaned is not None:
                recs.append(cleaned)
                self._end_spooled |= is_last_record(cleaned)
        if recs:
            self._spool_or_hold(recs)
        if last is not None:
            with self._spooled:
                self._spooled_seq = last
                self._spooled.notify_all()

    def _spool_or_hold(self, recs: list[dict[str, Any]]) -> None:
        """Append to the spool; what it refuses, and everything after, goes to the courier from memory."""
        if self.spool_error is None:
            try:
                self.spooled_pos = self.spool.append(recs)
                if self.spool.remade is not None:
                    _log.warning(
                        "keras-sync: the MLflow spool %s was deleted while this run logged into it; "
                        "keras-sync made it again and %s (the courier sends them again; MLflow keeps "
                        "one point per step). Records of earlier segments not yet delivered went with "
                        "it. Fix: leave mlflow.spool_dir alone while a job runs, or set it to a folder "
                        "nothing cleans.",
                        self.spool.path,
                        self.spool.remade,
                    )
                    self.spool.remade = None
                return
            except SpoolFull as e:
                self.spooled_pos = e.pos
                recs = recs[e.done :]
                self._spool_failed(e.reason)
        for rec in recs:
            self.handover.hold(rec)

    def _spool_failed(self, reason: str) -> None:
        if self.spool_error is None:
            self.spool_error = reason
            _log.warning(
                "keras-sync cannot write its MLflow spool %s (%s): from here on the records are kept "
                "in memory (at most %d MB) and handed to the courier directly; none is lost while "
                "MLflow takes them.",
                self.spool.path,
                reason,
                self.handover.max_bytes // 2**20,
            )
