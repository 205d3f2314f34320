"""The courier: a child process that delivers one spool (`keras_sync.tracking.spool`) to MLflow.

Why a process and not a thread: MLflow's SQL store and HTTP client spend Python time on every
metric point; in a thread of the training process that time holds the GIL, and the training loop
waits for it after every step. The courier runs at normal priority: at a lower one, a machine
whose cores are busy with other work starves it until the training ends.

It talks to the training process through the spool directory only: it polls for new records,
sends them in batches with `MlflowClient.log_batch`, writes ``delivered``, ``run.json`` and
``status.json`` and deletes delivered segments. One courier serves its writer for the writer's
whole life (every `fit` of a `Sync`). It ends when it has delivered the writer's last record
(`keras_sync.tracking.records.is_last_record`), or, once its parent has died, after one last attempt to
deliver what is left while the server answers (a restarted job or ``keras-sync sync-spool``
delivers the rest); a spool whose run had ended and was all delivered is then removed. Each
MLflow request that fails is retried on its own (`keras_sync.tracking.retry`), so a server that
fails some requests still gets the others.

Run as ``python -m keras_sync.tracking.courier_main SPOOL_DIR PARENT_PID`` with the tracking URI (credentials
included) and the spool's header on its stdin, never on the command line or on disk.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from keras_sync.tracking.deliver import RunSender, is_transient, refused_credentials
from keras_sync.tracking.records import (
    BEGIN,
    CREDENTIALS,
    END,
    FAILING_REQUESTS,
    MAX_BATCH,
    METRICS,
    REFUSED,
    STOP,
    STORE_FAILING,
    UNREACHABLE,
    is_last_record,
    is_remote,
)
from keras_sync.tracking.redact import redact_text, secrets_of
from keras_sync.tracking.retry import Retrier
from keras_sync.tracking.spool import Position, SpoolDir

#: Longest wait between two delivery attempts after MLflow refused a record (seconds); a request
#: that fails for a while (no answer, HTTP 503) is retried on its own (`keras_sync.tracking.retry`).
MAX_BACKOFF_S = 30.0
#: A courier whose process died keeps delivering while the server answered within this long (seconds).
ORPHAN_PATIENCE_S = 30.0
#: How often the courier looks for new records; what it finds goes in one batch.
POLL_S = 0.1
#: Metric points wait up to this long to go in one `log_batch` (each call has a fixed cost: sent one
#: step at a time, the calls cost as much as the values).
#: Any other record (a run's start or end, params, a report) goes at once, with the points before it.
BATCH_S = 1.0
#: A held report (`keras_sync.tracking.deliver.RunSender.hold_reports`) is drawn once no record came for
#: this long: the fit that logged it ended and no other runs (a loop of fits draws only the last one).
REPORT_QUIET_S = 2.0
#: ... and at the latest after this long held: the picture of a long loop of fits is not older than this.
REPORT_MAX_HOLD_S = 120.0
#: Records read from the spool (or the handed-over records) per pass of `Delivery.deliver_available`.
READ_RECORDS = 200
#: What the courier runs as (``python -m``): its own module, which the package does not import.
ENTRY_MODULE = "keras_sync.tracking.courier_main"
PIPE_ENV = "KERAS_SYNC_COURIER_PIPES"


def spawn(
    spool: SpoolDir,
    tracking_uri: str,
    header: dict[str, Any] | None = None,
    pipe_fds: tuple[int, int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a courier for ``spool`` (called by the writer, which restarts it if it dies).

    ``header``: the spool's header, for a spool whose disk refused even that. ``pipe_fds``:
    (records in, news out), the pipes of a writer whose spool cannot be written (`serve_pipes`).
    """
    env = dict(os.environ)
    if pipe_fds is not None:
        env[PIPE_ENV] = f"{pipe_fds[0]},{pipe_fds[1]}"
    # The child must import this very keras_sync, installed or not.
    root = str(
        Path(__file__).resolve().parents[2]
    )  # keras_sync/tracking/courier.py -> the directory holding keras_sync
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", ENTRY_MODULE, str(spool.path), str(os.getpid())],
        stdin=subprocess.PIPE,
        env=env,
        close_fds=True,
        pass_fds=pipe_fds or (),
    )
    # On stdin, not in the environment or on the command line: `ps` shows the command line, and Linux
    # takes at most 128 KiB per argument or variable (a long run name in the header failed with E2BIG).
    # From a thread: more than a pipe's 64 KiB waits until the courier has started and reads it.
    handoff = json.dumps({"uri": tracking_uri, "header": header}).encode()
    threading.Thread(
        target=_hand_over, args=(proc.stdin, handoff), name="keras-sync-courier-stdin", daemon=True
    ).start()
    return proc


