"""The courier: a child process that delivers an `MlflowWriter`'s spool to MLflow.

Why a process and not a thread: MLflow's SQL store spends ~100 us of Python per metric point
(SQLAlchemy). In a thread of the training process that time holds the GIL, and the training
loop waits for it after every step: measured here (2 simulated replicas, metrics every step),
fit took 1.17-1.34x as long with delivery in a thread, about 1.0x with the same delivery in a
child process (benchmarks/bench_sync_metrics.py). The training process now only appends to
the spool; this process reads it, sends batches with `MlflowClient.log_batch`, retries with
backoff while the server is away, and moves the spool's delivered offset.

Protocol, one JSON object per line.
Parent -> courier (stdin): first the settings; then ``{"go": offset, "urgent": bool}`` (the
spool has records up to ``offset``; urgent: a flush is waiting, deliver now),
``{"stop": true}`` (deliver everything, then exit), ``{"abandon": true}`` (exit now).
End of input without a stop means the parent died: exit at once, the spool keeps the rest for
the restarted job or `keras-sync sync-spool`.
Courier -> parent (stdout): ``{"run": id, "fresh": bool}``, ``{"delivered": offset}``,
``{"log": level, "msg": text}`` (already scrubbed of secrets).

Run as ``python -m keras_sync._courier``; the parent side is `Courier`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from keras_sync._spool import Deliverer, SpoolFile, is_transient
from keras_sync.redact import redact_text, secrets_of

#: Longest wait between two delivery attempts while MLflow is unreachable (seconds).
MAX_BACKOFF_S = 30.0


def _line(message: dict[str, Any]) -> bytes:
    """One protocol message: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


# ---- the parent's side ----

