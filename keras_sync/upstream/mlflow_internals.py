"""The private MLflow modules keras-sync reads, never writes: whether ``mlflow.keras.autolog()``
is on (no documented getter), the schema revision of a new sqlite store (not migrated twice), and
MLflow's SQL store imported ahead."""

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
            f"keras-sync cannot tell whether mlflow.keras.autolog() is on with MLflow {mlflow.__version__}: "
            f"{_AUTOLOG} has no {', '.join(missing)}. Fix: {PIN['mlflow']}, or leave autolog off."
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
    """Import MLflow's SQL store and configure its mappers if ``uri`` is a database MLflow serves
    with it; True if done. Opens nothing."""
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
