"""`SystemMetrics`: CPU, memory, disk and network usage, logged through the keras-sync writer."""

from __future__ import annotations

import threading
from typing import Any

import keras

from keras_sync.callbacks._once import invalid
from keras_sync.training.context import check_shared


class SystemMetrics(keras.callbacks.Callback):
    """Sample MLflow's system monitors during `fit` and log them as ``system/*`` metrics.

    MLflow's CPU, disk and network monitors are sampled in a thread and their averages go through
    the writer (never blocking on MLflow), at the ``step`` `SyncMetrics` keeps. For GPUs, use
    ``mlflow.enable_system_metrics_logging()``.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`; None logs nothing.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks.
        interval_s: seconds between samples (``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` if set,
            else 10).
    """

    def __init__(self, writer: Any = None, *, shared: Any = None, interval_s: float | None = None):
        super().__init__()
        from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL

        default = MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or 10.0
        interval = default if interval_s is None else interval_s
        if not interval > 0:
            raise invalid("interval_s", interval_s, "a number of seconds > 0")
        self.writer, self.shared, self.interval_s = writer, check_shared(shared), float(interval)
        self._monitors: list[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.writer is None or (self._thread is not None and self._thread.is_alive()):
            return
        if self._monitors is None:  # MLflow's private monitor classes, sampled here
            from keras_sync.upstream import internals as _internals

            _internals.require("system_metrics")
            from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
            from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
            from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

            self._monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(self._monitors,), daemon=True)
        self._thread.start()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None

    def _run(self, monitors: list[Any]) -> None:
        last_step, stopping = None, False
        while not stopping:
            for m in monitors:
                m.collect_metrics()
            stopping = self._stop.wait(self.interval_s)
            step = self.shared.step
            if step is None or step == last_step:
                continue  # before the first step, or none since the last sample: one point per step
            metrics: dict[str, float] = {}
            for m in monitors:
                metrics.update({f"system/{k}": float(v) for k, v in m.aggregate_metrics().items()})
                m.clear_metrics()
            if metrics:
                last_step = step
                self.writer.log_metrics(metrics, step=step)
