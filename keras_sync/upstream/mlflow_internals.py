"""The private MLflow modules keras-sync reads, never writes: whether ``mlflow.keras.autolog()``
is on (no documented getter), the schema revision of a new sqlite store (not migrated twice), and
MLflow's SQL store imported ahead."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from keras_sync.upstream import internals as _internals


def autologging() -> Any:
    """MLflow's autologging module, checked to have the three functions keras-sync calls."""
    _internals.require("autolog_state")
    return importlib.import_module("mlflow.utils.autologging_utils")


@functools.lru_cache(maxsize=1)
def schema_head() -> str | None:
    """The schema revision this MLflow builds sqlite stores at, or None when it does not say."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return str(_get_latest_schema_revision())
    except Exception:
        return None


def preload_sql_store(uri: str) -> bool:
    """Import MLflow's SQL store and configure its mappers if ``uri`` is a database MLflow serves
    with it; True if done. Opens nothing."""
    try:
        from mlflow.store.db.db_types import DATABASE_ENGINES

        if "://" not in uri or uri.split(":", 1)[0].split("+", 1)[0] not in DATABASE_ENGINES:
            return False
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        from sqlalchemy.orm import configure_mappers

        configure_mappers()
    except Exception:
        return False
    return True
