"""The spool: one run's directory of records, the only interface between a writer and its courier.

``header.json``, ``NNNNNNNN.jsonl`` segments of records (`keras_sync.tracking.records`),
``delivered`` (``"<segment> <offset>"``: every record before it is in MLflow; it moves only after
MLflow took a batch), ``run.json``, ``writer.lock`` and ``deliver.lock`` (flocks), ``reserve``
(room kept for a run's end).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

#: A writer starts a new segment once the current one is this big; delivered segments are deleted.
SEGMENT_BYTES = 256 * 1024
_SEGMENT = re.compile(r"^(\d{8})\.jsonl$")

Position = tuple[int, int]  # (segment number, byte offset in it)


class SpoolFull(OSError):
    """A refused write: ``done`` records are in whole, up to ``pos``; ``reason``: the OS's words."""

    def __init__(self, error: OSError, done: int, pos: Position):
        self.reason = error.strerror or str(error)
        super().__init__(error.errno, self.reason)
        self.done, self.pos = done, pos


class SpoolDir:
    """One run's spool directory: segments written by the writer, read and pruned by the courier."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._locks: dict[str, Any] = {}
        self._fh: Any = None
        self._segment = 0

    def lock(self, role: str, wait: bool = False) -> bool:
        """Take ``writer.lock`` or ``deliver.lock``; False if a live process holds it (``wait``: wait)."""
        if role in self._locks:
            return True
        self.path.mkdir(parents=True, exist_ok=True)
        fh = open(self.path / f"{role}.lock", "ab")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            fh.close()
            return False
        self._locks[role] = fh
        return True

    def held(self, role: str) -> bool:
        """True if another process holds the lock ``role`` now."""
        if not (self.path / f"{role}.lock").exists():
            return False
        with open(self.path / f"{role}.lock", "ab") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    def unlock(self, role: str) -> None:
        fh = self._locks.pop(role, None)
        if fh is not None:
            fh.close()

    def read_json(self, name: str) -> Any:
        """The JSON file ``name``; None if absent or half-written."""
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def write_json(self, name: str, value: Any) -> None:
        """Replace ``name`` atomically; a full disk leaves no empty file."""
        path = self.path / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(value if isinstance(value, str) else json.dumps(value))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def write_header(self, header: dict[str, Any]) -> None:
        if self.header() is None:
            self.write_json("header.json", header)

    def header(self) -> dict[str, Any] | None:
        return self.read_json("header.json")

    def run(self) -> dict[str, Any]:
        """``{"run_id", "experiment_id", "begin"}`` (the position of the record that chose it)."""
        return self.read_json("run.json") or {}

    # -- writing (the writer's thread only) --
    def segments(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _SEGMENT.match(n)))

    def _segment_path(self, n: int) -> Path:
        return self.path / f"{n:08d}.jsonl"

    def start_segment(self) -> Position:
        """Begin a new segment after every existing one (unbuffered: a refused write fails here)."""
        self.close_segment()
        self._segment = max([*self.segments(), self._segment]) + 1
        self._fh = open(self._segment_path(self._segment), "ab", buffering=0)
        return self._segment, 0

    def append(self, records: list[dict[str, Any]]) -> Position:
        """Append records (segments of about `SEGMENT_BYTES`); return the position past the last."""
        lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records]
        if self._fh is not None and os.fstat(self._fh.fileno()).st_nlink == 0:
            raise FileNotFoundError(f"{self.path} was deleted while this run logged into it")
        i, pos = 0, self.written()
        while True:
            chunk: list[bytes] = []
            sent = 0  # bytes of this chunk the disk took
            try:
                if self._fh is None or self._fh.tell() >= SEGMENT_BYTES:
                    pos = self.start_segment()
                room = SEGMENT_BYTES - self._fh.tell()
                while i < len(lines) and (not chunk or len(lines[i]) <= room):
                    chunk.append(lines[i])
                    room -= len(lines[i])
                    i += 1
                view = memoryview(b"".join(chunk))
                while view:
                    n = self._fh.write(view)
                    sent += n
                    view = view[n:]
            except OSError as e:
                # Keep the whole lines the disk took and cut a torn one off.
                whole = kept = 0
                while whole < len(chunk) and kept + len(chunk[whole]) <= sent:
                    kept += len(chunk[whole])
                    whole += 1
                try:
                    self._fh.truncate(pos[1] + kept)
                    self._fh.seek(pos[1] + kept)
                except (OSError, AttributeError):
                    whole = kept = 0
                done = i - len(chunk) + whole
                raise SpoolFull(e, done, (pos[0], pos[1] + kept)) from e
            pos = self.written()
            if i >= len(lines):
                return pos

    def written(self) -> Position:
        return self._segment, (self._fh.tell() if self._fh is not None else 0)

    def close_segment(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- reading and pruning (the courier) --
    def delivered(self) -> Position:
        try:
            seg, off = (self.path / "delivered").read_text().split()
            return int(seg), int(off)
        except (OSError, ValueError):
            return 0, 0

    def mark_delivered(self, pos: Position) -> None:
        """Everything before ``pos`` is in MLflow: delete the segments before it (frees a disk)."""
        try:
            self.write_json("delivered", f"{pos[0]} {pos[1]}")
        finally:
            for n in self.segments():
                if n < pos[0]:
                    self._segment_path(n).unlink(missing_ok=True)

    def read(
        self, start: Position, max_records: int = 1000
    ) -> list[tuple[Position, dict[str, Any]]]:
        """Records from ``start`` on, each with the position past it; a torn last line is left."""
        out: list[tuple[Position, dict[str, Any]]] = []
        segs = self.segments()
        for i, n in enumerate(segs):
            if n < start[0]:
                continue
            offset = start[1] if n == start[0] else 0
            try:
                with open(self._segment_path(n), "rb") as fh:
                    fh.seek(offset)
                    for line in fh:
                        if not line.endswith(b"\n"):
                            break
                        offset += len(line)
                        try:
                            out.append(((n, offset), json.loads(line)))
                        except ValueError:  # torn, and no one appends to it: skip it
                            continue
                        if len(out) >= max_records:
                            return out
            except FileNotFoundError:
                continue
            if i + 1 < len(segs) and out and out[-1][0][0] == n:
                out[-1] = ((segs[i + 1], 0), out[-1][1])  # past the end of a complete segment
        return out

    def pending(self) -> bool:
        return bool(self.read(self.delivered(), max_records=1))

    def remove(self) -> None:
        """Delete the whole spool (all of it was delivered and its writer has ended)."""
        self.close_segment()
        shutil.rmtree(self.path, ignore_errors=True)
