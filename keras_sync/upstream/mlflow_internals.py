"""The private MLflow modules keras-sync reads, each behind a probe.

MLflow has no public API for three things keras-sync asks of it:

- whether ``mlflow.keras.autolog()`` is on, its ``log_models`` setting, and turning it off for a
  block (`mlflow.utils.autologging_utils`; MLflow documents no getter for autolog's state): needed
  so one run holds both, and so no worker other than the chief opens a run of its own. When the probe
  fails, `autologging` raises `CompatibilityError` in one line, and only for a process that has
  imported ``mlflow.keras`` (autolog imports it).
- the schema revision a new sqlite store is built at (`mlflow.store.db.utils`), to wait for a store
  that another client is building in place rather than migrate it a second time beside it. Without
  it, a store is used as found.
- importing the SQL store and configuring its ORM mappers ahead of the first query
  (`mlflow.store.tracking.sqlalchemy_store`, `mlflow.store.db.db_types`): a head start only.

Nothing here writes to a store.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from keras_sync.errors import CompatibilityError
from keras_sync.upstream.internals import PIN

_AUTOLOG = "mlflow.utils.autologging_utils"
_AUTOLOG_NAMES = ("autologging_is_disabled", "get_autologging_config", "disable_autologging")


def autologging() -> Any:
    """MLflow's autologging module, checked to have the three functions keras-sync calls."""
    try:
        module = importlib.import_module(_AUTOLOG)
        missing = [n for n in _AUTOLOG_NAMES if not callable(getattr(module, n, None))]
    except ImportError as e:
        missing = [f"{_AUTOLOG} ({e})"]
    if missing:
        import mlflow

        raise CompatibilityError(
            f"keras-sync cannot tell whether mlflow.keras.autolog() is on with MLflow "
            f"{mlflow.__version__} ({_AUTOLOG} has no {', '.join(missing)}). "
            f"Fix: {PIN['mlflow']}, or do not turn autolog on beside keras-sync."
        )
    return module


@functools.lru_cache(maxsize=1)
def schema_head() -> str | None:
    """The schema revision this MLflow builds sqlite stores at, or None when it does not say."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return str(_get_latest_schema_revision())
    except Exception:
        return None


def preload_sql_store(uri: str) -> bool:
    """Import MLflow's SQL store and configure its mappers if ``uri`` is one MLflow serves with it
    (``sqlite:``, ``postgresql:``, ``mysql+pymysql:`` ...); True if done. Opens nothing."""
    try:
        from mlflow.store.db.db_types import DATABASE_ENGINES
    except ImportError:
        return False
    if "://" not in uri or uri.split(":", 1)[0].split("+", 1)[0] not in DATABASE_ENGINES:
        return False
    try:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        from sqlalchemy.orm import configure_mappers

        configure_mappers()
    except Exception:
        return False
    return True