def _hand_over(stdin: BinaryIO, data: bytes) -> None:
    try:
        stdin.write(data)
    except OSError:
        pass  # the courier died before reading it: the writer sees it gone and starts another
    finally:
        try:
            stdin.close()
        except OSError:
            pass


class Launcher:
    """Starts couriers from a thread at the priority of the thread that created it (the training thread).

    The writer's spooling thread runs niced, so that moving records to a file never competes with
    training; a child inherits the nice value of the thread that forks it, and a process may not
    lower its own. This thread is made by the writer's ``start()``, on the caller's thread, before
    anything is niced; the spooling thread asks it to fork.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        threading.Thread(
            target=self._serve, name="keras-sync-courier-launcher", daemon=True
        ).start()

    def _serve(self) -> None:
        while True:
            fn, box, done = self._requests.get()
            try:
                box.append((True, fn()))
            except BaseException as e:
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the launcher's thread; its result, or its exception raised here."""
        box: list[Any] = []
        done = threading.Event()
        self._requests.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


class Delivery:
    """Deliver a spool in order; used by the courier process and by ``keras-sync sync-spool``."""

    def __init__(
        self,
        spool: SpoolDir,
        tracking_uri: str | None = None,
        *,
        max_batch: int = MAX_BATCH,
        header: dict[str, Any] | None = None,
        news: BinaryIO | None = None,
    ):
        header = spool.header() or header
        if header is None:
            raise ValueError(f"{spool.path} has no header.json")
        self.spool = spool
        # Where delivery stands, kept here: on a full disk the files that record it cannot be written.
        self.pos: Position = spool.delivered()
        self.known_run = spool.run()
        #: Records the writer could not spool (its disk is full), handed over its pipe: (number, record).
        self.held: deque[tuple[int, dict[str, Any]]] = deque()
        self.held_done = 0  # every held record numbered up to this one is in MLflow
        self._news = news
        self.reported = False
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
        # Found or created by an earlier courier of this spool (checked again before use).
        self.sender.run_id = self.known_run.get("run_id")
        held = spool.held_report()  # a report an earlier courier of this spool held, not drawn yet
        if isinstance(held, dict) and held.get("run_id") and isinstance(held.get("rec"), dict):
            self.sender.held_report = (held["run_id"], held["rec"])
        self.sender.on_held = lambda h: spool.set_held_report(
            None if h is None else {"run_id": h[0], "rec": h[1]}
        )
        self.last_record_at = (
            time.monotonic()
        )  # when records were last sent (a held report waits for quiet)
        self.max_batch = max_batch
        self.ended = False  # the writer's last record is delivered and nothing follows it
        self.last_sent_at = 0.0  # monotonic time of the last call to MLflow (`BATCH_S`)
        self.run_ended = (
            False  # the run's end is delivered and no begin since (the writer may go on)
        )
        self.failing = False  # the status file says the last attempt failed
        #: Asked between tries of a failing request: True ends the retries (the failure is raised).
        self.give_up: Callable[[], bool] = lambda: False
        #: Called after each request that failed or delivered metric points (``keras-sync sync-spool``'s progress).
        self.on_progress: Callable[[], None] | None = None
        self._answer_told = (
            0.0  # monotonic time the status last told of an answer while requests fail
        )
        self.sender.retrier = Retrier(
            is_transient,
            give_up=lambda: self.give_up() or not self.spool.path.is_dir(),
            on_change=self._requests_changed,
        )

    def deliver_available(self, hold_metrics: bool = False) -> int:
        """Send everything spooled so far; return the metric points sent. Raises what MLflow raised.

        ``hold_metrics``: when only metric points are waiting, fewer than a batch, send nothing yet.
        """
        sent = 0
        while True:
            chunk: list[tuple[Any, dict[str, Any]]] = []
            points = 0
            # The spool first; what the writer could not spool comes after all of it.
            source: list[tuple[Any, dict[str, Any]]] = list(
                self.spool.read(self.pos, max_records=READ_RECORDS)
            )
            if not source:
                source = [
                    (h, rec) for h, rec in list(self.held)[:READ_RECORDS] if h > self.held_done
                ]
            if (
                hold_metrics
                and not sent
                and len(source) < READ_RECORDS
                and all(rec["k"] == METRICS for _, rec in source)
                and sum(len(rec["d"]) for _, rec in source) < self.max_batch
            ):
                return 0
            for pos, rec in source:
                n = len(rec["d"]) if rec["k"] == METRICS else 0
                # A "begin" (which picks the run) goes alone, and run.json names its run and its
                # position before anything after it is sent: a courier killed between sending and
                # moving the delivered position replays records into the run they went to.
                if chunk and (
                    points + n > self.max_batch or rec["k"] == BEGIN or chunk[0][1]["k"] == BEGIN
                ):
                    break
                chunk.append((pos, rec))
                points += n
            if not chunk:
                return sent
            self.last_record_at = time.monotonic()
            records = [rec for _, rec in chunk]
            spooled = isinstance(chunk[-1][0], tuple)
            begin = chunk[0][0] if records[0]["k"] == BEGIN and spooled else None
            if begin is not None:
                known = self.known_run
                if known.get("begin") == list(begin) and known.get("run_id") == self.sender.run_id:
                    records = [
                        {**records[0], "replayed": True}
                    ]  # delivered before: its run, as it is now
            run_before = self.sender.run_id
            # The position moves after each request MLflow took, not only after the whole chunk: what a
            # later try (a restarted courier, sync-spool) sends again starts after the last request that got through.
            done = (
                None
                if begin is not None or records[0]["k"] == BEGIN
                else (lambda i: self._move(chunk[i][0], run_before, None))
            )
            sent += self.sender.send(records, done=done)
            self.last_sent_at = time.monotonic()
            self._move(chunk[-1][0], run_before, begin, force_run=records[0]["k"] == BEGIN)
            self.ended = is_last_record(chunk[-1][1]) and not self.pending()
            for _, rec in chunk:  # a report drawn after the run's end leaves it ended
                if rec["k"] in (END, STOP, BEGIN):
                    self.run_ended = rec["k"] != BEGIN

    def _move(
        self, upto: Any, run_before: str | None, begin: Position | None, force_run: bool = False
    ) -> None:
        """MLflow has every record up to ``upto`` (a spool position, or a held record's number): say so."""
        if self.failing and not self.sender.retrier.failing:
            # "ok" before the new position: a writer that sees delivery move must not read the
            # old failure with it (close() would give up on a server that is back, run left RUNNING).
            self.report(None)
        if (
            self.sender.run_id != run_before
            and self.known_run.get("run_id") != self.sender.run_id
            or force_run
        ):
            self._set_run(begin)
        if isinstance(upto, tuple):
            if upto <= self.pos:
                return
            self.pos = upto
            try:
                self.spool.mark_delivered(self.pos)
            except OSError:  # a full disk: the position is kept here and told over the pipe
                pass
        else:
            if upto <= self.held_done:
                return
            self.held_done = upto
            while self.held and self.held[0][0] <= self.held_done:
                self.held.popleft()
        self._tell({"pos": list(self.pos), "h": self.held_done})
        if self.on_progress is not None:
            self.on_progress()

    def pending(self) -> bool:
        """True if spooled or handed-over records are not in MLflow yet."""
        return bool(self.spool.read(self.pos, max_records=1)) or any(
            h > self.held_done for h, _ in list(self.held)
        )

    def take(self, number: int, record: dict[str, Any]) -> None:
        """A record the writer could not spool, numbered in its order (a restarted courier gets them again)."""
        if number > self.held_done and (not self.held or number > self.held[-1][0]):
            self.held.append((number, record))

    def _tell(self, news: dict[str, Any]) -> None:
        """Tell the writer over its pipe (when it has one): the files may not be writable."""
        if self._news is None:
            return
        try:
            self._news.write(json.dumps(news).encode() + b"\n")
            self._news.flush()
        except OSError:  # the writer is gone
            self._news = None

    def _set_run(self, begin: Position | None) -> None:
        run_id, exp_id = self.sender.run_id, self.sender.experiment_id
        self.known_run = {
            "run_id": run_id,
            "experiment_id": exp_id,
            **({"begin": list(begin)} if begin else {}),
        }
        try:
            self.spool.set_run(str(run_id), exp_id, begin)
        except OSError:
            pass
        self._tell({"run": self.known_run})

    def _requests_changed(self, retrier: Retrier) -> None:
        """A request failed or was answered while others fail, or the server is healthy again: the
        status says what happened (an answer at most once a second: the writer waits while MLflow answers)."""
        answered = retrier.failing and retrier.succeeded_in_a_row > 0
        if answered and time.monotonic() - self._answer_told < 1.0:
            return
        self._answer_told = time.monotonic() if answered else 0.0
        self.report(retrier.last_error if retrier.failing else None)
        if self.on_progress is not None:
            self.on_progress()

    def report(self, error: BaseException | None, since: float | None = None) -> None:
        self.failing = error is not None
        self.reported = True
        retrier = self.sender.retrier
        if error is None:
            status: dict[str, Any] = {"ok": True, "at": time.time()}
        else:
            transient = is_transient(error)
            local = not is_remote(self.uri)
            text = redact_text(f"{type(error).__name__}: {error}", self.secrets)[:500]
            cause = STORE_FAILING if local else REFUSED
            if (
                transient and not local
            ):  # named from what happened to the requests, not from the last one
                cause = (
                    UNREACHABLE
                    if retrier.unreachable() or not retrier.failing
                    else FAILING_REQUESTS
                )
                text = retrier.summary() or text
            http = refused_credentials(error)
            if (
                http is not None
            ):  # the status alone: the body is the server's (or its proxy's) HTML page
                cause, text = (
                    CREDENTIALS,
                    f"HTTP {http} {'Unauthorized' if http == 401 else 'Forbidden'}",
                )
            status = {
                "ok": False,
                "at": time.time(),
                "since": since or retrier.failing_since or time.time(),
                "error": text,
                "cause": cause,
                "uri": self.shown_uri,
                "answered_at": retrier.answered_at,
            }
        try:
            self.spool.set_status(status)
        except OSError:
            pass
        self._tell({"status": status})

    def read_pipe(self, records: BinaryIO) -> None:
        """Take the records a writer hands over its pipe until it closes it (a thread of the courier)."""
        for line in records:
            try:
                msg = json.loads(line)
                self.take(int(msg["h"]), msg["r"])
            except (ValueError, KeyError, TypeError):
                continue

    def serve(self, parent_pid: int | None) -> None:
        """Deliver until the run's end is delivered, or the parent process is gone."""
        retry_at, backoff, failing_since = 0.0, 0.0, None
        held_since: float | None = None  # when the report held now was first seen held
        retrier = self.sender.retrier

        def orphan_gives_up() -> bool:  # a dead parent's courier delivers while the server answers
            answered = retrier.answered_at
            return (
                parent_pid is not None
                and os.getppid() != parent_pid
                and (answered is None or time.time() - answered > ORPHAN_PATIENCE_S)
            )

        self.give_up = orphan_gives_up
        while (
            self.spool.path.is_dir()
        ):  # removed: its writer delivered it all, or it was cleaned up
            orphan = parent_pid is not None and os.getppid() != parent_pid
            if time.monotonic() >= retry_at or orphan:
                try:
                    self.deliver_available(
                        hold_metrics=not orphan and time.monotonic() - self.last_sent_at < BATCH_S
                    )
                    now = time.monotonic()
                    if self.sender.held_report is None:
                        held_since = None
                    elif held_since is None:
                        held_since = now
                    if held_since is not None and (
                        self.ended
                        or orphan
                        or now - held_since >= REPORT_MAX_HOLD_S
                        or (now - self.last_record_at >= REPORT_QUIET_S and not self.pending())
                    ):
                        self.sender.release_report()
                    if (failing_since is not None or not self.reported) and not retrier.failing:
                        self.report(None)
                    backoff, failing_since = 0.0, None
                except Exception as e:
                    failing_since = failing_since or time.time()
                    self.report(e, failing_since)
                    backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF_S)
                    retry_at = time.monotonic() + backoff
                if self.sender.held_report is not None:
                    pass  # not drawn yet (MLflow away): the spool keeps it
                elif self.ended and not self.spool.held("writer"):
                    self.spool.remove()  # its writer gave up waiting and left it: nothing is left to keep
                elif (
                    orphan
                    and self.run_ended
                    and not self.pending()
                    and not self.spool.held("writer")
                ):
                    # Its process was killed without atexit (Ray Train V2's ray.kill) after MLflow had
                    # it all (Sync.fit ends the run and waits for delivery): nothing left to keep.
                    self.spool.remove()
                if self.ended or orphan:
                    return
            time.sleep(POLL_S)


