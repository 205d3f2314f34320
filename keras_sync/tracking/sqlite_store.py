"""Create a fresh MLflow sqlite store so that a kill at any moment leaves no store or a whole one.

MLflow builds its schema (about 60 migrations, 1-2 s) in place the first time a client opens a
``sqlite:///`` URI whose file does not exist yet. A process killed during that leaves a
half-built file, and every later client fails on it ("table webhooks already exists"). keras-sync
makes sqlite the default store, so it builds a new store in a private file next to the target
and publishes it with ``os.link``: atomic, and it never replaces a store another
process published first.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

from keras_sync.errors import TrackingError
from keras_sync.tracking.environ import environ_restored

_log = logging.getLogger("keras_sync.tracking")

_TMP_MARK = ".keras-sync-creating-"
#: Room a new store needs (a migrated MLflow 3.17 store is ~1.3 MB); checked before MLflow tries.
_ROOM_BYTES = 2 * 1024 * 1024


def warm_up(uri: str | None) -> list[str]:
    """Do what opening ``uri`` costs before it is opened, touching no file of the user's: import MLflow,
    and for a SQL store (``sqlite:``, ``postgresql:``, ...) MLflow's SQL store module, its SQLAlchemy
    mappers configured (measured: 0.37 + 0.32 s of CPU that MLflow otherwise spends at the first query,
    while the first `fit` trains) and, for sqlite, the schema's head revision and a rehearsal
    (`_rehearse`). Returns what was done, in order (``mlflow``, ``sql store``, ``schema head``,
    ``rehearsal``)."""
    from mlflow import MlflowClient  # noqa: F401

    done = ["mlflow"]
    try:
        # The schemes MLflow itself serves with its SQL store (``mysql+pymysql://`` counts as ``mysql``).
        from mlflow.store.db.db_types import DATABASE_ENGINES
    except ImportError:  # moved in a newer MLflow: no head start, opening the store works as before
        return done
    if (
        uri is None
        or "://" not in uri
        or uri.split(":", 1)[0].split("+", 1)[0] not in DATABASE_ENGINES
    ):
        return done
    try:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        from sqlalchemy.orm import configure_mappers

        configure_mappers()
        done.append("sql store")
    except Exception:
        return done
    if sqlite_path(uri) is not None and _schema_head() is not None:
        done.append("schema head")
        if _rehearse():
            done.append("rehearsal")
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


#: MLflow's setting of its SQL store's connection pool (read when a store's engine is made).
_POOL_ENV = "MLFLOW_SQLALCHEMYSTORE_POOLCLASS"
#: MLflow's switch for its usage telemetry (MLflow 3; read at each call).
_TELEMETRY_ENV = "MLFLOW_DISABLE_TELEMETRY"


def _rehearse() -> bool:
    """Open a throwaway copy of the kept empty store (`_template`) in a private temporary folder and do
    once what a run does first (an experiment, a run, its parameters, tags and a metric, its end);
    then remove it. False, with nothing left, when no template is kept or anything fails.

    SQLAlchemy builds each ORM query's loader and compiles its statement the first time it is used
    in a process (class-level memos, whatever the engine): measured with MLflow 3.17, the first
    parameters of a run cost 0.12-0.13 s of CPU, 0.01 s after the rehearsal, and the store's open and
    the run's creation 0.07 -> 0.04-0.05 s. The rehearsal itself costs ~0.35 s, spent while
    TensorFlow is imported rather than during the first `fit`.
    """
    import shutil
    import tempfile

    template = _template()
    if template is None or not template.is_file():
        return False
    folder = tempfile.mkdtemp(prefix="keras-sync-rehearsal-")
    try:
        tmp = Path(folder) / "mlflow.db"
        if not _copy_template(template, tmp):
            return False
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param, RunTag

        # Unpooled: each session's connection is closed with it, so no open handle keeps the removed
        # file's space (MLflow keeps the store object of a URI for the process's life). No usage
        # events of MLflow's telemetry (when on) for this throwaway run. MLflow's INFO lines (the
        # pool it made the engine with) are kept out of the user's output.
        with environ_restored(_POOL_ENV, _TELEMETRY_ENV), _quiet_mlflow():
            os.environ.update({_POOL_ENV: "NullPool", _TELEMETRY_ENV: "true"})
            client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
            run = client.create_run(client.create_experiment("rehearsal"))
            client.log_batch(
                run.info.run_id,
                metrics=[Metric("m", 1.0, 0, 1)],
                params=[Param("p", "1")],
                tags=[RunTag("t", "1")],
            )
            client.set_terminated(run.info.run_id)
        return True
    except Exception:
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


@functools.lru_cache(maxsize=1)
def _schema_head() -> str | None:
    """The schema revision this MLflow builds stores at, or None when MLflow does not say (read once per
    process: it reads MLflow's migration scripts, and a new store asks up to four times)."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:
        return None


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
    """MLflow's schema in ``tmp``, built in this process (the courier imports MLflow anyway: a child
    process for it cost a second import, ~1.5 s of a core beside the first fit). MLflow's pool may
    keep an idle connection to the private name: no transaction, so no lock, and never used again.

    The empty schema this MLflow builds is kept in the user's cache (`_template`) and copied the next
    time: building it runs MLflow's ~60 migrations (measured 1.4 s of CPU, MLflow 3.17), copying
    takes 0.05 s. The copy has no experiment: MLflow adds its Default experiment (whose artifact
    location depends on where the store is) when it first opens the store, as after a build."""
    template = _template()
    if template is not None and _copy_template(template, tmp):
        return
    try:
        from mlflow import MlflowClient

        with _quiet_mlflow():  # "Creating initial MLflow database tables..." is ours to say, or not
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
    except Exception as e:
        tail = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise TrackingError(f"Could not create the MLflow store {str(path)!r}: {tail}") from None
    if template is not None:
        _keep_template(tmp, template)


#: Set to 0 to build every new store with MLflow's migrations instead of copying a kept empty one.
TEMPLATE_ENV = "KERAS_SYNC_STORE_TEMPLATE"


def _template() -> Path | None:
    """Where this MLflow's empty store is kept: the user's cache, named by the MLflow, SQLAlchemy and
    schema versions that made it (another version builds and keeps its own). None when turned off
    or when MLflow does not say its schema's head."""
    if os.environ.get(TEMPLATE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    head = _schema_head()
    if head is None:
        return None
    try:
        import mlflow
        import sqlalchemy

        versions = f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}-{head}"
    except Exception:
        return None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "keras-sync" / f"empty-store-{versions}.db"


def _copy_template(template: Path, tmp: Path) -> bool:
    """Copy the kept empty store into ``tmp``; False (and ``tmp`` left empty) if it is missing or not whole."""
    import shutil

    if not template.is_file() or _schema_state(template)[0] != _schema_head():
        return False
    try:
        shutil.copyfile(template, tmp)
    except OSError:
        tmp.write_bytes(b"")
        return False
    if _schema_state(tmp)[0] != _schema_head():  # changed under us: build instead
        tmp.write_bytes(b"")
        return False
    return True


def _keep_template(built: Path, template: Path) -> None:
    """Keep a copy of the store just built, without its Default experiment, as ``template`` (atomically;
    a cache that cannot be written is no error: the next store is built again)."""
    import shutil
    import sqlite3
    from contextlib import closing

    part = template.with_name(f".{template.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, part)
        with closing(sqlite3.connect(part)) as db, db:
            db.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(part, template)
    except (OSError, sqlite3.Error) as e:
        _log.debug("could not keep the empty MLflow store in %s: %s", template, e)
    finally:
        try:
            part.unlink()
        except OSError:  # gone (kept), or never made
            pass


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

    MLflow's engine retries a store it cannot open for ~110 s before it gives up with a generic
    error; the operating system says at once why (permission, disk full, read-only filesystem).
    """
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.unlink(tmp)  # only the probe: the builder makes the store itself
        # A full disk lets an empty file be created; the store needs room for its ~60 migrations.
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
