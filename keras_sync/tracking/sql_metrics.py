"""Metric points into an MLflow sqlite store in one statement, as MLflow's own `log_batch` stores them.

MLflow's SQL store turns every point of a `log_batch` into an ORM object and flushes them one by
one: measured 55-65 us of CPU per point in a quiet process and ~130 us in the courier beside a
training process (MLflow 3.17, sqlite), so logging every step of a fast model (~11 points a step)
cost the courier more CPU than a third of the training's. This writes the same rows with one
``INSERT`` of many rows through MLflow's own table definitions and engine, and keeps
``latest_metrics`` as MLflow does (a key's latest is the greatest (step, timestamp, value)):
measured 9-10 us a point.

It is used only for a batch of metric points alone (no params, no tags) to a ``sqlite:`` store,
after MLflow's own validation of the batch; it relies on MLflow internals that have been stable
since MLflow 1.x (`SqlMetric`, `SqlLatestMetric`, the store's session maker). Whatever it cannot
do (a row that is already there, a store of another kind, an MLflow whose internals moved)
returns ``False`` with nothing written, and the caller sends the batch with `log_batch`. A test
compares the rows both ways on the oldest and newest supported MLflow (``tests/test_sql_metrics.py``).
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger("keras_sync.tracking")


def sqlite_store_of(client: Any) -> Any:
    """The `SqlAlchemyStore` behind ``client`` if it is a sqlite one, else None."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if type(store).__name__ != "SqlAlchemyStore" or getattr(store, "db_type", None) != "sqlite":
        return None
    return store


class SqliteMetrics:
    """Writes metric points to one sqlite store (see the module's docstring).

    `log` returns False (nothing written) when the batch must go through `log_batch`; after an
    error of Python rather than of the data or the store (MLflow's internals moved), it stops
    trying for the rest of the process.
    """

    def __init__(self, store: Any) -> None:
        from keras_sync.upstream import internals

        self.store = store
        self.usable = internals.available(
            internals.SQLITE_METRICS
        )  # probed once: the shapes relied on
        self.points = 0  # written by this path (tests read it)

    def log(self, run_id: str, metrics: list[Any]) -> bool:
        if not self.usable or not metrics:
            return False
        try:
            from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
            from mlflow.utils.validation import _validate_batch_log_data

            _validate_batch_log_data(metrics, [], [])  # MLflow's own checks of keys, values, steps
        except Exception as e:
            return self._fall_back(e)
        rows: list[dict[str, Any]] = []
        latest: dict[str, dict[str, Any]] = {}
        sanitize = self.store.sanitize_metric_value  # NaN -> (True, 0); +-inf -> +-max float
        seen: set[Any] = set()
        for m in metrics:
            if (
                m in seen
            ):  # a point sent twice in one batch is stored once, as MLflow does (Metric's ==)
                continue
            seen.add(m)
            is_nan, value = sanitize(m.value)
            row = {
                "run_uuid": run_id,
                "key": m.key,
                "value": value,
                "timestamp": m.timestamp,
                "step": m.step,
                "is_nan": is_nan,
            }
            rows.append(row)
            now = latest.get(m.key)
            if now is None or (m.step, m.timestamp, value) > (
                now["step"],
                now["timestamp"],
                now["value"],
            ):
                latest[m.key] = row
        try:
            with self._session() as session:
                run = self.store._get_run(run_uuid=run_id, session=session)
                self.store._check_run_is_active(
                    run
                )  # a deleted or finished-and-locked run refuses, as in MLflow
                session.execute(SqlMetric.__table__.insert(), rows)
                held = {
                    m.key: m
                    for m in session.query(SqlLatestMetric)
                    .filter(
                        SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.key.in_(sorted(latest))
                    )
                    .with_for_update()
                }
                for key, row in latest.items():
                    old = held.get(key)
                    if old is None:
                        session.add(SqlLatestMetric(**row))
                    elif (row["step"], row["timestamp"], row["value"]) > (
                        old.step,
                        old.timestamp,
                        old.value,
                    ):
                        old.value, old.step, old.timestamp, old.is_nan = (
                            row["value"],
                            row["step"],
                            row["timestamp"],
                            row["is_nan"],
                        )
        except Exception as e:
            return self._fall_back(e)
        self.points += len(rows)
        return True

    def _fall_back(self, e: BaseException) -> bool:
        """Nothing was written: the caller uses log_batch. If MLflow's internals moved (an error of
        Python, not of the data or the store), stop trying for the rest of the process."""
        chain = [
            e,
            e.__cause__,
            e.__context__,
        ]  # MLflow's session wraps what it caught in an MlflowException
        if any(isinstance(x, (AttributeError, TypeError, ImportError, NameError)) for x in chain):
            self.usable = False
        _log.debug("keras-sync: metric points go through MLflow's log_batch: %r", e)
        return False

    def _session(self) -> Any:
        try:
            return self.store.ManagedSessionMaker(
                read_only=False
            )  # MLflow 3: sessions are read-only by default
        except TypeError:  # MLflow 2: no such argument
            return self.store.ManagedSessionMaker()
