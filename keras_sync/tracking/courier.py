"""The courier: a child process of the writer that delivers one spool to MLflow in order. Its
stdin brings the tracking URI (credentials never touch disk), the header, then the records a full
disk kept out of the spool and the writer's wake-ups; its stdout tells the writer where delivery
stands. It ends after the writer's last record, or once its parent died and the server stopped
answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from keras_sync.errors import TrackingError
from keras_sync.tracking import records as r
from keras_sync.tracking.deliver import Retrier, RunSender, is_transient, refused_credentials
from keras_sync.tracking.redact import redact_text, secrets_of
from keras_sync.tracking.spool import Position, SpoolDir
from keras_sync.tracking.sqlite_store import warm_up

#: Longest wait between two delivery attempts after MLflow refused a record (seconds).
MAX_BACKOFF_S = 30.0
#: A courier whose parent died keeps delivering while the server answered within this long.
ORPHAN_PATIENCE_S = 30.0
ORPHAN_POLL_S = 0.1
#: Metric points wait up to this long to go in one `log_batch` (each call has a fixed cost); any
#: other record goes at once, with the points before it. The courier looks at the spool this often,
#: and when the writer wakes it (`keras_sync.tracking.records.WAKE_LINE`).
BATCH_S = 2.0
#: Records read ahead from the spool: at most a `log_batch` of one-point records.
READ_RECORDS = r.MAX_BATCH
#: How long ``keras-sync sync-spool`` retries failing requests before it gives up (seconds).
REPLAY_TIMEOUT_S = 600.0


class Delivery:
    """Deliver a spool, then the handed-over records; owns ``pos`` and ``held_done``."""

    def __init__(
        self,
        spool: SpoolDir,
        tracking_uri: str | None = None,
        *,
        header: dict[str, Any] | None = None,
        news: BinaryIO | None = None,
    ):
        header = spool.header() or header or {}
        self.spool, self._news = spool, news
        self.pos: Position = spool.delivered()  # kept here: a full disk may refuse the file
        self.known_run = spool.run()
        self._ahead: list[tuple[Position, dict[str, Any]]] = []  # read, not delivered yet
        self.held: deque[tuple[int, dict[str, Any]]] = deque()  # (number, record) from the pipe
        self.held_done = 0
        self.uri = tracking_uri or header["tracking_uri"]
        self.secrets = secrets_of(self.uri, os.environ)
        self.shown_uri = redact_text(self.uri, self.secrets)
        self.sender = RunSender(
            self.uri,
            header["experiment"],
            header.get("run_name"),
            header.get("job_id"),
            explicit=bool(header.get("explicit")),
            run_id=header.get("run_id"),
        )
        self.sender.run_id = self.known_run.get("run_id")  # checked again before use
        self.reported = self.failing = False
        self.ended = False  # the writer's last record is delivered and nothing follows it
        self.run_ended = False  # the run's end is delivered and no begin since
        self.last_sent_at = self._answer_told = 0.0
        self.give_up: Callable[[], bool] = lambda: False  # True ends a failing request's retries
        self.woken = threading.Event()  # a line from the writer, or its pipe closed
        self.hurry = False  # the writer asked for delivery now
        self.pipe_open = True  # closed: the writer is gone or going (the parent may not be yet)
        self.on_progress: Callable[[], None] = lambda: None
        self.sender.retrier = Retrier(
            is_transient,
            give_up=lambda: self.give_up() or not self.spool.path.is_dir(),
            on_change=self._requests_changed,
        )

    def _next(self) -> list[tuple[Any, dict[str, Any]]]:
        """Records not delivered: the spool's first (read ahead once), then the held ones."""
        if len(self._ahead) < READ_RECORDS:
            start = self._ahead[-1][0] if self._ahead else self.pos
            self._ahead += self.spool.read(start, READ_RECORDS - len(self._ahead))
        if self._ahead:
            return list(self._ahead)
        return [(h, rec) for h, rec in list(self.held)[:READ_RECORDS] if h > self.held_done]

    def deliver_available(self, hold_metrics: bool = False) -> int:
        """Send what is available (``hold_metrics``: not a part batch of points alone)."""
        sent = 0
        try:
            while source := self._next():
                points = [len(rec["d"]) if rec["k"] == r.METRICS else -1 for _, rec in source]
                few_points = min(points) >= 0 and sum(points) < r.MAX_BATCH
                if hold_metrics and not sent and len(source) < READ_RECORDS and few_points:
                    return 0
                # A "begin" picks the run and goes alone: run.json names its run and position
                # before anything after it is sent, so a replay goes to the same run.
                cut = next((i for i, (_, rec) in enumerate(source) if rec["k"] == r.BEGIN), None)
                chunk = source[: cut or 1] if cut is not None else source
                sent += self._send(chunk)
                if isinstance(chunk[-1][0], tuple):
                    del self._ahead[: len(chunk)]
            return sent
        except BaseException:
            self._ahead.clear()  # read again from where delivery stands
            raise

    def _send(self, chunk: list[tuple[Any, dict[str, Any]]]) -> int:
        records = [rec for _, rec in chunk]
        first = records[0]["k"] == r.BEGIN
        begin = chunk[0][0] if first and isinstance(chunk[0][0], tuple) else None
        known = (self.known_run.get("begin"), self.known_run.get("run_id"))
        if begin is not None and known == (list(begin), self.sender.run_id):
            records = [{**records[0], "replayed": True}]  # sent before: to its run, as it is now
        run_before = self.sender.run_id
        # The position moves after each request MLflow took: a later try starts after it.
        done = (lambda i: None) if first else (lambda i: self._move(chunk[i][0], run_before))
        sent = self.sender.send(records, done=done)
        self.last_sent_at = time.monotonic()
        self._move(chunk[-1][0], run_before, begin, force_run=first)
        self.ended = r.is_last_record(records[-1]) and not self.pending()
        for rec in records:  # a report drawn after the run's end leaves it ended
            if rec["k"] in (r.END, r.STOP, r.BEGIN):
                self.run_ended = rec["k"] != r.BEGIN
        return sent

    def _move(
        self, upto: Any, run_before: str | None, begin: Position | None = None, force_run=False
    ) -> None:
        """MLflow has every record up to ``upto`` (a spool position, or a held record's number)."""
        if self.failing and not self.sender.retrier.failing:
            self.report(None)  # before the new position: close() must not see it with the failure
        run_id = self.sender.run_id
        if force_run or (run_id != run_before and self.known_run.get("run_id") != run_id):
            self.known_run = {"run_id": run_id, "experiment_id": self.sender.experiment_id}
            if begin:
                self.known_run["begin"] = list(begin)
            with contextlib.suppress(OSError):
                self.spool.write_json("run.json", self.known_run)
            self._tell({"run": self.known_run})
        if isinstance(upto, tuple):
            if upto <= self.pos:
                return
            self.pos = upto
            with contextlib.suppress(OSError):  # a full disk: told over the pipe
                self.spool.mark_delivered(self.pos)
        else:
            if upto <= self.held_done:
                return
            self.held_done = upto
            while self.held and self.held[0][0] <= upto:
                self.held.popleft()
        self._tell({"pos": list(self.pos), "h": self.held_done})
        self.on_progress()

    def end_open_run(self) -> None:
        """Once all is delivered, end the run of a writer that died with it open (killed) FAILED,
        as a relaunch finds it; a run another process has ended since is left as it is."""
        run_id = self.sender.run_id
        if self.run_ended or self.pending() or run_id is None:
            return
        run = self.sender.get_run(run_id)
        if run is not None and run.info.status == "RUNNING":
            self._send([(self.pos, {"k": r.END, "status": "FAILED"})])

    def pending(self) -> bool:
        """True if spooled or handed-over records are not in MLflow yet."""
        held = any(h > self.held_done for h, _ in list(self.held))
        return held or bool(self.spool.read(self.pos, max_records=1))

    def _tell(self, news: dict[str, Any]) -> None:
        """Tell the writer over its pipe, if any (the files may not be writable)."""
        if self._news is None:
            return
        try:
            self._news.write(json.dumps(news).encode() + b"\n")
            self._news.flush()
        except OSError:  # the writer is gone
            self._news = None

    def _requests_changed(self, retrier: Retrier) -> None:
        """Report the requests' outcome (an answer at most once a second)."""
        answered = retrier.failing and retrier.succeeded_in_a_row > 0
        if answered and time.monotonic() - self._answer_told < 1.0:
            return
        self._answer_told = time.monotonic() if answered else 0.0
        self.report(retrier.last_error if retrier.failing else None)
        self.on_progress()

    def report(self, error: BaseException | None) -> dict[str, Any]:
        """Tell the writer: ok, or why delivery fails (one of `r.CAUSES`)."""
        self.failing, self.reported = error is not None, True
        retrier, remote = self.sender.retrier, r.is_remote(self.uri)
        status: dict[str, Any] = {"ok": error is None}
        if error is not None:
            text = redact_text(f"{type(error).__name__}: {error}", self.secrets)[:500]
            cause = r.REFUSED if remote else r.STORE_FAILING
            if is_transient(error) and remote:  # named from all the requests
                failing_some = retrier.failing and not retrier.unreachable()
                cause = r.FAILING_REQUESTS if failing_some else r.UNREACHABLE
                text = retrier.summary() or text
            if (http := refused_credentials(error)) is not None:  # not the server's HTML page
                cause = r.CREDENTIALS
                text = f"HTTP {http} {'Unauthorized' if http == 401 else 'Forbidden'}"
            status.update(error=text, cause=cause, answered_at=retrier.answered_at)
        self._tell({"status": status})
        return status

    def read_pipe(self, records: BinaryIO) -> None:
        """Take what the writer sends over its pipe (numbered records, wake-ups) until it closes it."""
        for line in records:
            if line == r.WAKE_LINE:
                self.hurry = True
            else:
                try:
                    msg = json.loads(line)
                    number, rec = int(msg["h"]), msg["r"]
                except (ValueError, KeyError, TypeError):
                    continue
                if number > self.held_done and (not self.held or number > self.held[-1][0]):
                    self.held.append((number, rec))
            self.woken.set()
        self.pipe_open = False
        self.woken.set()

    def serve(self, parent_pid: int | None) -> None:
        """Deliver until the writer's last record is delivered, or the parent process is gone."""
        retry_at, backoff, retrier = 0.0, 0.0, self.sender.retrier

        def orphaned() -> bool:
            return parent_pid is not None and os.getppid() != parent_pid

        def orphan_gives_up() -> bool:  # a dead parent's courier delivers while the server answers
            answered = retrier.answered_at
            return orphaned() and (answered is None or time.time() - answered > ORPHAN_PATIENCE_S)

        self.give_up = orphan_gives_up
        while self.spool.path.is_dir():  # removed: all delivered, or cleaned up
            orphan, now = orphaned(), time.monotonic()
            if now >= retry_at or orphan:
                self.woken.clear()  # before reading the spool: a later wake-up is not lost
                hurry, self.hurry = self.hurry, False
                try:
                    batching = not (orphan or hurry) and now - self.last_sent_at < BATCH_S
                    self.deliver_available(hold_metrics=batching)
                    if orphan:
                        self.end_open_run()
                    if (self.failing or not self.reported) and not retrier.failing:
                        self.report(None)
                    backoff = 0.0
                except Exception as e:
                    self.report(e)
                    backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF_S)
                    retry_at = time.monotonic() + backoff
                # A spool whose writer left (gave up, or was killed) and is all delivered goes.
                left = self.ended or (orphan and self.run_ended and not self.pending())
                if left and not self.spool.held("writer"):
                    self.spool.remove()
                if self.ended or orphan:
                    return
            # Until a retry, else until held points are due (or BATCH_S from now), unless woken;
            # once the pipe closed, the parent's end is looked for every ORPHAN_POLL_S.
            batch_due = self.last_sent_at + BATCH_S
            due = retry_at if retry_at > now else batch_due if batch_due > now else now + BATCH_S
            wait = due - time.monotonic()
            self.woken.wait(wait if self.pipe_open else min(wait, ORPHAN_POLL_S))


