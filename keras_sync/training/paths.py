"""Directories keras-sync writes, checked before training: one line naming the key, not a traceback
at step 50. No TensorFlow, Keras or MLflow here."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from keras_sync.errors import UsageError


def check_writable(path: str | os.PathLike[str], key: str, value: str | None = None) -> None:
    """Refuse in one line a ``path`` (or its nearest existing parent) this process cannot write."""
    shown = os.fspath(path) if value is None else value
    path = existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, "Not a directory", existing)
        os.rmdir(tempfile.mkdtemp(prefix=".keras_sync_write_check_", dir=existing))
    except OSError as e:
        it = "it" if value is None else f"its folder {path}"
        what = f"write {it}" if existing == path else f"create {it} in {existing}"
        msg = f"{key}={shown!r}: this process cannot {what} ({e.strerror}). Fix: choose a directory it can write, or give it write permission there; nothing was trained."
        raise UsageError(msg) from None


def check_config_paths(config: Any, *, is_chief: bool) -> None:
    """Every directory training will write: the backup (all), spool and local store (chief)."""
    if config.fault_tolerance.backup_dir:
        check_writable(config.fault_tolerance.backup_dir, "fault_tolerance.backup_dir")
    if not (is_chief and config.mlflow.enabled):
        return
    check_writable(config.mlflow.spool_dir, "mlflow.spool_dir")
    from keras_sync.tracking import resolve_tracking_uri

    uri, _ = resolve_tracking_uri(config.mlflow.tracking_uri)
    db = uri.removeprefix("sqlite:///").split("?", 1)[0] if uri.startswith("sqlite:///") else ""
    if db and db != ":memory:":
        check_writable(os.path.dirname(os.path.abspath(db)), "mlflow.tracking_uri", uri)
