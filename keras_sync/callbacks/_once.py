"""`OncePerRun`: the base of the callbacks that log through a writer once, at the first `fit`."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.measures import reduce as _reduce
from keras_sync.training.context import check_shared


class OncePerRun(keras.callbacks.Callback):
    """Call `log_once` at the start of the first `fit` this callback sees; never again.

    Params go through `log_params`: only what the job's earlier fits did not log, and a changed
    value under ``fit_<n>.<key>`` (`keras_sync.callbacks.SharedState.params_to_log`).

    Args:
        writer: a started writer with a ``log_params`` method (None: do nothing).
        shared: the `keras_sync.callbacks.SharedState` of this fit (default: its own, a first fit).
    """

    def __init__(self, writer: Any = None, *, shared: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_params")
        self.writer = writer
        self.shared = check_shared(shared)
        self._done = False

    def log_params(self, params: dict[str, Any]) -> None:
        new = self.shared.params_to_log(params)
        if new:
            self.writer.log_params(new)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.writer is None or self._done:
            return
        self._done = True
        self.log_once()

    def log_once(self) -> None:
        raise NotImplementedError
