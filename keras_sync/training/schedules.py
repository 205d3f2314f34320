"""Keras learning-rate schedules: gradual warmup to the scaled peak (Goyal et al. 2017)."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.errors import UsageError


@keras.saving.register_keras_serializable(package="keras_sync")
class GradualWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from ``start_lr`` to ``peak_lr`` over ``warmup_steps``, then ``peak_lr`` or
    ``after`` (`keras_sync.training.scaling.warmup_learning_rate`, Goyal et al. 2017, section 2.2).

    Args:
        start_lr: learning rate at step 0 (the unscaled base rate).
        peak_lr: learning rate reached at ``warmup_steps`` (the scaled rate).
        warmup_steps: number of optimizer steps of the warmup, >= 1.
        after: optional schedule applied from the end of the warmup, called with
            ``step - warmup_steps``.

    Examples:
        >>> sched = GradualWarmup(0.1, 0.4, warmup_steps=3)
        >>> [round(float(sched(s)), 6) for s in range(5)]
        [0.1, 0.2, 0.3, 0.4, 0.4]
    """

    def __init__(
        self,
        start_lr: float,
        peak_lr: float,
        warmup_steps: int,
        after: keras.optimizers.schedules.LearningRateSchedule | None = None,
        name: str = "GradualWarmup",
    ):
        super().__init__()
        if int(warmup_steps) < 1:
            raise UsageError(
                f"Invalid value for argument `warmup_steps`. Received: warmup_steps={warmup_steps}. "
                "Expected an integer >= 1 (use the plain learning rate when there is no warmup)."
            )
        self.start_lr, self.peak_lr = float(start_lr), float(peak_lr)
        self.warmup_steps, self.after, self.name = int(warmup_steps), after, name

    def __call__(self, step: Any = None) -> Any:
        if step is None:  # a Keras 2 (tf_keras) optimizer calls an unknown schedule without a step
            raise UsageError(
                "sync.lr_schedule()'s warmup was called without a step, as a Keras 2 optimizer "
                "(tf_keras) does; keras-sync supports Keras 3 only. Fix: build the model and its "
                "optimizer with `import keras`, and unset TF_USE_LEGACY_KERAS."
            )
        ops = keras.ops
        step, warm = ops.cast(step, "float32"), ops.cast(self.warmup_steps, "float32")
        warm_lr = self.start_lr + (self.peak_lr - self.start_lr) * ops.minimum(step, warm) / warm
        if self.after is None:
            return warm_lr
        return ops.where(step < warm, warm_lr, ops.cast(self.after(step - warm), "float32"))

    def get_config(self) -> dict[str, Any]:
        after = self.after and keras.optimizers.schedules.serialize(self.after)
        names = ("start_lr", "peak_lr", "warmup_steps", "name")
        return {**{k: getattr(self, k) for k in names}, "after": after}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GradualWarmup:
        after = config.get("after")
        return cls(**{**config, "after": after and keras.optimizers.schedules.deserialize(after)})


def check_lr_callbacks(model: Any, callbacks: Any, method: str = "fit") -> None:
    """Refuse before training a callback that sets the rate of an optimizer given a schedule."""
    kinds = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)
    setters = [type(cb).__name__ for cb in callbacks or () if isinstance(cb, kinds)]
    rate = configured_rate(getattr(model, "optimizer", None)) if setters else None
    if not isinstance(rate, dict):
        return
    name = str(rate.get("class_name") or "LearningRateSchedule")
    ours = " from sync.lr_schedule(), the learning_rate warmup" if name == "GradualWarmup" else ""
    raise UsageError(
        f"callbacks of sync.{method}: {setters[0]} sets the optimizer's learning rate, but the "
        f"optimizer was given a schedule ({name}{ours}), whose rate Keras cannot set. Fix: keep "
        f"{setters[0]} and give the optimizer a float (sync.learning_rate, no learning_rate.warmup_*), "
        "or drop it and give the decay after the warmup: sync.lr_schedule(after=...)."
    )


def configured_rate(optimizer: Any) -> Any:
    """The learning rate ``optimizer`` (or its inner one) was given (float, schedule dict, None)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    try:
        return optimizer.get_config().get("learning_rate")
    except Exception:  # None, or a schedule without get_config: Keras decides at run time
        return None
