"""`RunParams`: once per run, the distributed setup as MLflow params, and the config as tags and artifact."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.callbacks import _reduce
from keras_sync.tracking import redact_uri

#: Tag holding the config file's text (scrubbed of secrets by the writer as well).
CONFIG_TAG = "keras_sync.config"
CONFIG_SOURCE_TAG = "keras_sync.config_source"
CONFIG_ARTIFACT = "keras_sync/config.yaml"


class RunParams(keras.callbacks.Callback):
    """Log the training setup once, at the start of the first `fit`.

    Params: ``sync.strategy``, ``sync.num_replicas``, ``sync.num_workers``,
    ``sync.per_replica_batch_size``, ``sync.global_batch_size``, ``sync.gradient_accumulation_steps``,
    ``sync.effective_batch_size``, ``sync.base_learning_rate``,
    ``sync.learning_rate``, ``sync.lr_scaling``, ``sync.warmup_steps`` (from ``sync`` when given,
    else what the model's strategy tells), ``sync.tensorflow_version``, ``sync.keras_version``
    and ``sync.devices`` (this worker's replica devices). With a `Sync` built from a YAML file,
    the file's text becomes the tag ``keras_sync.config`` and the artifact
    ``keras_sync/config.yaml``, with credentials in URIs replaced by ``***``.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter` (None: do nothing).
        sync: the `keras_sync.Sync` of this run, or None when calling `model.fit` without one.
    """

    def __init__(self, writer: Any = None, sync: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_params")
        self.writer = writer
        self.sync = sync
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.writer is None or self._done:
            return
        self._done = True
        self.writer.log_params(run_params(self.model, self.sync))
        tags, text = config_tags(self.sync)
        if tags:
            self.writer.set_tags(tags)
        if text is not None:
            self.writer.log_text_artifact(text, CONFIG_ARTIFACT)


def run_params(model: Any, sync: Any = None) -> dict[str, Any]:
    """The ``sync.*`` params of a run, from ``sync`` if given, else from the model's strategy."""
    import tensorflow as tf

    strategy = sync.strategy if sync is not None else model.distribute_strategy
    try:
        devices = list(strategy.extended.worker_devices)
    except (RuntimeError, AttributeError):  # the default strategy has no replica devices
        devices = [d.name for d in tf.config.list_logical_devices() if d.device_type in ("CPU", "GPU", "TPU")][:1]
    params: dict[str, Any] = {
        "sync.num_replicas": int(strategy.num_replicas_in_sync),
        "sync.tensorflow_version": tf.version.VERSION,
        "sync.keras_version": keras.version(),
        "sync.devices": ",".join(devices) or "unknown",
    }
    if sync is None:
        params["sync.strategy"] = type(strategy).__name__
        return params
    steps = getattr(sync, "_steps_per_epoch", None)
    try:
        warmup = sync.warmup_steps(steps)
    except Exception:  # noqa: BLE001 - warmup in epochs with an unknown epoch length
        warmup = "unknown"
    params.update({
        "sync.strategy": sync.kind,
        "sync.num_workers": sync.num_workers,
        "sync.per_replica_batch_size": sync.per_replica_batch_size,
        "sync.global_batch_size": sync.global_batch_size,
        "sync.gradient_accumulation_steps": sync.gradient_accumulation_steps,
        "sync.effective_batch_size": sync.effective_batch_size,
        "sync.base_learning_rate": sync.base_learning_rate,
        "sync.learning_rate": sync.learning_rate,
        "sync.lr_scaling": sync.config.learning_rate.scaling,
        "sync.warmup_steps": warmup,
    })
    return params


def config_tags(sync: Any) -> tuple[dict[str, str], str | None]:
    """Tags describing the config, and the text to store as artifact (None when there is no file)."""
    if sync is None:
        return {}, None
    cfg = sync.config
    text = cfg.text
    if text is None:  # a dict or the defaults: store the resolved config instead
        import yaml

        text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    text = redact_uri(text) or ""
    return {CONFIG_SOURCE_TAG: str(cfg.source), CONFIG_TAG: text}, text
