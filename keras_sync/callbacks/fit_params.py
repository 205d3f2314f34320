"""`FitParams`: what `mlflow.keras.autolog()` records about a `fit`, logged through the keras-sync writer."""

from __future__ import annotations

from typing import Any

from keras_sync.callbacks._once import OncePerRun
from keras_sync.tracking import autolog as _autolog
from keras_sync.tracking.source_tags import source_tags
from keras_sync.training.instrument import applied_optimizers, has_default_train_step

MODEL_SUMMARY_ARTIFACT = "model_summary.txt"


class FitParams(OncePerRun):
    """Log, at the start of a `fit`, what autolog would (unless autolog is on).

    Params ``epochs``, ``steps_per_epoch``, ``batch_size`` (global), ``per_replica_batch_size``
    and ``optimizer_<key>`` for the optimizer's config (``<attribute>_<key>`` for each optimizer
    a custom `train_step` applies, after its first step); the artifact ``model_summary.txt``; the
    tags MLflow's `start_run` sets (``mlflow.user``, ``mlflow.source.*``).

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter` (None: do nothing).
        per_replica_batch_size: examples per replica per step (None: not logged).
        num_replicas: replicas in sync; default: the model's strategy.
        shared: the `keras_sync.callbacks.SharedState` of this fit: a later fit of the job sends
            only the params that changed, as ``fit_<n>.<key>`` (default: its own, a first fit).
    """

    def __init__(
        self,
        writer: Any = None,
        *,
        per_replica_batch_size: int | None = None,
        num_replicas: int | None = None,
        shared: Any = None,
    ):
        super().__init__(writer, shared=shared)
        self.per_replica_batch_size = per_replica_batch_size
        self.num_replicas = num_replicas
        self._optimizers_pending = False  # a custom train_step: known after its first step

    def log_once(self) -> None:
        self.writer.set_tags(source_tags())
        batch = self.per_replica_batch_size
        params: dict[str, Any] = {} if batch is None else {"per_replica_batch_size": batch}
        if _autolog.keras_autolog_active():
            self.log_params(params)
            return
        if batch is not None:
            replicas = self.num_replicas or self.model.distribute_strategy.num_replicas_in_sync
            params["batch_size"] = batch * int(replicas)
        params.update(epochs=self.params.get("epochs"), steps_per_epoch=self.params.get("steps"))
        self._optimizers_pending = not has_default_train_step(self.model)
        if not self._optimizers_pending:
            params.update(_config_params([("optimizer", self.model.optimizer)]))
        lines: list[str] = []  # model.summary() as text, line for line as autolog stores it
        self.model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
        self.writer.log_text_artifact("\n".join(lines), MODEL_SUMMARY_ARTIFACT)
        self.log_params(params)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._optimizers_pending:
            self._optimizers_pending = False
            applied = applied_optimizers(self.model) or [("optimizer", self.model.optimizer)]
            if len(applied) == 1:  # one: optimizer_<key>; several: <attribute>_<key> for each
                applied = [("optimizer", applied[0][1])]
            self.log_params(_config_params(applied))


def _config_params(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """``<name>_<key>`` for each key of each named optimizer's config (None: no optimizer)."""
    return {
        f"{name}_{k}": v for name, o in named if o is not None for k, v in o.get_config().items()
    }
