"""`OncePerRun`: the base of the callbacks that log through a writer once, at the first `fit`."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.measures import reduce as _reduce


class OncePerRun(keras.callbacks.Callback):
    """Call `log_once` at the start of the first `fit` this callback sees; never again.

    A later `fit` of the same run keeps the first values (MLflow params are immutable).

    Args:
        writer: a started writer with a ``log_params`` method (None: do nothing).
    """

    def __init__(self, writer: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_params")
        self.writer = writer
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.writer is None or self._done:
            return
        self._done = True
        self.log_once()

    def log_once(self) -> None:
        raise NotImplementedError
