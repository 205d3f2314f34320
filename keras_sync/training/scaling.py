"""Batch-size and learning-rate scaling by replica count: pure maths, no TensorFlow.

Goyal et al. 2017 (arXiv:1706.02677): the linear rule and gradual warmup. Krizhevsky 2014
(arXiv:1404.5997): the square-root rule.
"""

from __future__ import annotations

import math

from keras_sync.config import LR_RULES  # the names a user may write; the maths of each is below
from keras_sync.errors import ScalingError


def global_batch_size(per_replica: int, replicas: int) -> int:
    """The global batch: ``per_replica x replicas``.

    >>> global_batch_size(32, 4)
    128
    """
    _check_positive_int("per_replica", per_replica, "batch.per_replica")
    _check_positive_int("replicas", replicas, "strategy")
    return per_replica * replicas


def per_replica_batch_size(global_batch: int, replicas: int) -> int:
    """The per-replica batch: ``global / replicas``, which must divide.

    >>> per_replica_batch_size(256, 8)
    32
    >>> per_replica_batch_size(100, 8)
    Traceback (most recent call last):
    ...
    keras_sync.errors.ScalingError: Invalid value for batch.global. Received: global=100 with 8 replicas. Expected a multiple of 8 so that every replica gets the same batch; use 96 or 104, or set batch.per_replica instead.
    """
    _check_positive_int("global", global_batch, "batch.global")
    _check_positive_int("replicas", replicas, "strategy")
    if global_batch % replicas:
        lower = global_batch // replicas * replicas
        options = f"{lower} or {lower + replicas}" if lower else f"{replicas}"
        raise ScalingError(
            f"Invalid value for batch.global. Received: global={global_batch} with {replicas} "
            f"replicas. Expected a multiple of {replicas} so that every replica gets the same "
            f"batch; use {options}, or set batch.per_replica instead."
        )
    return global_batch // replicas


def resolve_batch_sizes(
    per_replica: int | None, global_batch: int | None, replicas: int
) -> tuple[int, int]:
    """(per-replica, global) from the one of the two the config gives (it allows exactly one).

    >>> resolve_batch_sizes(32, None, 4), resolve_batch_sizes(None, 128, 4)
    ((32, 128), (32, 128))
    """
    if global_batch is not None:
        return per_replica_batch_size(global_batch, replicas), global_batch
    assert per_replica is not None  # the config checked it
    return per_replica, global_batch_size(per_replica, replicas)


def lr_formula(rule: str, base_lr: float, global_batch_size: int, base_batch_size: int) -> str:
    """`scale_learning_rate`'s formula in words, for `keras-sync plan`.

    >>> lr_formula("sqrt", 0.1, 1024, 256)
    '0.1 x sqrt(1024/256)'
    """
    ratio = f"{global_batch_size}/{base_batch_size}"
    linear, sqrt = f"{base_lr:g} x {ratio} (Goyal et al. 2017)", f"{base_lr:g} x sqrt({ratio})"
    return {"linear": linear, "sqrt": sqrt}.get(rule, "not scaled")


def scale_learning_rate(
    base_lr: float, *, global_batch_size: int, base_batch_size: int, rule: str
) -> float:
    """The peak learning rate for a global batch, scaled from one tuned at ``base_batch_size``.

    With ``k = global_batch_size / base_batch_size``: ``linear`` (Goyal et al. 2017) gives
    ``base_lr * k``, ``sqrt`` (Krizhevsky 2014) ``base_lr * sqrt(k)``, ``none`` ``base_lr``.

    >>> scale_learning_rate(0.1, global_batch_size=8192, base_batch_size=256, rule="linear")
    3.2
    >>> scale_learning_rate(0.1, global_batch_size=1024, base_batch_size=256, rule="sqrt")
    0.2
    >>> scale_learning_rate(0.1, global_batch_size=1024, base_batch_size=256, rule="none")
    0.1
    """
    number = isinstance(base_lr, (int, float)) and not isinstance(base_lr, bool)
    if not (number and 0 < base_lr < math.inf):
        raise ScalingError(
            "Invalid value for argument `base_lr` (learning_rate.base). "
            f"Received: base_lr={base_lr!r}. Expected a finite number > 0."
        )
    _check_positive_int("global_batch_size", global_batch_size, "batch")
    _check_positive_int("base_batch_size", base_batch_size, "learning_rate.base_batch_size")
    k, name = global_batch_size / base_batch_size, str(rule).lower()
    factors = {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}
    if name not in factors:
        raise ScalingError(
            f"Invalid value for argument `rule` (learning_rate.scaling). Received: rule={rule!r}. "
            f"Expected one of {', '.join(LR_RULES)}."
        )
    return float(base_lr) if name == "none" else _clean(base_lr * factors[name])


def warmup_steps_from(
    *, warmup_steps: int = 0, warmup_epochs: float = 0.0, steps_per_epoch: int | None = None
) -> int:
    """The warmup length in optimizer steps: given, or ``ceil(warmup_epochs x steps_per_epoch)``.

    >>> warmup_steps_from(warmup_epochs=5, steps_per_epoch=100), warmup_steps_from(warmup_steps=30)
    (500, 30)
    """
    if warmup_steps and warmup_epochs:
        raise ScalingError(
            f"Received learning_rate.warmup_steps={warmup_steps} and "
            f"learning_rate.warmup_epochs={warmup_epochs}. Expected one of them; set the other to 0."
        )
    if warmup_epochs and not steps_per_epoch:
        raise ScalingError(
            f"learning_rate.warmup_epochs={warmup_epochs} needs the number of steps per epoch, "
            "which is not known yet. Pass steps_per_epoch to lr_schedule(), call distribute() on "
            "your training data first, or use learning_rate.warmup_steps instead."
        )
    if warmup_epochs:
        return max(1, math.ceil(warmup_epochs * (steps_per_epoch or 0)))
    return int(warmup_steps)


def warmup_learning_rate(step: int, *, start_lr: float, peak_lr: float, warmup_steps: int) -> float:
    """The learning rate at ``step`` (0-based) under gradual warmup (Goyal et al. 2017, 2.2):
    ``start_lr + (peak_lr - start_lr) * step / warmup_steps`` below ``warmup_steps``, then ``peak_lr``.

    >>> [warmup_learning_rate(s, start_lr=0.1, peak_lr=0.5, warmup_steps=4) for s in range(6)]
    [0.1, 0.2, 0.3, 0.4, 0.5, 0.5]
    """
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(peak_lr)
    return _clean(start_lr + (peak_lr - start_lr) * step / warmup_steps)


def _clean(x: float) -> float:
    """Round off binary noise (0.1 * 32 = 3.2000000000000006) for readable logs and params."""
    return float(f"{x:.12g}")


def _check_positive_int(name: str, value: object, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScalingError(
            f"Invalid value for argument `{name}` ({key}). Received: {name}={value!r}. "
            "Expected an integer >= 1."
        )