class _Scrubbed:
    """A text stream that scrubs secrets from what MLflow or SQLAlchemy print here."""

    def __init__(self, stream: Any, secrets: list[str]):
        self._stream, self._secrets = stream, secrets

    def write(self, text: str) -> int:
        return self._stream.write(redact_text(text, self._secrets))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str]) -> int:
    """``courier_main SPOOL_DIR PARENT_PID``; stdin: the handoff line, then the held records."""
    # SIGINT and SIGTERM are for the trainer (Slurm signals every process of a job step).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = int(argv[2])  # not getppid(): the parent may have died before this line
    spool = SpoolDir(argv[1])
    # A reader of our own: finalizing a blocked sys.stdin at exit is a fatal error.
    records_in = os.fdopen(os.dup(0), "rb")
    handoff = json.loads(records_in.readline() or b"{}")
    news = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what MLflow prints must not mix with the news
    spool.lock("deliver", wait=True)  # one courier per spool (a crashed job's may be finishing)
    delivery = Delivery(spool, handoff.get("uri"), header=handoff.get("header"), news=news)
    threading.Thread(target=delivery.read_pipe, args=(records_in,), daemon=True).start()
    sys.stderr = sys.stdout = _Scrubbed(sys.stderr, delivery.secrets)
    with contextlib.suppress(Exception):  # import MLflow before the first batch arrives
        warm_up(handoff.get("uri"))
    try:
        delivery.serve(parent)
    except OSError:
        if spool.path.is_dir():
            raise
    return 0  # the spool directory went away under us: nothing left to deliver