class Courier:
    """Start and talk to one courier process; ``on_message`` gets its messages, then None at its end.

    ``on_message`` runs in a reader thread of this process.
    """

    def __init__(self, settings: dict[str, Any], on_message: Callable[[dict[str, Any] | None], None]):
        env = dict(os.environ)
        # The child must import this very keras_sync, installed or not.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_sync._courier"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, close_fds=True)
        self._on_message = on_message
        self._send_lock = threading.Lock()
        self.send(settings)
        self._reader = threading.Thread(target=self._read, name="keras-sync-courier-reader", daemon=True)
        self._reader.start()

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False if the courier has gone."""
        data = _line(message)
        with self._send_lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
                return True
            except (OSError, ValueError):  # broken pipe, or stdin already closed
                return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self, wait_s: float) -> None:
        """Close its input (it exits once it has nothing to finish), then stop it after ``wait_s``."""
        with self._send_lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            # Inside one MLflow call (bounded by its request timeout): the batch is re-sent later at
            # worst, and MLflow's SQL stores drop a point identical to one they have.
            self.proc.terminate()
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(2.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                self._on_message(msg)
        finally:
            self.proc.stdout.close()
            self._on_message(None)


# ---- the courier process ----

class _Inbox:
    """Messages from the parent on a file descriptor, waited for with a timeout."""

    def __init__(self, fd: int):
        self.fd, self.eof, self._buf = fd, False, b""

    def wait(self, timeout_s: float | None) -> list[dict[str, Any]]:
        if self.eof:
            if timeout_s:
                time.sleep(timeout_s)
            return []
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if ready:
            data = os.read(self.fd, 1 << 16)
            self.eof = not data
            self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


class _Delivery:
    """The courier's loop: deliver what the parent spooled, in order, with backoff on failure."""

    def __init__(self, settings: dict[str, Any], out: Any, inbox: _Inbox):
        self.s, self.out, self.inbox = settings, out, inbox
        self.spool = SpoolFile(settings["spool_path"])
        self.deliverer = Deliverer(settings["tracking_uri"], settings["experiment"], settings["run_name"],
                                   settings["job_id"], run_id=settings.get("run_id"),
                                   request_timeout_s=int(settings.get("request_timeout_s", 5)))
        self.secrets = secrets_of(settings["tracking_uri"], os.environ)
        self.shown_uri = redact_text(settings["tracking_uri"], self.secrets)
        self.delivered = max(int(settings["delivered"]), self.spool.delivered_offset())
        self.target = int(settings["spooled"])
        self.resume_from = int(settings["resume_from"])
        self.max_batch = int(settings["max_batch"])
        self.interval = float(settings["flush_interval_s"])
        self.stop = self.abandon = self.urgent = False

    def send(self, **msg: Any) -> None:
        self.out.write(_line(msg))
        self.out.flush()

    def log(self, level: int, msg: str) -> None:
        self.send(log=level, msg=redact_text(msg, self.secrets))

    def take(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            if "go" in m:
                self.target = max(self.target, int(m["go"]))
                self.urgent |= bool(m.get("urgent"))
            elif m.get("stop"):
                self.stop = self.urgent = True
            elif m.get("abandon"):
                self.abandon = True
        if self.inbox.eof and not self.stop:
            self.abandon = True  # the parent died: what is left stays in the spool

    def run(self) -> None:
        try:  # import MLflow before the first batch arrives
            self.deliverer.client()
        except Exception:  # noqa: BLE001 - the first delivery reports it
            pass
        deliver_at, backoff, failures = 0.0, 0.0, 0
        while not self.abandon:
            behind = self.delivered < self.target
            if self.stop and not behind:
                return
            timeout = max(0.0, deliver_at - time.monotonic()) if behind else None
            if behind and self.urgent and not failures:
                timeout = 0.0
            self.take(self.inbox.wait(timeout))
            if self.abandon:
                return
            if self.delivered >= self.target or not ((self.urgent and not failures) or time.monotonic() >= deliver_at):
                continue
            self.urgent = False
            try:
                self.deliver()
                if failures:
                    self.log(logging.INFO, f"MLflow at {self.shown_uri} reachable again; spool backlog delivered.")
                backoff, failures = 0.0, 0
                deliver_at = time.monotonic() + self.interval
            except Exception as e:  # noqa: BLE001 - anything: keep the data, retry later
                failures += 1
                backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF_S)
                deliver_at = time.monotonic() + backoff
                kind = "unreachable" if is_transient(e) else "refusing records"
                self.log(logging.WARNING if failures == 1 else logging.DEBUG,
                         f"MLflow at {self.shown_uri} is {kind} ({type(e).__name__}: {e}"[:600]
                         + f"); records are kept in {self.spool.path}, retrying in the background.")

    def deliver(self) -> None:
        run_id, fresh = self.deliverer.ensure_run()
        if fresh:
            self.send(run=run_id, fresh=True)
        while not self.abandon:
            chunk, points = [], 0
            for end, rec in self.spool.read(self.delivered, max_records=100):
                n = len(rec["d"]) if rec["k"] == "m" else 0
                if chunk and points + n > self.max_batch:
                    break
                chunk.append((end, rec))
                points += n
            if not chunk:
                return
            # An earlier process's "end" would mark the run finished while this one still logs.
            self.deliverer.send([rec for end, rec in chunk if not (rec["k"] == "end" and end <= self.resume_from)])
            self.spool.mark_delivered(chunk[-1][0])
            self.delivered = chunk[-1][0]
            self.send(delivered=self.delivered)
            self.take(self.inbox.wait(0.0))


class _Scrubbed:
    """A text stream that scrubs secrets from what MLflow or SQLAlchemy print in this process."""

    def __init__(self, stream: Any, secrets: list[str]):
        self._stream, self._secrets = stream, secrets

    def write(self, text: str) -> int:
        return self._stream.write(redact_text(text, self._secrets))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _yield_cpu() -> None:
    """Run only on CPU time the training leaves idle (Linux SCHED_IDLE; else the lowest nice).

    Measured here with 2 replicas on 2 cores: at nice 10 the courier's ~1 ms of CPU per logged
    step still cost the training a few percent. Lowering one's own priority needs no privilege.
    A training that keeps every core busy delays delivery (to the bounded flush at train end);
    it never loses a point: the spool holds them.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which then stops us
    _yield_cpu()
    # The protocol owns the real stdout; anything printed goes to stderr, scrubbed.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inbox = _Inbox(sys.stdin.fileno())
    first = inbox.wait(None)
    while not first and not inbox.eof:
        first = inbox.wait(None)
    if not first:
        return 0
    settings = first[0]
    delivery = _Delivery(settings, out, inbox)
    sys.stderr = sys.stdout = _Scrubbed(sys.stderr, delivery.secrets)
    delivery.take(first[1:])
    delivery.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
