"""keras_sync.tracking.sql_metrics: the rows it writes are the rows MLflow's log_batch writes.

In-process against real sqlite stores (one per way), on every supported MLflow (compat lanes).
"""

from __future__ import annotations

import math
import sqlite3

import pytest

from keras_sync.tracking.deliver import RunSender
from keras_sync.tracking.records import BEGIN, METRICS, PARAMS
from keras_sync.tracking.sql_metrics import SqliteMetrics, sqlite_store_of

pytestmark = pytest.mark.compat


def _new_run(tmp_path, name):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / name}.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    return client, run_id, tmp_path / f"{name}.db"


def _rows(db):
    with sqlite3.connect(db) as con:
        cols = "key, value, timestamp, step, is_nan"
        return (
            sorted(con.execute(f"SELECT {cols} FROM metrics")),
            sorted(con.execute(f"SELECT {cols} FROM latest_metrics")),
        )


def _batches():
    """Points that exercise every rule of the stored rows and of a key's latest value."""
    from mlflow.entities import Metric

    special = [math.nan, math.inf, -math.inf, 0.0, -1e-300]
    out = []
    for b in range(3):
        batch = []
        for s in range(40):
            step = b * 40 + s
            batch.append(
                Metric("sync/loss/replica_0", 0.5 - step * 1e-3, 1_700_000_000_000 + step, step)
            )
            batch.append(Metric("odd", special[step % 5], 1_700_000_000_000 + step, step))
            # steps that go back down: the latest is the greatest step, not the last point sent
            batch.append(Metric("back", float(step), 1_700_000_000_000 + step, 500 - step))
            # one step, many timestamps and values (repeated within a batch, stored once): ties broken by
            # timestamp, then by value
            batch.append(
                Metric("same_step", float(step % 7), 1_700_000_000_000 + b * 3 + step % 3, 7)
            )
            batch.append(
                Metric("user metric-1.x/y", float(step), 1_700_000_000_000, step)
            )  # MLflow allows these
        out.append(batch)
    # A batch whose points are all older than the latest held: the latest rows must not move.
    out.append(
        [Metric("back", -5.0, 1_600_000_000_000, 0), Metric("sync/loss/replica_0", 9.0, 1, 3)]
    )
    return out


def test_rows_and_latest_values_are_those_of_mlflows_log_batch(tmp_path):
    mine, mine_run, mine_db = _new_run(tmp_path, "fast")
    theirs, theirs_run, theirs_db = _new_run(tmp_path, "mlflow")
    fast = SqliteMetrics(sqlite_store_of(mine))
    for batch in _batches():
        assert fast.log(mine_run, batch), "the one-statement path refused a valid batch"
        theirs.log_batch(theirs_run, metrics=batch)
    assert _rows(mine_db) == _rows(theirs_db)
    assert (
        fast.points == len(_rows(mine_db)[0]) < sum(len(b) for b in _batches())
    )  # repeats stored once
    # And MLflow reads them back as its own: history and the run's latest values agree too.
    for key in ("odd", "back", "same_step", "user metric-1.x/y"):
        a = [(m.step, m.timestamp, repr(m.value)) for m in mine.get_metric_history(mine_run, key)]
        b = [
            (m.step, m.timestamp, repr(m.value)) for m in theirs.get_metric_history(theirs_run, key)
        ]
        assert sorted(a) == sorted(b), key  # repr: NaN is not equal to itself
    assert repr(mine.get_run(mine_run).data.metrics) == repr(
        theirs.get_run(theirs_run).data.metrics
    )


def test_what_it_cannot_write_is_left_to_log_batch_with_nothing_written(tmp_path):
    from mlflow.entities import Metric

    client, run_id, db = _new_run(tmp_path, "s")
    fast = SqliteMetrics(sqlite_store_of(client))
    batch = [Metric("a", 1.0, 1_700_000_000_000, 1), Metric("b", 2.0, 1_700_000_000_000, 1)]
    assert fast.log(run_id, batch)
    before = _rows(db)
    # The same rows again (a replay): refused by the primary key, rolled back whole, still usable.
    assert not fast.log(run_id, batch + [Metric("c", 3.0, 1_700_000_000_000, 1)])
    assert _rows(db) == before and fast.usable
    # A key MLflow refuses: not written here; log_batch then raises MLflow's own error.
    assert not fast.log(run_id, [Metric("../bad", 1.0, 1_700_000_000_000, 2)]) and fast.usable
    assert _rows(db) == before
    # A finished run: MLflow's rule (a deleted run refuses) holds here too.
    client.delete_run(run_id)
    assert not fast.log(run_id, [Metric("a", 1.0, 1_700_000_000_000, 5)])
    assert _rows(db) == before


def test_moved_internals_make_it_step_aside_for_good(tmp_path):
    from mlflow.entities import Metric

    client, run_id, db = _new_run(tmp_path, "s")
    store = sqlite_store_of(client)
    fast = SqliteMetrics(store)
    fast.store = type(
        "Moved", (), {"sanitize_metric_value": store.sanitize_metric_value}
    )()  # no _get_run
    assert not fast.log(run_id, [Metric("a", 1.0, 1, 1)]) and not fast.usable
    assert _rows(db) == ([], [])


def test_only_a_sqlite_store_gets_it():
    class Http:
        class _tracking_client:
            store = object()

    assert sqlite_store_of(Http()) is None and sqlite_store_of(object()) is None


def test_the_courier_sends_metric_batches_this_way_and_the_rest_through_mlflow(tmp_path):
    sender = RunSender(f"sqlite:///{tmp_path / 'c.db'}", "exp", None, "job-1")
    points = [
        {
            "k": METRICS,
            "s": s,
            "ts": 1_700_000_000_000 + s,
            "d": {"loss": 1.0 / (s + 1), "acc": s / 10},
        }
        for s in range(30)
    ]
    assert sender.send([{"k": BEGIN, "ts": 1_700_000_000_000}, *points]) == 60
    assert sender._sql is not None and sender._sql.points == 60
    # Params ride in the same batch as the points beside them: that batch goes through log_batch.
    last = {"k": METRICS, "s": 30, "ts": 1_700_000_000_030, "d": {"loss": 0.1}}
    assert sender.send([{"k": PARAMS, "d": {"lr": "0.1"}}, last]) == 1 and sender._sql.points == 60
    run = sender.client().get_run(sender.run_id)
    assert run.data.params == {"lr": "0.1"} and run.data.metrics == {"loss": 0.1, "acc": 2.9}
    assert [m.step for m in sender.client().get_metric_history(sender.run_id, "acc")] == list(
        range(30)
    )
