"""`SyncReport`: one picture of the sync health, the replicas overlaid, as the artifact ``sync_report.png``."""

from __future__ import annotations

from typing import Any

import keras

from keras_sync.callbacks._once import check_int, invalid
from keras_sync.measures import reduce as _reduce
from keras_sync.tracking.report_plot import SyncHistory, upload
from keras_sync.training.context import check_shared

ARTIFACT = "sync_report.png"
WHEN = ("end", "epoch")


class SyncReport(keras.callbacks.Callback):
    """Draw what the sync metrics say into ``sync_report.png``, at train end (and after each epoch).

    Each replica's loss and gradient norm, the weight divergence, and a summary that names a slow
    worker, from what the other keras-sync callbacks record in the same `SharedState`. The worker
    given a writer draws; each drawing replaces the previous one.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`; None on the other workers.
        when: ``"end"`` (at the end of each `fit`) or ``"epoch"`` (also after every epoch).
        max_points: points kept per line.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks.
    """

    def __init__(
        self, writer: Any = None, *, when: str = "end", max_points: int = 2000, shared: Any = None
    ):
        super().__init__()
        _reduce.check_writer(writer, "log_artifact_file")
        if when not in WHEN:
            raise invalid("when", when, f"one of {', '.join(map(repr, WHEN))}")
        check_int("max_points", max_points, 2)
        self.writer, self.when = writer, when
        self.history = SyncHistory(max_points=max_points)
        self.shared = check_shared(shared)
        if writer is not None:
            self.shared.add_listener(self.history.add)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.when == "epoch":
            self.shared.flush()  # every worker (a collective under multi-worker); the chief draws
            self.log_report()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.shared.flush()
        self.log_report(fit_end=True)

    def log_report(self, *, fit_end: bool = False) -> None:
        """Draw the report now and queue it as the run's ``sync_report.png``."""
        if self.writer is None or self.history.empty:
            return
        if hasattr(self.writer, "log_sync_report"):  # MlflowWriter: its courier process draws it
            self.writer.log_sync_report(self.history.to_dict(), ARTIFACT, fit_end=fit_end)
            return
        upload(self.history, ARTIFACT, self.writer.log_artifact_file)
