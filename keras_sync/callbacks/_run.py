"""The MLflow writer of a `Sync`: one run per job, opened by the chief only.

One writer per `Sync` object, kept across `fit` calls (one run, steps continue). Its job id
(see `_reduce.job_id`) makes a restarted job continue the same run. The run ends when the
process exits (the writer's `atexit` close) or with `close_writer(sync)`.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from keras_sync.callbacks import _reduce
from keras_sync.errors import TrackingError

log = logging.getLogger("keras_sync")
_writers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def writer_for(sync: Any) -> Any:
    """The started `MlflowWriter` of ``sync`` on the chief; None on other workers."""
    if not sync.is_chief:
        return None
    writer = _writers.get(sync)
    if writer is not None:
        return writer
    from keras_sync.tracking import MlflowWriter, redact_uri, resolve_tracking_uri

    cfg = sync.config.mlflow
    uri, _ = resolve_tracking_uri(cfg.tracking_uri, environ={})  # config.py already folded in the env
    jid = _reduce.job_id(os.environ, experiment=cfg.experiment, backup_dir=sync.config.fault_tolerance.backup_dir)
    try:
        writer = MlflowWriter(tracking_uri=uri, experiment=cfg.experiment, run_name=cfg.run_name, job_id=jid)
    except TrackingError as exc:
        if jid is not None and os.environ.get(_reduce.JOB_ID_ENV):
            raise TrackingError(f"Invalid value for ${_reduce.JOB_ID_ENV}. Received: {jid!r}. Expected 1-250 "
                                "letters, digits or `_.:/@+-`; fix or unset it.") from None
        raise exc
    writer.start()
    log.info("keras-sync: logging sync metrics to MLflow at %s, experiment %r%s", redact_uri(uri),
             cfg.experiment, f", job id {jid}" if jid else "")
    _writers[sync] = writer
    return writer


def close_writer(sync: Any, timeout_s: float = 10.0) -> None:
    """End the MLflow run of ``sync`` now (FINISHED), waiting at most ``timeout_s`` for delivery."""
    writer = _writers.pop(sync, None)
    if writer is not None:
        writer.close(timeout_s=timeout_s)
