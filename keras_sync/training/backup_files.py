"""Backup bookkeeping without TensorFlow: when to save, which checkpoint is complete (its files
match ``ckpt-N.manifest.json``, written last), who owns the directory (`BackupLock`: a lock of a
dead process on this host, or not refreshed for `STALE_S`, is stale and taken over)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import psutil

from keras_sync.errors import UsageError

MANIFEST_SUFFIX = ".manifest.json"
LOCK_FILE = "keras_sync_lock.json"
STALE_S = 30.0  # a lock its holder has not refreshed for this long (every HEARTBEAT_S) is stale
HEARTBEAT_S = 5.0
_CKPT = re.compile(r"^ckpt-(\d+)\.index$")


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored job continues: the epoch, its batches already trained, the optimizer step."""

    epoch: int
    step: int
    iterations: int

    @property
    def mid_epoch(self) -> bool:
        return self.step > 0


class SaveSchedule:
    """When to save: after every epoch, or after every ``save_freq`` batches (counted across epochs).

    >>> s = SaveSchedule(3)
    >>> [s.after_batch() for _ in range(5)]
    [False, False, True, False, False]
    """

    def __init__(self, save_freq: str | int):
        batches = isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        if save_freq != "epoch" and not batches:
            msg = f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. Expected 'epoch' or an integer number of batches >= 1."
            raise UsageError(msg)
        self.save_freq = save_freq
        self._since_save = 0

    def after_batch(self, batches: int = 1) -> bool:
        """Count ``batches`` trained; True when a save is due now."""
        self._since_save += batches
        due = self.save_freq != "epoch" and self._since_save >= int(self.save_freq)
        self._since_save = 0 if due else self._since_save
        return due

    def after_epoch(self) -> bool:
        return self.save_freq == "epoch"


def write_dir(backup_dir: str, *, is_chief: bool, task_id: int | None) -> str:
    """The chief writes ``backup_dir``; worker N a ``.worker_tmp_N`` it deletes after each save."""
    return backup_dir if is_chief else os.path.join(backup_dir, f".worker_tmp_{task_id or 0}")


def batches_to_skip(point: ResumePoint, steps_per_execution: int = 1) -> int:
    """Batches of the resumed epoch trained before the interruption (saves end an execution)."""
    if point.step % steps_per_execution:
        msg = f"The backup was taken at step {point.step} of epoch {point.epoch}, which is not a multiple of steps_per_execution={steps_per_execution}. Resume with the steps_per_execution it was saved with, or delete the backup directory to start over."
        raise UsageError(msg)
    return point.step


def _files_of(prefix: str) -> list[str]:
    folder, stem = os.path.split(prefix)
    names = os.listdir(folder or ".")
    return sorted(n for n in names if n == f"{stem}.index" or n.startswith(f"{stem}.data-"))


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(prefix: str, run: dict[str, Any] | None = None) -> None:
    """Record the checkpoint at ``prefix`` (``DIR/ckpt-N``) as complete, with the run that wrote it."""
    paths = {name: os.path.join(os.path.dirname(prefix), name) for name in _files_of(prefix)}
    files = {n: {"size": os.path.getsize(p), "crc32": _crc(p)} for n, p in paths.items()}
    tmp = f"{prefix}{MANIFEST_SUFFIX}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"v": 1, "files": files, "written": time.time(), "run": run}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, prefix + MANIFEST_SUFFIX)


def checkpoints(backup_dir: str) -> list[str]:
    """The checkpoint prefixes in ``backup_dir`` (``DIR/ckpt-N``, by their ``.index``), newest first."""
    try:
        matches = [m for m in map(_CKPT.match, os.listdir(backup_dir)) if m]
    except OSError:
        return []
    matches.sort(key=lambda m: -int(m.group(1)))
    return [os.path.join(backup_dir, m.group(0).removesuffix(".index")) for m in matches]


def number_of(prefix: str) -> int:
    """The optimizer step a checkpoint was saved at: ``N`` of ``DIR/ckpt-N``."""
    return int(prefix.rsplit("-", 1)[1])


