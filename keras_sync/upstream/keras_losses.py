"""Keras's loss-scaling functions, read to tell whether a custom `train_step` divides its loss.

No public API says a loss went through them: a custom `train_step` as the guides write it trains
at N x the learning rate on N replicas (keras-team/keras#14104).
"""

from __future__ import annotations

import importlib
from typing import Any

MODULE = "keras.src.losses.loss"
#: The functions of `MODULE` the trace marks; both must be there.
NAMES = ("scale_loss_for_distribution", "reduce_values")
UPSTREAM_ISSUE = "keras-team/keras#14104 (a custom train_step under a tf.distribute strategy)"


def module() -> Any:
    """``keras.src.losses.loss``, whose `NAMES` the trace replaces while a replica traces its step."""
    return importlib.import_module(MODULE)


def missing() -> list[str]:
    """The dotted names of `NAMES` this Keras no longer has ([] when all are there)."""
    try:
        losses = module()
    except ImportError:
        return [f"{MODULE}.{name}" for name in NAMES]
    return [f"{MODULE}.{name}" for name in NAMES if not callable(getattr(losses, name, None))]
