"""`FitParams`: what `mlflow.keras.autolog()` records about a `fit`, logged through the keras-sync writer."""

from __future__ import annotations

from typing import Any

from keras_sync.callbacks._once import OncePerRun
from keras_sync.tracking import autolog as _autolog
from keras_sync.tracking.source_tags import source_tags

MODEL_SUMMARY_ARTIFACT = "model_summary.txt"
#: Params that mlflow.keras.autolog() logs itself (under the same names) when it is on.
AUTOLOG_PARAMS = ("epochs", "steps_per_epoch", "batch_size")


class FitParams(OncePerRun):
    """Log, at the start of a `fit`, what autolog would.

    - params ``epochs``, ``steps_per_epoch`` (None when the data does not tell), ``batch_size``
      (the global batch, as autolog logs it) and ``per_replica_batch_size``;
    - ``optimizer_name`` and every entry of the optimizer's config as ``optimizer_<key>``. A
      custom `train_step` that applies other optimizers (a GAN's ``d_optimizer``) gets those, as
      ``<attribute>_<key>``, after its first step (when the trace has shown which apply);
    - the artifact ``model_summary.txt``;
    - the tags MLflow's `start_run` sets (``mlflow.user``, ``mlflow.source.*``).

    With ``mlflow.keras.autolog()`` on, autolog logs the fit arguments, optimizer and summary
    into the same run, so they are left out here (MLflow params are immutable).

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

    def log_once(self) -> None:
        autolog = _autolog.keras_autolog_active()
        self.writer.set_tags(source_tags())
        params: dict[str, Any] = {}
        if self.per_replica_batch_size is not None:
            replicas = self.num_replicas or int(self.model.distribute_strategy.num_replicas_in_sync)
            params["per_replica_batch_size"] = self.per_replica_batch_size
            params["batch_size"] = self.per_replica_batch_size * replicas
        params["epochs"] = self.params.get("epochs")
        params["steps_per_epoch"] = self.params.get("steps")
        if autolog:
            params = {k: v for k, v in params.items() if k not in AUTOLOG_PARAMS}
        else:
            from keras_sync.training.instrument import has_default_train_step

            if has_default_train_step(self.model):
                params.update(optimizer_params(self.model.optimizer))
            else:
                self._optimizers_pending = True
            self.writer.log_text_artifact(model_summary(self.model), MODEL_SUMMARY_ARTIFACT)
        self.log_params(params)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not getattr(self, "_optimizers_pending", False):
            return
        self._optimizers_pending = False
        self.log_params(applied_optimizer_params(self.model))


def applied_optimizer_params(model: Any) -> dict[str, Any]:
    """``optimizer_<key>`` for the one optimizer a custom `train_step` applied (``model.optimizer``
    when the step was not seen), ``<attribute>_<key>`` for each of several."""
    from keras_sync.training.train_step_trace import applied_optimizers

    applied = applied_optimizers(model)
    if len(applied) <= 1:
        return optimizer_params(applied[0][1] if applied else model.optimizer)
    return {
        f"{name}_{k}": v for name, optimizer in applied for k, v in optimizer.get_config().items()
    }


def optimizer_params(optimizer: Any) -> dict[str, Any]:
    """``optimizer_<key>`` for every entry of the optimizer's config (``optimizer_name``, ...)."""
    if optimizer is None:
        return {}
    return {f"optimizer_{k}": v for k, v in optimizer.get_config().items()}


def model_summary(model: Any) -> str:
    """``model.summary()`` as text, line for line as autolog stores it."""
    lines: list[str] = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    return "\n".join(lines)