def prune(backup_dir: str, saved: int, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to step ``saved`` (newer ones were fallen back from)."""
    kept = [p for p in checkpoints(backup_dir) if number_of(p) <= saved][:keep]
    for prefix in set(checkpoints(backup_dir)) - set(kept):
        for name in [*_files_of(prefix), os.path.basename(prefix) + MANIFEST_SUFFIX]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(backup_dir, name))


def problem(prefix: str) -> str | None:
    """Why the checkpoint at ``prefix`` cannot be trusted, or None when its files match its manifest."""
    try:
        with open(prefix + MANIFEST_SUFFIX) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return "incomplete: no manifest (its save was cut off)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    if sorted(files) != _files_of(prefix):
        return f"its files are {_files_of(prefix)}, its manifest lists {sorted(files)}"
    for name, want in files.items():
        path = os.path.join(os.path.dirname(prefix), name)
        if (size := os.path.getsize(path)) != want["size"]:
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


class Choice(NamedTuple):
    """What a restore may use: the complete checkpoints newest first, and those skipped (with why)."""

    usable: list[str]
    skipped: list[tuple[str, str]]


def choose(backup_dir: str) -> Choice:
    """The checkpoints a restore may use (`refuse_damaged` if none)."""
    checked = [(prefix, problem(prefix)) for prefix in checkpoints(backup_dir)]
    usable, skipped = [p for p, why in checked if why is None], [(p, w) for p, w in checked if w]
    refuse_damaged(backup_dir, usable, skipped)
    return Choice(usable, skipped)


def refuse_damaged(backup_dir: str, usable: list[str], skipped: list[tuple[str, str]]) -> None:
    """`UsageError` when nothing is usable but something is damaged (a cut-off save is no backup)."""
    if not usable and any(not why.startswith("incomplete") for _, why in skipped):
        what = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
        msg = f"fault_tolerance.backup_dir: no usable backup in {backup_dir} ({what}). Fix: restore that directory from a copy, or delete it to train from the start; nothing was trained."
        raise UsageError(msg)


@dataclass(frozen=True)
class Holder:
    """Who trains into a backup directory: job id (None: none given), host, pid, cluster."""

    job_id: str | None
    host: str
    pid: int
    cluster: str | None


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
    """The lock's holder if another live job (a worker accepts its job's chief, a relaunch its lock)."""
    if found is None:
        return None
    holder, age = found
    here = holder.host == me.host
    if (here and (holder.pid == me.pid or not psutil.pid_exists(holder.pid))) or age > STALE_S:
        return None
    if holder.job_id is not None:
        same_job = holder.job_id == me.job_id
    else:
        same_job = me.job_id is None and holder.cluster is not None and holder.cluster == me.cluster
    return None if same_job and not (chief and here) else holder


def refused(backup_dir: str, other: Holder) -> UsageError:
    job = f"job {other.job_id}" if other.job_id else "a job without job id"
    msg = f"fault_tolerance.backup_dir: {backup_dir} is in use by {job} (pid {other.pid} on {other.host}), which is training into it now; two jobs in one backup directory would resume from each other's backups. Fix: give this job its own backup_dir, or wait for that job to end (if it is gone, delete {os.path.join(backup_dir, LOCK_FILE)}); nothing was trained."
    return UsageError(msg)


class BackupLock:
    """The lock the chief holds on its backup directory while `fit` runs (refreshed every `HEARTBEAT_S`)."""

    def __init__(self, backup_dir: str, me: Holder):
        self.backup_dir, self.me = backup_dir, me
        self.path = os.path.join(backup_dir, LOCK_FILE)
        self._stop = threading.Event()

    def acquire(self) -> None:
        """Take the directory, or raise `UsageError` naming the live job that holds it."""
        os.makedirs(self.backup_dir, exist_ok=True)
        for _ in range(3):  # a stale lock is removed, then taken
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = live_other(read_lock(self.backup_dir), self.me, chief=True)
                if other is not None:
                    raise refused(self.backup_dir, other) from None
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self.me), f)
            threading.Thread(target=self._beat, name="keras-sync-backup-lock", daemon=True).start()
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
