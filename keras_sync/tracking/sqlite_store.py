"""Create a fresh MLflow sqlite store so that a kill at any moment leaves no store or a whole one.

MLflow builds its schema in place, migration by migration; a kill meanwhile leaves a file every
later client fails on. So the store is built under a private name beside the target and
``os.link`` publishes it: atomic, and never over a store another process published.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import time
import uuid
from contextlib import closing
from pathlib import Path
from urllib.parse import unquote

import psutil

from keras_sync.errors import TrackingError
from keras_sync.upstream import mlflow_internals

_log = logging.getLogger("keras_sync.tracking")
_TMP_MARK = ".keras-sync-creating-"
#: Room a new store needs (a migrated store is about 1.3 MB); checked before MLflow tries.
_ROOM_BYTES = 2 * 1024 * 1024
#: A store below its schema's head whose schema has not moved for this long is not being built.
_SETTLED_S = 20.0


def warm_up(uri: str | None) -> list[str]:
    """Import what opening ``uri`` needs, touching no file; return which were done, in order."""
    from mlflow import MlflowClient  # noqa: F401

    done = ["mlflow"]
    if uri is None or not mlflow_internals.preload_sql_store(uri):
        return done
    done.append("sql store")
    if sqlite_path(uri) is not None and mlflow_internals.schema_head() is not None:
        done.append("schema head")
    return done


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` tracking URI, or None for any other URI or an in-memory one.

    >>> sqlite_path("sqlite:////tmp/x/mlflow.db")
    PosixPath('/tmp/x/mlflow.db')
    >>> sqlite_path("sqlite:///:memory:") is None, sqlite_path("http://127.0.0.1:5000") is None
    (True, True)
    """
    if not uri.startswith("sqlite:///"):
        return None
    raw = unquote(uri[len("sqlite:///") :].split("?", 1)[0])
    return None if raw in ("", ":memory:") else Path(raw)


def ensure_sqlite_store(uri: str, *, timeout_s: float = 300.0) -> bool:
    """Make sure the sqlite store of ``uri`` exists and is whole; True if this call created it."""
    path = sqlite_path(uri)
    if path is None:
        return False
    path = path.absolute()
    if not path.exists():
        _check_creatable(uri, path)
        if not _wait_for_live_builders(path, timeout_s):
            tmp = _private_name(path)
            try:
                # Made now: a courier starting meanwhile sees a live builder and waits.
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                _build(tmp, path)
                os.link(tmp, path)  # atomic; FileExistsError if another process published first
                return True
            except FileExistsError:  # published meanwhile: by a builder like this, or by MLflow
                pass
            finally:
                _unlink(tmp, tmp.with_name(tmp.name + "-journal"))
    _wait_while_built_in_place(path, timeout_s)
    return False


def _private_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _unlink(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _wait_for_live_builders(path: Path, timeout_s: float) -> bool:
    """Wait while a live process builds ``path``; remove dead builders' files; True if it exists."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        live = False
        for p in path.parent.glob(f".{path.name}{_TMP_MARK}*"):
            pid = p.name[len(f".{path.name}{_TMP_MARK}") :].split("-", 1)[0]
            if pid.isdigit() and psutil.pid_exists(int(pid)):
                live = live or not p.name.endswith(("-journal", "-room"))
            else:
                p.unlink(missing_ok=True)
        if not live:
            break
        time.sleep(0.05)
    return path.exists()


def _wait_while_built_in_place(path: Path, timeout_s: float) -> None:
    """Wait while another client builds ``path`` in place: below the head and still changing."""
    head, journal = mlflow_internals.schema_head(), path.with_name(path.name + "-journal")
    last, moved_at, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while head is not None and (state := _schema_state(path))[0] != head:
        if state != last:
            last, moved_at = state, time.monotonic()
        with contextlib.suppress(OSError):  # the journal went between the two calls
            written = max(p.stat().st_mtime for p in (path, journal) if p.exists())
            if time.time() - written >= _SETTLED_S and not journal.exists():
                return
        if time.monotonic() - moved_at >= _SETTLED_S or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _schema_state(path: Path) -> tuple[str | None, int]:
    """The store's alembic revision (None while it has none) and its number of tables, read only."""
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)) as db:
            sql = "SELECT count(*) FROM sqlite_master WHERE type='table'"
            tables = int(db.execute(sql).fetchone()[0])
            try:
                row = db.execute("SELECT version_num FROM alembic_version").fetchone()
            except sqlite3.Error:
                row = None
    except sqlite3.Error:  # locked by the builder, or not sqlite
        return None, -1
    return (row[0] if row else None), tables


def _build(tmp: Path, path: Path) -> None:
    """MLflow's schema in ``tmp``, built by MLflow's public client (its INFO lines kept quiet)."""
    levels = {name: logging.getLogger(name).level for name in ("mlflow", "alembic")}
    try:
        from mlflow import MlflowClient

        for name in levels:
            logging.getLogger(name).setLevel(logging.WARNING)
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
    except Exception as e:
        tail = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise TrackingError(f"Could not create the MLflow store {str(path)!r}: {tail}") from None
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _check_creatable(uri: str, path: Path) -> None:
    """Raise `TrackingError` with the OS's cause if the store ``path`` cannot be created."""
    if not path.parent.is_dir():
        raise TrackingError(
            f"The MLflow store {uri!r} cannot be created: its folder {str(path.parent)!r} does not exist. "
            "Create the folder, or set mlflow.tracking_uri to a path in an existing folder."
        )
    room = Path(f"{_private_name(path)}-room")
    try:
        with open(room, "xb") as fh:  # a full disk lets an empty file be created: fill the room
            fh.write(b"\0" * _ROOM_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, e.errno)
        raise TrackingError(
            f"The MLflow store {uri!r} cannot be created in {str(path.parent)!r}: "
            f"{e.strerror or e} (errno {code}). Make the folder writable by this user (or free "
            "disk space there), or set mlflow.tracking_uri to a store it can write."
        ) from None
    finally:
        _unlink(room)
