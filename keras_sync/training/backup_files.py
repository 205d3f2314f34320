"""The files of a backup directory: which checkpoint is complete, and which job owns the directory.

- **Complete or partial.** After each save the chief writes ``ckpt-N.manifest.json`` last: the
  size and CRC-32 of every file of checkpoint N, and the run that wrote it. Only a checkpoint whose
  files match its manifest is trusted; `choose` takes the newest, naming each newer one it skips.
- **One job per directory.** `BackupLock` (``keras_sync_lock.json``) names the job training into
  the directory while its `fit` runs; another live job is refused before training. A lock of a dead
  process (same host) or not refreshed for `STALE_S` is stale: a relaunch takes it over.

No TensorFlow here; `keras_sync.callbacks.backup` writes and restores the checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from keras_sync.errors import UsageError

MANIFEST_SUFFIX = ".manifest.json"
LOCK_FILE = "keras_sync_lock.json"
#: A lock its holder has not refreshed for this long (it refreshes every `HEARTBEAT_S`) is stale.
STALE_S = 30.0
HEARTBEAT_S = 5.0
_CKPT = re.compile(r"^ckpt-(\d+)\.index$")


def _files_of(prefix: str) -> list[str]:
    folder, stem = os.path.split(prefix)
    return sorted(
        n
        for n in os.listdir(folder or ".")
        if n == f"{stem}.index" or n.startswith(f"{stem}.data-")
    )


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(prefix: str, record: dict[str, Any] | None = None) -> None:
    """Record the checkpoint at ``prefix`` (``DIR/ckpt-N``) as complete; drop manifests of deleted ones."""
    folder = os.path.dirname(prefix)
    paths = {n: os.path.join(folder, n) for n in _files_of(prefix)}
    files = {n: {"size": os.path.getsize(p), "crc32": _crc(p)} for n, p in paths.items()}
    body = dict(v=1, files=files, written=time.time(), host=socket.gethostname(), pid=os.getpid())
    body["run"] = record
    path = prefix + MANIFEST_SUFFIX
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for name in os.listdir(folder):  # manifests of checkpoints the manager deleted (max_to_keep)
        index = os.path.join(folder, name[: -len(MANIFEST_SUFFIX)] + ".index")
        if name.endswith(MANIFEST_SUFFIX) and not os.path.exists(index):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def checkpoints(backup_dir: str) -> list[str]:
    """The checkpoint prefixes in ``backup_dir`` (``DIR/ckpt-N``, by their ``.index``), newest first."""
    try:
        names = os.listdir(backup_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), m.group(0)[: -len(".index")]) for m in map(_CKPT.match, names) if m]
    return [os.path.join(backup_dir, stem) for _, stem in sorted(found, reverse=True)]


def newest_complete(backup_dir: str) -> int | None:
    """The optimizer step of the newest checkpoint in ``backup_dir`` whose files match its manifest."""
    for prefix in checkpoints(backup_dir):
        if problem(prefix) is None:
            return int(prefix.rsplit("-", 1)[1])
    return None


def checkpoint_bytes(backup_dir: str, number: int) -> int:
    prefix = os.path.join(backup_dir, f"ckpt-{number}")
    return sum(os.path.getsize(os.path.join(backup_dir, n)) for n in _files_of(prefix))


def problem(prefix: str) -> str | None:
    """Why the checkpoint at ``prefix`` cannot be trusted, or None when its files match its manifest."""
    try:
        with open(prefix + MANIFEST_SUFFIX) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return "incomplete: no manifest (its save was cut off)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    folder = os.path.dirname(prefix)
    if sorted(files) != _files_of(prefix):
        return f"its files are {_files_of(prefix)}, its manifest lists {sorted(files)}"
    for name, want in files.items():
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{name} has {size} of {want['size']} bytes"
        if _crc(path) != want["crc32"]:
            return f"{name} is damaged (checksum differs)"
    return None


def manifest_run(prefix: str) -> dict[str, Any] | None:
    """The MLflow run record saved in the manifest of the checkpoint at ``prefix`` (None if none)."""
    try:
        with open(prefix + MANIFEST_SUFFIX) as f:
            run = json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, dict) and isinstance(run.get("job_id"), str) else None


@dataclass
class Choice:
    """What a restore may use: the complete checkpoints newest first, and those skipped (with why)."""

    usable: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def latest(self) -> str | None:
        return self.usable[0] if self.usable else None


def choose(backup_dir: str) -> Choice:
    """The checkpoints of ``backup_dir`` a restore may use; `UsageError` when all are damaged.

    Saves cut off before their manifest are no backup (training starts over); damaged ones are
    refused: resuming is what the user asked for.
    """
    choice = Choice()
    for prefix in checkpoints(backup_dir):
        why = problem(prefix)
        if why is None:
            choice.usable.append(prefix)
        else:
            choice.skipped.append((prefix, why))
    if not choice.usable and any(not why.startswith("incomplete") for _, why in choice.skipped):
        raise no_usable_backup(backup_dir, choice.skipped)
    return choice


_chosen: dict[str, Choice] = {}


def chosen(backup_dir: str) -> Choice:
    """The `choose` of ``backup_dir`` made at this `fit`'s start (`remember`), else a new one."""
    return _chosen.get(os.path.abspath(backup_dir)) or choose(backup_dir)


