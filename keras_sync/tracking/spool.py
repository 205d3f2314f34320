"""The spool: the one interface between a training process and the courier of its metrics.

A spool is a directory per run, ``<spool_dir>/<job id>/``. The training process appends
records to numbered segment files and never waits for MLflow; the courier
(`keras_sync.tracking.courier`) reads them in order, sends them, records how far it got and deletes
the segments it has delivered. Nothing else passes between the two:

=================  ===========================================================================
``header.json``    experiment, run name, job id, whether the job id was given explicitly, the
                   tracking URI without credentials (written once by the first writer)
``NNNNNNNN.jsonl`` segments, one JSON record per line; a segment is complete once a later one
                   exists (a writer starts a new one every `SEGMENT_BYTES` and at each start)
``delivered``      ``"<segment> <offset>"``: every record before it is in MLflow
``run.json``       the MLflow run id and experiment id, once the courier has the run
``status.json``    the courier's last outcome: ``{"ok": true}`` or the error and its kind
``writer.lock``    held (flock) by the live writer; ``deliver.lock`` by the live courier
``reserve``        16 KB the writer keeps free, for the records that end a run whose spool
                   filled its disk (`keras_sync.tracking.handover`)
=================  ===========================================================================

A spool whose disk refuses a write (full, over quota) takes nothing more from its writer: the
rest goes to the live courier over a pipe, from memory (`keras_sync.tracking.handover`); the courier keeps
where delivery stands in memory too and tells the writer over a second pipe, since
``delivered``, ``run.json`` and ``status.json`` may not be writable then.

The records in the segments (their kinds and fields), the causes of a failed delivery and
MLflow's limits are the protocol's other half: `keras_sync.tracking.records`.

The delivered position moves only after MLflow accepted a batch, so a crash in between re-sends
a batch at worst; the courier drops points at steps a metric already has, so a re-send or a
job that trains steps again after a restore never puts two points at one (key, step).

Nothing here imports MLflow at import time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per spool is then on the user
    fcntl = None  # type: ignore[assignment]

#: A writer starts a new segment once the current one is this big; delivered segments are deleted.
SEGMENT_BYTES = 256 * 1024
_SEGMENT = re.compile(r"^(\d{8})\.jsonl$")

Position = tuple[int, int]  # (segment number, byte offset in it)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: leave no empty file behind
        raise


class SpoolFull(OSError):
    """`SpoolDir.append` could not write (disk full, quota, I/O error): what it did write is whole.

    ``done``: how many of the records are in the spool (a torn line is cut off again);
    ``pos``: the position just past the last of them. ``reason``: the operating system's words.
    """

    def __init__(self, error: OSError, done: int, pos: Position):
        super().__init__(error.errno, error.strerror or str(error))
        self.reason = error.strerror or str(error)
        self.done, self.pos = done, pos


class SpoolDir:
    """One run's spool directory: segments written by the writer, read and pruned by the courier."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._locks: dict[str, Any] = {}
        self._fh: Any = None
        self._segment = 0
        self._header: dict[str, Any] | None = None
        #: Set by `append` when it found the spool deleted under it and made it again (see `_remade`).
        self.remade: str | None = None

    # -- locks: one writer and one courier at a time --
    def lock(self, role: str) -> bool:
        """Take ``writer.lock`` or ``deliver.lock`` until `unlock`; False if a live process holds it."""
        if fcntl is None or role in self._locks:
            return True
        self.path.mkdir(parents=True, exist_ok=True)
        fh = open(self.path / f"{role}.lock", "ab")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return False
        self._locks[role] = fh
        return True

    def wait_lock(self, role: str) -> None:
        """Take the lock, waiting for its holder (a courier left by a crashed process) to end."""
        if fcntl is None or role in self._locks:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        fh = open(self.path / f"{role}.lock", "ab")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        self._locks[role] = fh

    def held(self, role: str) -> bool:
        """True if another process holds the lock ``role`` now."""
        if fcntl is None or not (self.path / f"{role}.lock").exists():
            return False
        with open(self.path / f"{role}.lock", "ab") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            return False

    def unlock(self, role: str) -> None:
        fh = self._locks.pop(role, None)
        if fh is not None:
            fh.close()

    # -- the header, the run id and the courier's status --
    def write_header(self, header: dict[str, Any]) -> None:
        self._header = header
        if not (self.path / "header.json").exists():
            _atomic_write(self.path / "header.json", json.dumps(header))

    def _read_json(self, name: str, missing: Any) -> Any:
        """The JSON file ``name`` of the spool, or ``missing`` when it is absent or half-written."""
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return missing

    def header(self) -> dict[str, Any] | None:
        return self._read_json("header.json", None)

    def run(self) -> dict[str, Any]:
        """``{"run_id": ..., "experiment_id": ...}`` once the courier knows the run, else ``{}``."""
        return self._read_json("run.json", {})

    def set_run(
        self, run_id: str, experiment_id: str | None, begin: Position | None = None
    ) -> None:
        """Name the run the records go to; ``begin``: the position of the "begin" record that chose it."""
        record: dict[str, Any] = {"run_id": run_id, "experiment_id": experiment_id}
        if begin is not None:
            record["begin"] = list(begin)
        _atomic_write(self.path / "run.json", json.dumps(record))

    def status(self) -> dict[str, Any] | None:
        return self._read_json("status.json", None)

    def held_report(self) -> dict[str, Any] | None:
        """``{"run_id": ..., "rec": <report record>}``: a report the courier holds (delivered past it, not
        drawn yet; `keras_sync.tracking.deliver.RunSender.hold_reports`), or None."""
        return self._read_json("report.json", None)

    def set_held_report(self, held: dict[str, Any] | None) -> None:
        """Keep ``held`` (see `held_report`) in ``report.json``; None removes it. Raises OSError."""
        if held is None:
            (self.path / "report.json").unlink(missing_ok=True)
        else:
            _atomic_write(self.path / "report.json", json.dumps(held))

    def set_status(self, status: dict[str, Any]) -> None:
        _atomic_write(self.path / "status.json", json.dumps(status))

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
        """Begin a new segment after every existing one (a writer never appends to an older one)."""
        self.close_segment()
        existing = self.segments()
        n = max(existing[-1] if existing else 0, self._segment) + 1
        # Unbuffered: a write the disk refuses fails here, not later in a flush at exit. Readable too:
        # a segment deleted under its writer is copied back from its open file (`_remake`).
        self._fh = open(self._segment_path(n), "a+b", buffering=0)
        self._segment = n
        return self._segment, 0

    def append(self, records: list[dict[str, Any]]) -> Position:
        """Append records, flush them to the OS, return the position just past the last one.

        A big batch is split over segments of about `SEGMENT_BYTES` (a writer that fell behind on
        a busy machine appends thousands of records at once): the courier deletes whole
        segments, so the spool stays small however the records arrive.
        """
        lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records]
        i = done = 0
        if self._fh is not None and os.fstat(self._fh.fileno()).st_nlink == 0:
            self._remake()
        pos = self.written()
        while True:
            chunk: list[bytes] = []
            sent = 0  # bytes of this chunk the disk took
            try:
                if self._fh is None or self._fh.tell() >= SEGMENT_BYTES:
                    pos = self.start_segment()
                room, size = SEGMENT_BYTES - self._fh.tell(), 0
                while i < len(lines) and (not chunk or size + len(lines[i]) <= room):
                    chunk.append(lines[i])
                    size += len(lines[i])
                    i += 1
                view = memoryview(b"".join(chunk))
                while view:
                    n = self._fh.write(view)
                    sent += n
                    view = view[n:]
            except OSError as e:
                # The disk took part of the chunk (a write stops where the disk fills): keep its whole
                # lines, so a batch that arrives at once loses only what did not fit, and cut the torn
                # line off, so a later append does not glue a record to it.
                whole = kept = 0
                for line in chunk:
                    if kept + len(line) > sent:
                        break
                    kept += len(line)
                    whole += 1
                if self._fh is not None:
                    try:
                        self._fh.truncate(pos[1] + kept)
                        self._fh.seek(pos[1] + kept)
                    except OSError:
                        kept, whole = 0, 0
                        try:
                            self._fh.truncate(pos[1])
                            self._fh.seek(pos[1])
                        except OSError:
                            pass
                raise SpoolFull(e, done + whole, (pos[0], pos[1] + kept)) from e
            done, pos = i, (self._segment, self._fh.tell())
            if i >= len(lines):
                return pos

    def _remake(self) -> None:
        """The open segment was deleted (the spool directory removed by someone while the run logs):
        make the directory again (header, writer lock) and copy the segment's records back from the
        open file into a new segment, so the courier finds them. Earlier segments not yet delivered
        are gone with the directory."""
        size = self._fh.tell()
        data = os.pread(self._fh.fileno(), size, 0)
        self.close_segment()
        self.path.mkdir(parents=True, exist_ok=True)
        if self._header is not None:
            _atomic_write(self.path / "header.json", json.dumps(self._header))
        if "writer" in self._locks:
            self.unlock("writer")
            self.lock("writer")
        self.start_segment()
        view = memoryview(data)
        while view:
            view = view[self._fh.write(view) :]
        self.remade = f"{len(data.splitlines())} record(s) of its open segment were written again"

    def written(self) -> Position:
        return (self._segment, self._fh.tell()) if self._fh is not None else (self._segment, 0)

    def close_segment(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- reading and pruning (the courier only) --
    def delivered(self) -> Position:
        try:
            seg, off = (self.path / "delivered").read_text().split()
            return int(seg), int(off)
        except (OSError, ValueError):
            return 0, 0

    def mark_delivered(self, pos: Position) -> None:
        """Record that everything before ``pos`` is in MLflow; delete the segments wholly before it.

        The segments go even when the position cannot be written (a full disk): they are in
        MLflow, and deleting them is what frees the disk.
        """
        try:
            _atomic_write(self.path / "delivered", f"{pos[0]} {pos[1]}")
        finally:
            for n in self.segments():
                if n < pos[0]:
                    self._segment_path(n).unlink(missing_ok=True)

    def read(
        self, start: Position, max_records: int = 1000
    ) -> list[tuple[Position, dict[str, Any]]]:
        """Records from ``start`` on, in order, each with the position just past it.

        A line without its newline is skipped: in the newest segment it is still being written;
        in an older one, a crashed writer tore it.
        """
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
                        except ValueError:  # torn, then appended to by nobody: skip it
                            continue
                        if len(out) >= max_records:
                            return out
            except FileNotFoundError:
                continue
            if i + 1 < len(segs) and out and out[-1][0][0] == n:
                out[-1] = ((segs[i + 1], 0), out[-1][1])  # past the end of a complete segment
        return out

    def pending(self) -> bool:
        """True if records exist that are not delivered yet."""
        return bool(self.read(self.delivered(), max_records=1))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob("*") if p.is_file())

    def remove(self) -> None:
        """Delete the whole spool (everything in it was delivered and its writer has ended)."""
        self.close_segment()
        shutil.rmtree(self.path, ignore_errors=True)
