"""A fresh sqlite store is created whole or not at all, whenever its creator is killed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from keras_sync.errors import TrackingError
from keras_sync.tracking import sqlite_store
from keras_sync.tracking.sqlite_store import ensure_sqlite_store, sqlite_path

_ENSURE = "import sys; from keras_sync.tracking.sqlite_store import ensure_sqlite_store; print(ensure_sqlite_store(sys.argv[1]))"


def _schema(path: Path) -> tuple[set[str], str]:
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        version = db.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    return tables, version


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "keras-sync-creating" in p.name)


def test_sqlite_path_of_uris(tmp_path: Path) -> None:
    assert sqlite_path(f"sqlite:///{tmp_path}/a.db") == tmp_path / "a.db"
    assert sqlite_path("sqlite:///rel/a.db?mode=rw") == Path("rel/a.db")
    assert sqlite_path("postgresql://u:p@h/db") is None


def test_missing_folder_is_one_clear_error(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/nope/mlflow.db"
    with pytest.raises(
        TrackingError, match=r"its folder '.*nope' does not exist. Create the folder"
    ):
        ensure_sqlite_store(uri)


def test_existing_file_is_left_alone(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    os.utime(
        db, (0, 0)
    )  # not being written (a file that changes is waited for: see the in-place test)
    assert ensure_sqlite_store(f"sqlite:///{db}") is False
    assert db.read_bytes() == b""


@pytest.mark.slow
def test_kill_at_any_moment_leaves_no_store_or_a_whole_one(tmp_path: Path) -> None:
    reference = tmp_path / "reference.db"
    assert ensure_sqlite_store(f"sqlite:///{reference}") is True
    want = _schema(reference)
    assert {"experiments", "runs", "metrics", "webhooks"} <= want[0]

    folder = tmp_path / "kills"
    folder.mkdir()
    target = folder / "mlflow.db"
    outcomes = []
    # Kill the creator and its builder (the whole process group) across the build window.
    for delay_s in (0.2, 0.6, 1.0, 1.5, 2.2, 3.0, 4.5):
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENSURE, f"sqlite:///{target}"],
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            proc.wait(timeout=delay_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if target.exists():
            assert _schema(target) == want, f"half-built store after a kill at {delay_s} s"
            outcomes.append("whole")
            target.unlink()
        else:
            outcomes.append("none")
    assert "none" in outcomes  # the kills did land while the store was being built

    # Whatever the kills left behind, the next client gets a whole store and no leftovers remain.
    ensure_sqlite_store(f"sqlite:///{target}")
    assert _schema(target) == want
    assert _leftovers(folder) == []


@pytest.mark.slow
def test_two_creators_at_once_publish_one_store(tmp_path: Path) -> None:
    target = tmp_path / "mlflow.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENSURE, f"sqlite:///{target}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert results == ["False", "True"]
    tables, _ = _schema(target)
    assert "webhooks" in tables
    assert _leftovers(tmp_path) == []


def test_a_folder_that_refuses_the_store_is_named_with_its_cause_at_once(tmp_path: Path) -> None:
    # MLflow's engine retried such a store for ~110 s, then failed without the cause.
    import time

    from _mounts import tmpfs

    with tmpfs(tmp_path / "ro", read_only=True) as ro, tmpfs(tmp_path / "full", size="8k") as full:
        t0 = time.monotonic()
        with pytest.raises(
            TrackingError,
            match=r"cannot be created in '.*ro': Read-only file system \(errno EROFS\)",
        ):
            ensure_sqlite_store(f"sqlite:///{ro}/mlflow.db")
        with pytest.raises(
            TrackingError, match=r"cannot be created in '.*full': No space left on device"
        ):
            ensure_sqlite_store(f"sqlite:///{full}/mlflow.db")
        assert time.monotonic() - t0 < 10  # no child process, no MLflow: the OS says it at once
        assert _leftovers(full) == [] and list(full.iterdir()) == []


_MLFLOW_BUILDS_IN_PLACE = """
import sys
from mlflow import MlflowClient
MlflowClient(tracking_uri=sys.argv[1]).search_experiments(max_results=1)
print("built", flush=True)
"""


@pytest.mark.slow
def test_a_store_mlflow_builds_in_place_meanwhile_is_waited_for_not_migrated_twice(
    tmp_path: Path,
) -> None:
    """A user's own MlflowClient (made before fit, as scripts do) builds the store in place, in ~60
    migrations, while the courier opens it: the courier waits for the schema's last migration instead
    of running the migrations a second time beside it (CI: "table _alembic_tmp_model_version_tags
    already exists", the run lost)."""
    import time

    from mlflow import MlflowClient

    target = tmp_path / "mlflow.db"
    uri = f"sqlite:///{target}"
    user = subprocess.Popen(
        [sys.executable, "-c", _MLFLOW_BUILDS_IN_PLACE, uri],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not target.exists() and user.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert target.exists() and user.poll() is None, "the user's client did not start building"
        assert (
            ensure_sqlite_store(uri) is False
        )  # not ours to build: it waits for the one being built
        experiments = MlflowClient(tracking_uri=uri).search_experiments()
        assert [e.name for e in experiments] == ["Default"]
    finally:
        out, err = user.communicate(timeout=300)
    assert user.returncode == 0 and out.strip() == "built", err[-2000:]
    assert _schema(target)[1] == _schema_head()


def _schema_head() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def test_a_store_below_the_head_that_nobody_writes_is_left_to_mlflow_at_once(
    tmp_path: Path,
) -> None:
    """An older MLflow's store (or a half-built one whose builder died) is not waited for: MLflow
    then names what it finds ("out-of-date database schema"), without keras-sync's wait before it."""
    import time

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        con.execute("INSERT INTO alembic_version VALUES ('0123456789ab')")
    os.utime(db, (time.time() - 3600, time.time() - 3600))
    t0 = time.monotonic()
    assert ensure_sqlite_store(f"sqlite:///{db}") is False
    assert (
        time.monotonic() - t0 < sqlite_store._SETTLED_S * 0.75
    )  # not the wait for a store being built
    assert _schema(db)[1] == "0123456789ab"  # left as it was


def _tables_and_rows(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {n: db.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}


def test_a_created_store_is_used_by_mlflow_like_one_it_built_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store MLflow's client built under a private name and linked into place: its Default
    experiment lies where MLflow puts it for a store opened from there, and runs work in it."""
    from mlflow import MlflowClient

    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    first.parent.mkdir()
    second.parent.mkdir()
    monkeypatch.chdir(first.parent)
    MlflowClient(tracking_uri=f"sqlite:///{first}").search_experiments()  # MLflow's own, in place
    monkeypatch.chdir(second.parent)
    assert ensure_sqlite_store(f"sqlite:///{second}") is True
    assert _schema(second) == _schema(first)
    client = MlflowClient(tracking_uri=f"sqlite:///{second}")
    (default,) = client.search_experiments()
    assert (default.experiment_id, default.name) == ("0", "Default")
    assert default.artifact_location == str(
        second.parent / "mlruns" / "0"
    )  # where MLflow puts it for this store
    exp = client.create_experiment("x")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "loss", 0.5, step=3)
    assert exp == "1" and [
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")
    ] == [(3, 0.5)]
    assert set(_tables_and_rows(second)) == set(_tables_and_rows(first))
    assert _leftovers(second.parent) == []


_WARM = """
import json, os, sys
from keras_sync.tracking.sqlite_store import warm_up
uri, watched = sys.argv[1], sys.argv[2:]
before = {d: sorted(os.listdir(d)) for d in watched}
done = warm_up(uri)
out = {"touched": [d for d in watched if sorted(os.listdir(d)) != before[d]], "done": done,
       "sql_store": "mlflow.store.tracking.sqlalchemy_store" in sys.modules}
from mlflow.store.tracking.dbmodels.models import SqlMetric  # the models only, not the store module
out["mapped"] = bool(SqlMetric.__mapper__.configured)
fds = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
out["open"] = [p for p in map(lambda f: os.readlink(f) if os.path.islink(f) else "", fds) if "keras-sync" in p]
out["env"] = [k for k in ("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "MLFLOW_DISABLE_TELEMETRY") if k in os.environ]
print(json.dumps(out))
"""


def test_the_warm_up_does_a_sql_stores_first_open_costs_before_it_and_touches_no_file(
    tmp_path: Path,
) -> None:
    # The courier warms up while TensorFlow is imported; the first delivery is left the store's own
    # work (MLflow's SQL store module and SQLAlchemy's mappers are ready by then).
    folder, cache, tmp = tmp_path / "store", tmp_path / "cache", tmp_path / "tmp"
    for d in (folder, cache, tmp):
        d.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "TMPDIR": str(tmp)}
    sqlite = f"sqlite:///{folder}/mlflow.db"
    cases = [
        (sqlite, True, ["mlflow", "sql store", "schema head"]),
        ("mysql+pymysql://u:pw@127.0.0.1:9/db", True, ["mlflow", "sql store"]),
        ("http://127.0.0.1:9", False, ["mlflow"]),
    ]
    for uri, sql, done in cases:
        got = subprocess.run(
            [sys.executable, "-c", _WARM, uri, str(folder), str(cache), str(tmp)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert got.returncode == 0, (uri, got.stderr[-2000:])
        out = __import__("json").loads(got.stdout.strip().splitlines()[-1])
        # No file made or held open, no setting of MLflow's left in the environment.
        assert out == {
            "touched": [],
            "done": done,
            "sql_store": sql,
            "mapped": sql,
            "open": [],
            "env": [],
        }, (uri, out)
        assert "INFO" not in got.stderr, got.stderr[
            -2000:
        ]  # e.g. MLflow's "Create SQLAlchemy engine with ..."