def remember(backup_dir: str, choice: Choice | None) -> None:
    """Keep (or with None, forget) the choice of this `fit`: the run lookup and the restore agree."""
    _chosen.pop(os.path.abspath(backup_dir), None)
    if choice is not None:
        _chosen[os.path.abspath(backup_dir)] = choice


def no_usable_backup(backup_dir: str, skipped: list[tuple[str, str]]) -> UsageError:
    what = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
    return UsageError(
        f"fault_tolerance.backup_dir: no usable backup in {backup_dir} ({what}). Fix: restore that directory "
        f"from a copy, or delete it to train from the start; nothing was trained."
    )


def say_skipped(choice: Choice) -> None:
    """One line per newer checkpoint a restore leaves out, naming it and what is wrong (chief only)."""
    latest = choice.latest
    instead = f"using {os.path.basename(latest)}" if latest else "no earlier complete backup"
    for prefix, why in choice.skipped:
        print(
            f"keras-sync: skipped the backup {prefix} ({why}); {instead}",
            file=sys.stderr,
            flush=True,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass(frozen=True)
class Holder:
    """Who trains into a backup directory: job id (None: none given), host, pid, cluster."""

    job_id: str | None
    host: str
    pid: int
    cluster: str | None

    def describe(self) -> str:
        job = f"job {self.job_id}" if self.job_id else "a job without job id"
        return f"{job} (pid {self.pid} on {self.host})"


def read_lock(backup_dir: str) -> tuple[Holder, float] | None:
    """The holder of ``backup_dir``'s lock and its age in seconds; None: no lock, or unreadable."""
    path = os.path.join(backup_dir, LOCK_FILE)
    try:
        with open(path) as f:
            d = json.load(f)
        age = time.time() - os.path.getmtime(path)
        return Holder(d.get("job_id"), str(d["host"]), int(d["pid"]), d.get("cluster")), age
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_other(found: tuple[Holder, float] | None, me: Holder, *, chief: bool) -> Holder | None:
    """The lock's holder when it is another live job that ``me`` must not share the directory with.

    The chief takes over a lock of its own job id held on another host (a relaunch); another
    worker accepts its own job's chief (same job id, or same cluster).
    """
    if found is None:
        return None
    holder, age = found
    here = holder.host == me.host
    if (here and (holder.pid == me.pid or not _alive(holder.pid))) or age > STALE_S:
        return None
    if holder.job_id is not None:
        same_job = holder.job_id == me.job_id
    else:
        same_job = me.job_id is None and holder.cluster is not None and holder.cluster == me.cluster
    return None if same_job and not (chief and here) else holder


def refused(backup_dir: str, other: Holder) -> UsageError:
    return UsageError(
        f"fault_tolerance.backup_dir: {backup_dir} is in use by {other.describe()}, which is training into it "
        f"now; two jobs in one backup directory would resume from each other's backups. Fix: give this job its "
        f"own backup_dir, or wait for that job to end (if it is gone, delete {os.path.join(backup_dir, LOCK_FILE)}); "
        "nothing was trained."
    )


class BackupLock:
    """The lock the chief holds on its backup directory while `fit` runs (refreshed every `HEARTBEAT_S`)."""

    def __init__(self, backup_dir: str, me: Holder):
        self.path = os.path.join(backup_dir, LOCK_FILE)
        self.backup_dir = backup_dir
        self.me = me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the directory, or raise `UsageError` naming the live job that holds it."""
        os.makedirs(self.backup_dir, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = live_other(read_lock(self.backup_dir), self.me, chief=True)
                if other is not None:
                    raise refused(self.backup_dir, other) from None
                with contextlib.suppress(OSError):  # stale (or unreadable): taken over
                    os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({**asdict(self.me), "since": time.time()}, f)
            self._thread = threading.Thread(
                target=self._beat, name="keras-sync-backup-lock", daemon=True
            )
            self._thread.start()
            return
        raise refused(self.backup_dir, self.me)  # three races in a row: another job keeps taking it

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        found = read_lock(self.backup_dir)
        if found is not None and (found[0].host, found[0].pid) == (self.me.host, self.me.pid):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
