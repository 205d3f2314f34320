"""Create a fresh MLflow sqlite store so that a kill at any moment leaves no store or a whole one.

MLflow builds its schema in place, one migration after another, the first time a client opens a
``sqlite:///`` URI whose file does not exist yet. A process killed meanwhile leaves a half-built
file that every later client fails on. keras-sync makes sqlite the default store, so it has
MLflow's public client build a new store under a private name next to the target and publishes it
with ``os.link``: atomic, and it never replaces a store another process published first.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

from keras_sync.errors import TrackingError

_log = logging.getLogger("keras_sync.tracking")

_TMP_MARK = ".keras-sync-creating-"
#: Room a new store needs (a migrated store is about 1.3 MB); checked before MLflow tries.
_ROOM_BYTES = 2 * 1024 * 1024


def warm_up(uri: str | None) -> list[str]:
    """Do what opening ``uri`` costs before it is opened, touching no file: import MLflow, and for a
    SQL store MLflow's store module with its mappers configured, and for sqlite the schema's head.
    Returns what was done, in order (``mlflow``, ``sql store``, ``schema head``)."""
    from mlflow import MlflowClient  # noqa: F401

    from keras_sync.upstream import mlflow_internals

    done = ["mlflow"]
    if uri is None or not mlflow_internals.preload_sql_store(uri):
        return done
    done.append("sql store")
    if sqlite_path(uri) is not None and mlflow_internals.schema_head() is not None:
        done.append("schema head")
    return done


@contextlib.contextmanager
def _quiet_mlflow() -> Iterator[None]:
    """MLflow's and alembic's INFO lines kept out of the user's output meanwhile (warnings still said)."""
    quiet = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [lg.level for lg in quiet]
    try:
        for lg in quiet:
            lg.setLevel(logging.WARNING)
        yield
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


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
    if raw in ("", ":memory:"):
        return None
    return Path(raw)


def ensure_sqlite_store(uri: str, *, timeout_s: float = 300.0) -> bool:
    """Make sure the sqlite store of ``uri`` exists and is complete; True if this call created it.

    Any other URI, or a store file that already exists, is left alone. The schema is built in
    ``.<name>.keras-sync-creating-<pid>-<id>`` beside the target, then linked
    into place. Leftovers of builders that were killed are removed. A live builder's file (another
    process building the same store) is waited for instead of building a second copy, and so is a
    store that MLflow itself builds in place (a user's own client): until its last migration.
    """
    path = sqlite_path(uri)
    if path is None:
        return False
    if path.exists():
        _wait_while_built_in_place(path.absolute(), timeout_s)
        return False
    path = path.absolute()
    check_creatable(uri)
    if _wait_for_live_builder(path, timeout_s):
        _wait_while_built_in_place(path, timeout_s)  # it may be MLflow's own, still being built
        return False  # another process built it meanwhile
    _remove_leftovers(path)
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        # Created now, not when MLflow (imported first: seconds) opens it: a courier that starts
        # meanwhile sees a live builder and waits for it instead of building a second store.
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        _build(tmp, path)
        try:
            os.link(tmp, path)  # atomic; FileExistsError if another process published first
        except (
            FileExistsError
        ):  # published meanwhile: by a builder like this one, or in place by MLflow
            _wait_while_built_in_place(path, timeout_s)
            return False
        _log.debug("created the MLflow sqlite store %s", path)
        return True
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass


#: A store below its schema's head whose schema has not moved for this long is not being built.
_SETTLED_S = 20.0


def _wait_while_built_in_place(path: Path, timeout_s: float) -> None:
    """Wait while another client (a user's own ``MlflowClient``, an ``mlflow server``) builds ``path``.

    MLflow builds a store in place, one migration after another; a second client that opens it
    meanwhile finds tables missing and runs the migrations again beside the first: both fail
    ("table ... already exists"). A store at its schema's head is used at once (one small read), and
    so is one whose file nobody has written for `_SETTLED_S`. Any other is waited for while its
    schema moves (its revision or its tables); one that stays below the head without moving for
    `_SETTLED_S` (an older MLflow's store in use, one whose builder was killed) is left to MLflow,
    which names what it finds.
    """
    head = _schema_head()
    if head is None:
        return
    deadline = time.monotonic() + timeout_s
    last, moved_at = None, time.monotonic()
    while True:
        state = _schema_state(path)
        if state[0] == head:
            return
        if state != last:
            last, moved_at = state, time.monotonic()
        journal = path.with_name(path.name + "-journal")
        try:
            idle_s = time.time() - max(p.stat().st_mtime for p in (path, journal) if p.exists())
        except (OSError, ValueError):
            idle_s = 0.0
        if (
            (idle_s >= _SETTLED_S and not journal.exists())
            or time.monotonic() - moved_at >= _SETTLED_S
            or time.monotonic() >= deadline
        ):
            return
        time.sleep(0.05)