class _Scrubbed:
    """A text stream that scrubs secrets from what MLflow or SQLAlchemy print in this process."""

    def __init__(self, stream: Any, secrets: list[str]):
        self._stream, self._secrets = stream, secrets

    def write(self, text: str) -> int:
        return self._stream.write(redact_text(text, self._secrets))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str]) -> int:
    # Ctrl-C and SIGTERM are for the training process, which ends us by closing the run: Slurm's
    # `scancel --signal=TERM` and `--signal=TERM@60` signal every process of a job step (this one
    # too) while the trainer saves its backup and still has records for us to deliver.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = int(argv[2])  # not getppid(): the parent may have died before this line
    spool = SpoolDir(argv[1])
    handoff = json.loads(sys.stdin.buffer.read() or b"{}")  # written by `spawn`
    uri, header = handoff.get("uri"), handoff.get("header")
    pipes = os.environ.pop(PIPE_ENV, None)
    records_in, news_out = (int(fd) for fd in pipes.split(",")) if pipes else (None, None)
    spool.wait_lock("deliver")  # one courier per spool (a crashed job's may still be finishing)
    news = os.fdopen(news_out, "wb") if news_out is not None else None
    delivery = Delivery(spool, uri, header=header, news=news)
    delivery.sender.hold_reports = True
    if records_in is not None:
        threading.Thread(
            target=delivery.read_pipe, args=(os.fdopen(records_in, "rb"),), daemon=True
        ).start()
    sys.stderr = sys.stdout = _Scrubbed(sys.stderr, delivery.secrets)
    try:  # import MLflow before the first batch arrives; the store is opened (made) by the first delivery:
        # a writer started early by `keras_sync.load` may be closed unused (a load that fails), and
        # then no store is left behind.
        from keras_sync.tracking.sqlite_store import warm_up

        warm_up(uri)
    except Exception:
        pass
    try:
        delivery.serve(parent)
    except OSError:
        if spool.path.is_dir():
            raise
    return 0  # the spool directory went away under us: nothing left to deliver
