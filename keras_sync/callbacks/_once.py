"""What the keras-sync callbacks share: `OncePerRun`, the argument check, the step to log at."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.errors import UsageError
from keras_sync.measures import reduce as _reduce
from keras_sync.training.context import check_shared


def invalid(name: str, value: Any, expected: str) -> UsageError:
    """The error of a callback argument: what was received, and what was ``expected``."""
    return UsageError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}."
    )


def check_int(name: str, value: Any, minimum: int, alternative: str = "") -> None:
    """Raise `UsageError` unless ``value`` is an integer >= ``minimum``; ``alternative``: another
    value allowed, for the message (``" or 'auto'"``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(name, value, f"an integer >= {minimum}{alternative}")


def log_step(shared: Any, model: Any) -> int:
    """The shared state's step, or the optimizer's without one (a callback used alone)."""
    return shared.step if shared.step is not None else int(model.optimizer.iterations.numpy())


class OncePerRun(keras.callbacks.Callback):
    """Call `log_once` at the start of the first `fit` this callback sees, with a writer;
    `log_params` sends only what the job's earlier fits did not (`SharedState.params_to_log`)."""

    def __init__(self, writer: Any = None, *, shared: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_params")
        self.writer, self.shared, self._done = writer, check_shared(shared), False

    def log_params(self, params: dict[str, Any]) -> None:
        new = self.shared.params_to_log(params)
        if new:
            self.writer.log_params(new)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.writer is not None and not self._done:
            self._done = True
            self.log_once()

    def log_once(self) -> None:
        raise NotImplementedError
