"""The private MLflow modules keras-sync reads (nothing here writes to a store): whether
``mlflow.keras.autolog()`` is on (no documented getter; refused in one line when it moved), the
schema revision of a new sqlite store (to wait for one another client is building, not migrate it
twice), and MLflow's SQL store imported with its mappers configured ahead (a head start).
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
