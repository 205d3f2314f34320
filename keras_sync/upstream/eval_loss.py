"""`evaluate` reports one device's loss under N replicas, for Keras's `test_step` and a custom one.

Keras divides every loss by the replica count for the gradient sum
(``scale_loss_for_distribution``), and its own `test_step` multiplies it back; a custom one (as the
guides write it) reports 1/N of the loss. No gradient is taken in a test step: while one traces,
both functions are identities.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

from keras_sync.upstream.patching import original, patched

MODULE = "keras.src.losses.loss"
_NAMES = ("scale_loss_for_distribution", "unscale_loss_for_distribution")
_tls = threading.local()


def _identity_in_test_step(name: str, keras_own: Any) -> Any:
    def scale(value: Any) -> Any:
        return value if getattr(_tls, "testing", False) else keras_own(value)

    scale.__name__ = name
    return scale


@contextlib.contextmanager
def _tracing_test_step() -> Iterator[None]:
    module = importlib.import_module(MODULE)
    patches = [(module, n, _identity_in_test_step(n, original(module, n))) for n in _NAMES]
    was, _tls.testing = getattr(_tls, "testing", False), True
    try:
        with patched(patches):
            yield
    finally:
        _tls.testing = was


@contextlib.contextmanager
def unscaled_eval_losses(model: Any) -> Iterator[None]:
    """For this span, ``model``'s test step tracks losses not divided by the replica count.

    The step is wrapped on the instance (not its class) and unwrapped on exit; the test function
    traced inside keeps the behaviour. One traced before without it is dropped so Keras traces again.
    """
    from keras_sync.upstream import internals as _internals

    _internals.require("evaluate_loss")
    if getattr(model.__dict__.get("test_step"), "unscales_losses", False):
        yield
        return
    step = model.test_step

    def test_step(data: Any) -> Any:
        object.__setattr__(model, "_keras_sync_eval_unscaled", True)
        with _tracing_test_step():
            return step(data)

    test_step.unscales_losses = True  # type: ignore[attr-defined]
    if getattr(model, "test_function", None) is not None and not model.__dict__.get(
        "_keras_sync_eval_unscaled"
    ):
        model.test_function = None
    with patched([(model, "test_step", test_step)]):
        yield
