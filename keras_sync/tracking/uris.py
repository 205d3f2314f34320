"""The tracking URI a run goes to, and the page of a run on a tracking server."""

from __future__ import annotations

import os
from pathlib import Path

from keras_sync.tracking.records import is_http
from keras_sync.tracking.redact import redact_uri


def resolve_tracking_uri(
    configured: str | None, *, cwd: str | os.PathLike[str] | None = None
) -> tuple[str, str]:
    """Fill in MLflow's default tracking URI when the config has none.

    The one precedence rule (flag > ``$MLFLOW_TRACKING_URI`` > YAML > default) is applied by
    `keras_sync.config.load_config`; this only adds the last step: MLflow 3's own default,
    ``sqlite:///<cwd>/mlflow.db``. Returns ``(uri, "config")`` or ``(uri, "default")``.
    """
    if configured:
        return configured, "config"
    base = Path(cwd) if cwd is not None else Path.cwd()
    return f"sqlite:///{base.resolve() / 'mlflow.db'}", "default"


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str) -> str | None:
    """The MLflow UI page of a run on a tracking server (credentials removed); None for a local store."""
    if not is_http(tracking_uri) or experiment_id is None:
        return None
    base = str(redact_uri(tracking_uri)).split("?", 1)[0].rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