def _schema_head() -> str | None:
    from keras_sync.upstream.mlflow_internals import schema_head

    return schema_head()


def _schema_state(path: Path) -> tuple[str | None, int]:
    """The store's alembic revision (None while it has none) and its number of tables, read only."""
    import sqlite3
    from contextlib import closing

    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)) as db:
            tables = db.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[
                0
            ]
            try:
                row = db.execute("SELECT version_num FROM alembic_version").fetchone()
            except sqlite3.Error:
                row = None
    except sqlite3.Error:  # locked by the builder, or not sqlite
        return None, -1
    return (row[0] if row else None), int(tables)


def _wait_for_live_builder(path: Path, timeout_s: float) -> bool:
    """Wait while a live process builds ``path``; True if the store exists now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        builders = [
            p
            for p in path.parent.glob(f".{path.name}{_TMP_MARK}*")
            if not p.name.endswith(("-journal", "-room")) and _builder_alive(p, path)
        ]
        if not builders:
            return path.exists()
        time.sleep(0.05)
    return path.exists()


def _builder_alive(tmp: Path, path: Path) -> bool:
    pid_text = tmp.name[len(f".{path.name}{_TMP_MARK}") :].split("-", 1)[0]
    return pid_text.isdigit() and _alive(int(pid_text))


def _build(tmp: Path, path: Path) -> None:
    """MLflow's schema in ``tmp``, built by MLflow's public client in this process. MLflow's pool may
    keep an idle connection to the private name: no transaction, so no lock, and never used again."""
    try:
        from mlflow import MlflowClient

        with _quiet_mlflow():  # "Creating initial MLflow database tables..." is ours to say, or not
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
    except Exception as e:
        tail = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise TrackingError(f"Could not create the MLflow store {str(path)!r}: {tail}") from None


def check_creatable(uri: str) -> None:
    """Raise `TrackingError` with the cause if the sqlite store of ``uri`` is missing and cannot be made.

    Cheap (no MLflow): the writer asks it before its courier starts, so `fit` knows at once.
    """
    path = sqlite_path(uri)
    if path is None or path.exists():
        return
    path = path.absolute()
    if not path.parent.is_dir():
        raise TrackingError(
            f"The MLflow store {uri!r} cannot be created: its folder {str(path.parent)!r} does not exist. "
            "Create the folder, or set mlflow.tracking_uri to a path in an existing folder."
        )
    _probe_writable(
        uri, path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    )


def _probe_writable(uri: str, tmp: Path) -> None:
    """Create the private build file here, so a folder that refuses it fails now, with its cause.

    MLflow's engine retries a store it cannot open for minutes before it gives up with a generic
    error; the operating system says at once why (permission, disk full, read-only filesystem).
    """
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.unlink(tmp)  # only the probe: the builder makes the store itself
        # A full disk lets an empty file be created; the store needs room for its migrations.
        probe = tmp.with_name(tmp.name + "-room")
        with open(probe, "wb") as fh:
            fh.write(b"\0" * _ROOM_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as e:
        for leftover in (tmp, tmp.with_name(tmp.name + "-room")):
            try:
                leftover.unlink()
            except OSError:
                pass
        raise TrackingError(
            f"The MLflow store {uri!r} cannot be created in {str(tmp.parent)!r}: "
            f"{e.strerror or e} (errno {errno.errorcode.get(e.errno or 0, e.errno)}). Make the folder writable "
            "by this user (or free disk space there), or set mlflow.tracking_uri to a store it can write."
        ) from None


def _remove_leftovers(path: Path) -> None:
    """Delete private build files of ``path`` whose builder process is gone."""
    for p in path.parent.glob(f".{path.name}{_TMP_MARK}*"):
        if _builder_alive(p, path):
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
