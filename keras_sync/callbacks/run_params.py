"""`RunParams`: at a fit's start, the distributed setup and the config as MLflow params, the config file as artifact."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
import yaml

from keras_sync.callbacks._once import OncePerRun
from keras_sync.errors import UsageError
from keras_sync.tracking import redact_uri
from keras_sync.training.context import RunContext

#: Tag naming where the config came from (a file path, ``<dict>`` or ``<defaults>``).
CONFIG_SOURCE_TAG = "keras_sync.config_source"
CONFIG_ARTIFACT = "keras_sync/config.yaml"
#: A relaunch continuing the run has another job id, and MLflow refuses to change a param.
_NOT_PARAMS = ("config.mlflow.job_id",)


class RunParams(OncePerRun):
    """Log the training setup once, at the start of the first `fit` this callback sees.

    Params ``sync.*`` (the context's facts, versions, devices) and, with a context,
    ``config.<key path>`` for every resolved value but ``mlflow.job_id``; the config text as the
    artifact ``keras_sync/config.yaml``, its path as the tag ``keras_sync.config_source``
    (credentials in URIs replaced by ``***``).

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter` (None: do nothing).
        context: the `keras_sync.callbacks.RunContext` of this run (`Sync.context()`; a `Sync`
            is read the same way when training starts), or None when calling `model.fit`
            without keras-sync's config.
        shared: the `keras_sync.callbacks.SharedState` of this fit: a later fit of the job sends
            only the params that changed, as ``fit_<n>.<key>`` (default: its own, a first fit).
    """

    def __init__(self, writer: Any = None, context: Any = None, *, shared: Any = None):
        super().__init__(writer, shared=shared)
        if not (context is None or isinstance(context, RunContext) or hasattr(context, "context")):
            raise UsageError(
                f"Invalid value for argument `context`. Received: context={type(context).__name__}. "
                "Expected a keras_sync.callbacks.RunContext (sync.context()), a keras_sync.Sync, or None."
            )
        self.context = context

    def log_once(self) -> None:
        # A Sync is read now: steps_per_epoch is known once fit has its data.
        ctx = self.context
        if ctx is not None and not isinstance(ctx, RunContext):
            ctx = ctx.context()
        strategy = self.model.distribute_strategy
        try:
            devices = list(strategy.extended.worker_devices)
        except (RuntimeError, AttributeError):  # the default strategy has no replica devices
            kinds = ("CPU", "GPU", "TPU")
            logical = [d.name for d in tf.config.list_logical_devices() if d.device_type in kinds]
            devices = logical[:1]
        params: dict[str, Any] = {
            "sync.num_replicas": int(strategy.num_replicas_in_sync),
            "sync.tensorflow_version": tf.version.VERSION,
            "sync.keras_version": keras.version(),
            "sync.devices": ",".join(devices) or "unknown",
            **({"sync.strategy": type(strategy).__name__} if ctx is None else ctx.params()),
        }
        config = None if ctx is None else ctx.config
        if config is None:
            self.log_params(params)
            return
        params.update(_flat(config.to_dict(), "config."))
        self.log_params({k: v for k, v in params.items() if k not in _NOT_PARAMS})
        text = config.text
        if text is None:  # a dict or the defaults: store the resolved config instead
            text = yaml.safe_dump(config.to_dict(), sort_keys=False)
        self.writer.set_tags({CONFIG_SOURCE_TAG: str(config.source)})
        self.writer.log_text_artifact(redact_uri(text) or "", CONFIG_ARTIFACT)


def _flat(data: dict[str, Any], prefix: str) -> dict[str, str]:
    """The resolved config, one param per key: ``{"config.batch.per_replica": "32", ...}``."""
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        out[f"{prefix}{key}"] = redact_uri("null" if value is None else text) or ""
    return out
