"""Records a writer could not spool (its disk is full): kept in memory and handed to the courier.

The spool (`keras_sync.tracking.spool`) is the one interface between a writer and its courier while
its disk takes the records. When it refuses one (disk full, quota, I/O error), the writer
stops spooling for good: that record and every later one are kept here, in order, bounded by
`MAX_HELD_BYTES`, and written to a pipe the courier reads (``{"h": number, "r": record}`` per
line). The courier delivers them after the whole spool and answers over a second pipe where it
stands, since the files that record it may not be writable either (``{"pos": [segment,
offset], "h": number}``, ``{"status": ...}``, ``{"run": ...}``). A record leaves memory once
the courier says MLflow has it; a restarted courier is handed every record not acknowledged.

What is still held when the writer closes is written to the spool if the disk has room again,
else lost: the writer says which steps, one line.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from typing import Any

from keras_sync.tracking.records import ALWAYS_KEPT, BEGIN, METRICS, STOP

#: Memory for records the spool could not take; beyond it, metric points are dropped (and counted).
MAX_HELD_BYTES = 64 * 1024 * 1024


def step_ranges(steps: list[int]) -> str:
    """Steps as ranges, for a line a person reads.

    >>> step_ranges([184, 185, 186, 190, 3])
    '3, 184-186, 190'
    """
    out: list[str] = []
    ordered = sorted(set(steps))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)


class Handover:
    """The held records of one writer and its pipes to the current courier."""

    def __init__(self, max_bytes: int = MAX_HELD_BYTES):
        self.max_bytes = max_bytes
        self._held: deque[tuple[int, dict[str, Any], int]] = deque()
        self.last = 0  # number of the newest held record
        self.bytes = 0
        self.dropped: list[dict[str, Any]] = []  # records over the memory bound: lost
        self.news: dict[str, Any] = {}
        self._out: int | None = None
        self._buf = bytearray()
        self._reader: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._held)

    # -- the writer's thread --
    def hold(self, rec: dict[str, Any]) -> None:
        size = len(json.dumps(rec)) + 32
        if self.bytes + size > self.max_bytes and rec["k"] not in ALWAYS_KEPT:
            self.dropped.append(rec)
            return
        self.last += 1
        self._held.append((self.last, rec, size))
        self.bytes += size
        if self._out is not None:
            self._buf += self._line(self.last, rec)

    @staticmethod
    def _line(number: int, rec: dict[str, Any]) -> bytes:
        return json.dumps({"h": number, "r": rec}, separators=(",", ":")).encode() + b"\n"

    def acked(self) -> int:
        return int(self.news.get("h", 0))

    def pump(self) -> None:
        """Forget what the courier acknowledged; write what the pipe takes now (never blocks)."""
        acked = self.acked()
        while self._held and self._held[0][0] <= acked:
            self.bytes -= self._held.popleft()[2]
        if self._out is None or not self._buf:
            return
        try:
            n = os.write(self._out, self._buf)
            del self._buf[:n]
        except BlockingIOError:
            pass
        except OSError:  # the courier is gone: a new one is handed everything not acknowledged
            self._buf.clear()

    def connect(self) -> tuple[int, int]:
        """Pipes for a new courier: returns its ends (records in, news out); the writer keeps the others."""
        self.disconnect()
        records_in, self_out = os.pipe()
        self_in, news_out = os.pipe()
        os.set_blocking(self_out, False)
        self._out = self_out
        self._buf = bytearray(b"".join(self._line(n, rec) for n, rec, _ in self._held))
        self._reader = threading.Thread(
            target=self._read_news, args=(self_in,), name="keras-sync-courier-news", daemon=True
        )
        self._reader.start()
        return records_in, news_out

    def settle(self, timeout_s: float = 2.0) -> None:
        """After the courier exited: wait until its last news is read (its pipe is at its end)."""
        if self._reader is not None:
            self._reader.join(timeout_s)

    def disconnect(self) -> None:
        if self._out is not None:
            try:
                os.close(self._out)
            except OSError:
                pass
            self._out = None
        self._buf.clear()

    def _read_news(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for line in fh:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                news = dict(self.news)
                # A restarted courier starts from what the files say: never let the position go back.
                if "pos" in msg:
                    news["pos"] = max(tuple(msg["pos"]), tuple(news.get("pos", (0, 0))))
                if "h" in msg:
                    news["h"] = max(int(msg["h"]), int(news.get("h", 0)))
                for key in ("status", "run"):
                    if key in msg:
                        news[key] = msg[key]
                self.news = news

    # -- what is left --
    def unacknowledged(self) -> list[dict[str, Any]]:
        acked = self.acked()
        return [rec for n, rec, _ in list(self._held) if n > acked]

    def lost_steps(self, records: list[dict[str, Any]]) -> tuple[list[int], int]:
        """The metric steps of ``records`` and of the records dropped over the bound; and how many others."""
        both = list(records) + self.dropped
        steps = [rec["s"] for rec in both if rec["k"] == METRICS]
        others = sum(rec["k"] not in (METRICS, BEGIN, STOP) for rec in both)
        return steps, others
