"""Facts about a built strategy and the models and variables under it (no TensorFlow import)."""

from __future__ import annotations

from typing import Any


def in_multi_worker_mode(strategy: Any) -> bool:
    """Whether ``strategy`` spans several workers (collectives then need every worker to take part)."""
    check = getattr(getattr(strategy, "extended", None), "_in_multi_worker_mode", None)
    return bool(check()) if check is not None else False


def built_under(model: Any) -> Any:
    """The strategy ``model`` was built under, None if none: in a scope, the public
    `distribute_strategy` is the scope's strategy for any model."""
    return getattr(model, "_distribute_strategy", None)


def distributed_variable(variable: Any) -> Any:
    """The `tf.Variable` a Keras variable wraps (its per-replica copies), else ``variable``."""
    return getattr(variable, "_value", variable)
