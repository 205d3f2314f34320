"""The writer's background side: a thread moves queued records into the spool and keeps a courier
process (`keras_sync.tracking.courier`) delivering it. Records a full disk refuses are held in
memory (at most `MAX_HELD_BYTES`) and handed to the courier over its stdin; what is still held at
close is spilled to the spool, else the run ends FAILED, tagged `LOST_TAG`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_sync.tracking import artifacts
from keras_sync.tracking import records as r
from keras_sync.tracking.spool import Position, SpoolDir, SpoolFull

_log = logging.getLogger("keras_sync.tracking")

SPOOL_INTERVAL_S = 0.2
#: Kept free in the spool (the file ``reserve``) for the records that end a run on a full disk.
RESERVE_BYTES = 16 * 1024
#: Memory for records the spool could not take; beyond it, metric points are dropped (and named).
MAX_HELD_BYTES = 64 * 1024 * 1024
LOST_TAG = "keras_sync.metrics_lost"
#: A wait for delivery gives up when the delivered position has not moved for this long (seconds).
STALL_S = 30.0
#: How long a wait allows before the courier's first attempt.
STARTUP_S = 120.0
#: How long the exit waits for delivery before a line says what it waits for (seconds).
EXIT_QUIET_S = 2.0
#: What the courier runs as (``python -m``): a module the package does not import.
ENTRY_MODULE = "keras_sync.tracking.courier_main"


def step_ranges(steps: list[int]) -> str:
    """Steps as ranges, for a line a person reads.

    >>> step_ranges([184, 185, 186, 190, 3])
    '3, 184-186, 190'
    """
    out: list[list[int]] = []
    for step in sorted(set(steps)):
        if out and out[-1][1] == step - 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _held_line(number: int, rec: dict[str, Any]) -> bytes:
    return json.dumps({"h": number, "r": rec}, separators=(",", ":")).encode() + b"\n"


class Spooler:
    """Queue -> spool (or memory) -> courier for one writer, and how far delivery got."""

    def __init__(
        self, spool: SpoolDir, uri: str, header: dict[str, Any], cleaner: r.RecordCleaner
    ) -> None:
        self.spool, self.uri, self.header, self._clean = spool, uri, header, cleaner
        self.shown_uri: str = header["tracking_uri"]
        self.on_run: Callable[[], None] | None = None
        self._begun = False
        self.queue: deque[tuple[int, dict[str, Any]]] = deque()
        self._seq = itertools.count(1)
        self.last_seq = self._spooled_seq = 0
        self.spooled_pos: Position = (0, 0)
        self.wake = threading.Event()
        self._spooled = threading.Condition()
        self.thread: threading.Thread | None = None
        self.courier: subprocess.Popen[bytes] | None = None
        self._news_reader: threading.Thread | None = None
        self.closing = self.dead = self._end_spooled = self._was_failing = False
        self.hurry = False  # a wait for delivery: the courier is woken at the next drain
        self.spool_error: str | None = None  # why the spool stopped taking records
        self._said_refused = threading.Lock()  # taken once: the refusal is said
        # Records the spool refused, (number, record, size), until the courier has them in MLflow.
        self.held: deque[tuple[int, dict[str, Any], int]] = deque()
        self.held_last = self.held_bytes = 0
        self.dropped: list[dict[str, Any]] = []  # over the memory bound: lost
        self.news: dict[str, Any] = {"pos": (0, 0), "h": 0}  # what the courier said
        self._to_courier = bytearray()

    def start(self, begin_ms: int | None) -> None:
        """Start the thread; it spools a "begin" at ``begin_ms`` (unless None) before the queue."""
        if self.thread is None:
            if begin_ms is not None:
                self._begun = True
                self.queue.appendleft((0, {"k": r.BEGIN, "ts": begin_ms}))
            self.thread = threading.Thread(target=self._loop, name="keras-sync-mlflow", daemon=True)
            self.thread.start()

    def put(self, rec: dict[str, Any]) -> None:
        self._begun |= rec["k"] == r.BEGIN
        self.last_seq = next(self._seq)
        self.queue.append((self.last_seq, rec))

    def flush_to_spool(self, timeout_s: float) -> bool:
        target = self.last_seq
        if self.thread is None or not self.thread.is_alive():
            return not self.queue
        self.wake.set()
        with self._spooled:
            return self._spooled.wait_for(
                lambda: self._spooled_seq >= target or self.dead, timeout=timeout_s
            )

    def status(self) -> dict[str, Any] | None:
        """The courier's last outcome, None before its first."""
        return self.news.get("status")

    def failure(self) -> dict[str, Any] | None:
        status = self.status()
        return status if status is not None and not status.get("ok") else None

    def answering(self, within_s: float = STALL_S) -> bool:
        """Whether MLflow, though some requests fail, answered one within ``within_s``."""
        at = (self.failure() or {}).get("answered_at")
        return isinstance(at, (int, float)) and time.time() - at < within_s

    def run(self) -> dict[str, Any]:
        """What the courier said of the run (``run_id``, ``experiment_id``); empty before."""
        return self.news.get("run") or self.spool.run()

    def progress(self) -> tuple[Position, int]:
        pos = max(self.spool.delivered(), self.news["pos"])
        return (int(pos[0]), int(pos[1])), self.news["h"]

    def _caught_up(self, target: tuple[Position, int]) -> bool:
        pos, held = self.progress()
        return pos >= target[0] and held >= target[1]

    def unacknowledged(self) -> list[dict[str, Any]]:
        return [rec for n, rec, _ in list(self.held) if n > self.news["h"]]

    def _left(self) -> list[dict[str, Any]]:
        """What MLflow does not have yet: spooled, held and queued records."""
        spooled = [rec for _, rec in self.spool.read(self.progress()[0], max_records=10**9)]
        return spooled + self.unacknowledged() + [rec for _, rec in self.queue]

    def wait_delivered(
        self, timeout_s: float | None, stall_s: float = STALL_S, progress: Any = None
    ) -> bool:
        """Wait until MLflow has everything spooled so far, while it progresses; True if it has."""
        target = self.spooled_pos, self.held_last
        self.hurry = True  # the courier sends the points it holds for a batch now
        self.wake.set()
        seen, last_move = self.progress(), time.monotonic()
        deadline = last_move + (timeout_s if timeout_s is not None else float("inf"))
        while not self._caught_up(target):
            if self.dead or (self.failure() is not None and not self.answering(stall_s)):
                return False
            now, limit = time.monotonic(), STARTUP_S if self.status() is None else stall_s
            if now >= deadline or now - last_move > limit:
                return False
            time.sleep(0.02)
            if (now_at := self.progress()) != seen:
                seen, last_move = now_at, time.monotonic()
            if progress is not None:
                progress()
        return True

    def exit_line(self) -> Callable[[], None]:
        """Say what the exit waits for (at once if metric points are left); call it while waiting."""
        left = sum(len(rec["d"]) for rec in self._left() if rec["k"] == r.METRICS)
        start, shown = time.monotonic(), [False]
        what = f"{left} metric point(s)" if left else "the run's last records"

        def update() -> None:
            if not shown[0] and (left or time.monotonic() - start >= EXIT_QUIET_S):
                shown[0] = True
                print(
                    f"keras-sync: waiting for MLflow ({self.shown_uri}) to receive {what} before "
                    f"exit. Ctrl-C leaves them in {self.spool.path} for `{self._hint()}`",
                    file=sys.stderr,
                    flush=True,
                )

        update()
        return update

    def _hint(self) -> str:
        hint = f"keras-sync sync-spool {self.spool.path}"
        return hint + (" --tracking-uri URI" if self.shown_uri != self.uri else "")

    def say_refused_once(self) -> bool:
        """If the credentials were refused, say so in one line (once); True if they were."""
        failed = self.failure()
        if failed is None or failed.get("cause") != r.CREDENTIALS:
            return False
        if self._said_refused.acquire(blocking=False):
            _log.warning(
                f"keras-sync: MLflow at {self.shown_uri} refused the credentials "
                f"({failed.get('error')}); training goes on and the metrics are kept in "
                f"{self.spool.path}. Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                f"(or MLFLOW_TRACKING_TOKEN), then deliver them with: {self._hint()}"
            )
        return True

    def cause(self) -> str:
        failed, uri = self.failure(), self.shown_uri
        if failed is not None:
            return r.why_failing(failed, uri)
        if self.courier is None or self.courier.poll() is not None:
            return f"the courier process that delivers to {uri} is not running"
        if self.status() is None:
            return f"the courier process had not reached {uri} yet"
        return f"delivery to {uri} made no progress for {STALL_S:g} s"

    def undelivered_message(self, final: bool) -> str | None:
        """Why some records are not in MLflow and where they are; None if all arrived."""
        count = sum(rec["k"] not in r.BOOKKEEPING for rec in self._left())
        if count == 0:
            return None
        what = f"keras-sync: {count} MLflow record(s) are not delivered yet: {self.cause()}."
        if final:
            return f"{what} They are kept in {self.spool.path}. Deliver them with: {self._hint()}."
        return f"{what} They are kept in {self.spool.path} and delivered in the background."

    def lost_text(self, records: list[dict[str, Any]]) -> str:
        """What a full disk cost: the steps and other records of ``records`` and the dropped."""
        both = records + self.dropped
        steps = [rec["s"] for rec in both if rec["k"] == r.METRICS]
        others = sum(rec["k"] not in (r.METRICS, *r.BOOKKEEPING) for rec in both)
        what = f"the points of steps {step_ranges(steps)}" if steps else "no metric points"
        what += f" and {others} other record(s)" if others else ""
        return f"{what}: the spool {self.spool.path} could not be written ({self.spool_error})"

    def shut_down(self, delivered: bool, never_begun: bool) -> str | None:
        """Stop thread and courier, spill what memory holds, remove a delivered spool."""
        self.closing = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join(5.0)
        courier = self.courier
        if delivered and courier is not None and not never_begun:
            with contextlib.suppress(subprocess.TimeoutExpired):  # it delivered the run's end
                courier.wait(5.0)
        self._pump()
        held = bool(self.unacknowledged() or self.dropped)
        message = None if delivered or held else self.undelivered_message(final=True)
        cause = self.cause()  # while the courier is still there to ask
        if message and self.say_refused_once():
            message = None  # said in its one line already
        if courier is not None:
            courier.kill()  # after close nothing runs in the background (it ignores SIGTERM)
            courier.wait()
            if self._news_reader is not None:
                self._news_reader.join(2.0)  # its last news
            self._pump()
            self._disconnect()
        self.news["run"] = self.run()  # read before the spool that holds it may be removed
        if held and not delivered:
            message = self._spill_held(cause) or self.undelivered_message(final=True)
        self.spool.close_segment()
        self.spool.unlock("writer")
        alive = self.thread is not None and self.thread.is_alive()
        done = never_begun or not (self.unacknowledged() or self.spool.read(self.progress()[0], 1))
        if message is None and not alive and done:
            self.spool.remove()  # everything is in MLflow: the spool has done its job
            with contextlib.suppress(OSError):  # absent, or holding undelivered artifacts
                artifacts.staging_dir(self.spool.path).rmdir()
        return message

    def _spill_held(self, cause: str) -> str | None:
        """Spool what memory holds; else end the run FAILED, tagged, and return the line saying so."""
        records = self.unacknowledged()
        try:
            self.spooled_pos = self.spool.append(records)
            records = []
        except SpoolFull as e:
            self.spooled_pos, records = e.pos, records[e.done :]
        except OSError as e:  # the spool itself is gone: nothing more can be kept
            self.spool_error = str(e)
            _log.error(f"keras-sync: MLflow lost {self.lost_text(records)} ({cause}).")
            return None
        if not records and not self.dropped:
            return None
        lost = self.lost_text(records)
        (self.spool.path / "reserve").unlink(missing_ok=True)  # room for the run's end
        end: list[dict[str, Any]] = [
            {"k": r.TAGS, "d": {LOST_TAG: lost[: r.MAX_TAG_VALUE_LENGTH]}},
            {"k": r.END, "status": "FAILED", "ts": int(time.time() * 1000)},
        ]
        try:
            self.spooled_pos = self.spool.append(end)
            after = f"`keras-sync sync-spool {self.spool.path}` delivers the rest (run FAILED)"
        except SpoolFull:
            after = f"nothing more fits in {self.spool.path}: the run stays RUNNING in MLflow"
        return f"keras-sync: MLflow lost {lost} ({cause}); {after}."

    def _pump(self) -> None:
        """Forget what the courier acknowledged; write what its stdin takes now, never blocking."""
        while self.held and self.held[0][0] <= self.news["h"]:
            self.held_bytes -= self.held.popleft()[2]
        stdin = self.courier.stdin if self.courier is not None else None
        if stdin is None or not self._to_courier:
            return
        try:
            del self._to_courier[: os.write(stdin.fileno(), self._to_courier)]
        except BlockingIOError:
            pass
        except (OSError, ValueError):  # gone: a new courier is handed everything not acknowledged
            self._to_courier.clear()

    def _spawn_courier(self) -> None:
        env = dict(os.environ)  # the child imports this very keras_sync, installed or not
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", ENTRY_MODULE, str(self.spool.path), str(os.getpid())]
        try:
            # Its own session: a kill of the trainer's process group (`keras-sync launch`) spares it.
            courier = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
            )
        except OSError as e:
            _log.error(
                f"keras-sync cannot start its MLflow courier ({e}); deliver with: {self._hint()}"
            )
            return
        self.courier = courier
        assert courier.stdin is not None and courier.stdout is not None
        os.set_blocking(courier.stdin.fileno(), False)
        # On stdin, not on the command line (`ps` shows it; Linux takes at most 128 KiB there).
        handoff = json.dumps({"uri": self.uri, "header": self.header}).encode() + b"\n"
        held = (_held_line(n, rec) for n, rec, _ in self.held if n > self.news["h"])
        self._to_courier = bytearray(handoff + b"".join(held))
        self._news_reader = threading.Thread(
            target=self._read_news, args=(courier.stdout,), daemon=True
        )
        self._news_reader.start()
        self._pump()

    def _read_news(self, stdout: Any) -> None:
        for line in stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            news = dict(self.news)
            # A restarted courier starts from what the files say: never let the position go back.
            if "pos" in msg:
                news["pos"] = max(tuple(msg["pos"]), news["pos"])
            news["h"] = max(int(msg.get("h", 0)), news["h"])
            news.update({k: msg[k] for k in ("status", "run") if k in msg})
            self.news = news

    def _disconnect(self) -> None:
        if self.courier is not None and self.courier.stdin is not None:
            with contextlib.suppress(OSError):
                self.courier.stdin.close()
        self._to_courier.clear()

    def _loop(self) -> None:
        restarts, respawn_at = 0, 0.0
        try:
            self._open_spool()
            while True:
                self.wake.clear()  # before draining: a flush from now on is not lost
                self._drain()
                self._pump()
                closing = self.closing
                if self.courier is not None and self.courier.poll() is not None:
                    if self._news_reader is not None:
                        self._news_reader.join(2.0)  # its last word, before judging its exit
                    # A courier that delivered the writer's last record ended its job.
                    ended = self._end_spooled and self._caught_up(
                        (self.spooled_pos, self.held_last)
                    )
                    if not closing and not ended:
                        restarts += 1
                        _log.warning(
                            "keras-sync's MLflow courier process exited (code "
                            f"{self.courier.returncode}); restarting it."
                        )
                        respawn_at = time.monotonic() + min(0.5 * 2**restarts, 30.0)
                        self._disconnect()
                        self.courier = None
                if self.courier is None and not closing and time.monotonic() >= respawn_at:
                    self._spawn_courier()
                self._watch_status()
                if closing:
                    return
                self.wake.wait(SPOOL_INTERVAL_S)
        except OSError as e:  # the spool directory itself failed (removed)
            self.dead = True
            _log.error(
                f"keras-sync cannot write its MLflow spool {self.spool.path} ({e}); MLflow "
                "logging stops for this run."
            )
        finally:
            with self._spooled:
                self._spooled.notify_all()

    def _open_spool(self) -> None:
        """Take the job's spool directory (a crashed process's is continued)."""
        if not self.spool.lock("writer"):  # the job id is logging elsewhere now: a spool of ours
            busy = self.spool.path
            self.spool = SpoolDir(busy.with_name(f"{busy.name}.{os.getpid()}-{id(self):x}"))
            self.spool.lock("writer")
            _log.warning(
                f"Spool {busy} is in use by another writer; this one writes {self.spool.path}."
            )
        try:  # a full disk from the start: the courier has the header from its stdin
            self.spool.write_header(self.header)
            self.spooled_pos = self.spool.start_segment()
            reserve = self.spool.path / "reserve"
            if not reserve.exists():
                reserve.write_bytes(b"\0" * RESERVE_BYTES)
        except OSError as e:
            self._spool_failed(e.strerror or str(e))

    def _watch_status(self) -> None:
        """Say the courier's first failure (the credentials' in their own line); tell the run."""
        failed = self.failure()
        if failed is not None and failed.get("cause") == r.CREDENTIALS:
            self.say_refused_once()
        elif failed is not None and not self._was_failing:
            _log.warning(
                f"keras-sync: {r.why_failing(failed, self.shown_uri)}; records are kept in "
                f"{self.spool.path}, retrying in the background."
            )
        self._was_failing = failed is not None
        known = self.run().get("run_id") is not None or (failed and not self.answering())
        if self.on_run is not None and self._begun and known:
            on_run, self.on_run = self.on_run, None
            with contextlib.suppress(Exception):  # a line for the user, never the thread's end
                on_run()

    def _drain(self) -> None:
        recs: list[dict[str, Any]] = []
        last = None
        while self.queue:
            last, rec = self.queue.popleft()
            cleaned = self._clean(rec)
            if cleaned is not None:
                recs.append(cleaned)
                self._end_spooled |= r.is_last_record(cleaned)
        if recs:
            self._spool_or_hold(recs)
        # The courier looks at the spool every BATCH_S; a record that is not a point goes now.
        hurry, self.hurry = self.hurry or any(rec["k"] != r.METRICS for rec in recs), False
        if hurry and self.courier is not None:
            self._to_courier += r.WAKE_LINE
        if last is not None:
            with self._spooled:
                self._spooled_seq = max(last, self._spooled_seq)
                self._spooled.notify_all()

    def _spool_or_hold(self, recs: list[dict[str, Any]]) -> None:
        """Append to the spool; what it refuses, and all after, goes to the courier directly."""
        if self.spool_error is None:
            try:
                self.spooled_pos = self.spool.append(recs)
                recs = []
            except SpoolFull as e:
                self.spooled_pos, recs = e.pos, recs[e.done :]
                self._spool_failed(e.reason)
        for rec in recs:
            size = len(json.dumps(rec)) + 32
            if self.held_bytes + size > MAX_HELD_BYTES and rec["k"] not in r.ALWAYS_KEPT:
                self.dropped.append(rec)
                continue
            self.held_last += 1
            self.held.append((self.held_last, rec, size))
            self.held_bytes += size
            if self.courier is not None:
                self._to_courier += _held_line(self.held_last, rec)

    def _spool_failed(self, reason: str) -> None:
        if self.spool_error is None:
            self.spool_error = reason
            _log.warning(
                f"keras-sync cannot write its MLflow spool {self.spool.path} ({reason}): records "
                f"are kept in memory (at most {MAX_HELD_BYTES // 2**20} MB) until MLflow takes them."
            )