def replay_spool(
    spool_path: str | os.PathLike[str],
    tracking_uri: str | None = None,
    *,
    timeout_s: float = REPLAY_TIMEOUT_S,
    progress: Any = None,
) -> int:
    """Deliver what a spool directory holds; return the metric points sent.

    Idempotent (nothing is sent twice); a fully delivered spool is removed.

    Args:
        spool_path: the spool directory (or a file in it).
        tracking_uri: default: the spool's, kept without credentials.
        timeout_s: how long failing requests are retried (0: once); a refusal stops at once.
        progress: ``progress(sent, total, failures)`` after each request: points sent, points the
            spool held, what failed in words (or "").
    """
    path = Path(spool_path)
    path = path.parent if path.is_file() else path
    spool = SpoolDir(path)
    if not path.is_dir() or spool.header() is None:
        what = "which does not exist" if not path.is_dir() else "which holds no header.json"
        raise TrackingError(
            f"Invalid value for argument `spool_path`. Received: spool_path={str(spool_path)!r}, "
            f"{what}. Expected a keras-sync spool directory (a delivered one is removed)."
        )
    if not spool.lock("writer") or not spool.lock("deliver"):
        spool.unlock("writer")
        raise TrackingError(
            f"Spool {path} is in use by a running keras-sync writer, which delivers it itself; "
            "replay it after that process has ended."
        )
    delivery = Delivery(spool, tracking_uri)
    deadline = time.monotonic() + max(0.0, timeout_s)
    delivery.give_up = lambda: time.monotonic() >= deadline
    spooled = spool.read(delivery.pos, max_records=10**9)
    total = sum(len(rec["d"]) for _, rec in spooled if rec["k"] == r.METRICS)
    sender = delivery.sender
    if progress is not None:
        delivery.on_progress = lambda: progress(sender.points_sent, total, sender.retrier.summary())
    try:
        sent = delivery.deliver_available()
        delivery.end_open_run()  # no writer holds the spool: one that left its run open was killed
    except Exception as e:
        status = delivery.report(e)
        fix = "run `keras-sync sync-spool` again once MLflow takes them (a longer --timeout waits)"
        if status["cause"] == r.CREDENTIALS:
            fix = (
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN), then run `keras-sync sync-spool` again"
            )
        raise TrackingError(
            f"Could not deliver spool {path}: {r.why_failing(status, delivery.shown_uri)}; "
            f"{total - sender.points_sent} of {total} metric point(s) are left in it; {fix}."
        ) from None
    finally:
        spool.unlock("deliver")
        spool.unlock("writer")
    if not delivery.pending():  # not spool.pending(): a full disk may keep the old position
        spool.remove()
    return sent
