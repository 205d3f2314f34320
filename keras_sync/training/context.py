"""What keras-sync's callbacks know about a run: a frozen `RunContext` and one `SharedState`.

No callback reads another callback or a `Sync`'s private state. Each is given:

- a `RunContext`: the facts of the run, fixed when `fit` starts (strategy, replicas, batch sizes,
  learning rate, steps per epoch, the config);
- a `SharedState`: the little that changes during `fit` and more than one callback needs (the
  global step, the hooks that put held metrics in the writer, who listens to logged metrics).

With one `SharedState` given to all of them they work in any order in the callbacks list.
No TensorFlow, Keras or MLflow here (tests/test_context.py tests it on its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The facts of one distributed `fit` that the callbacks log or use (see `Sync.context`).

    ``steps_per_epoch`` is None when the data does not tell it; ``warmup_steps`` is
    ``"unknown"`` when the warmup is in epochs and the epoch length is unknown; ``config`` is the
    resolved `keras_sync.Config` (None for a context made without one).
    """

    kind: str
    num_replicas: int
    num_workers: int = 1
    is_chief: bool = True
    per_replica_batch_size: int | None = None
    global_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    effective_batch_size: int | None = None
    base_learning_rate: float | None = None
    learning_rate: float | None = None
    lr_scaling: str | None = None
    warmup_steps: int | str = 0
    steps_per_epoch: int | None = None
    config: Any = None

    def params(self) -> dict[str, Any]:
        """The ``sync.*`` MLflow params of these facts (the TensorFlow/Keras versions and devices
        are added by `RunParams`)."""
        return {
            "sync.strategy": self.kind,
            "sync.num_replicas": self.num_replicas,
            "sync.num_workers": self.num_workers,
            "sync.per_replica_batch_size": self.per_replica_batch_size,
            "sync.global_batch_size": self.global_batch_size,
            "sync.gradient_accumulation_steps": self.gradient_accumulation_steps,
            "sync.effective_batch_size": self.effective_batch_size,
            "sync.base_learning_rate": self.base_learning_rate,
            "sync.learning_rate": self.learning_rate,
            "sync.lr_scaling": self.lr_scaling,
            "sync.warmup_steps": self.warmup_steps,
        }


class SharedState:
    """The state keras-sync's callbacks share during `fit`; give the same one to all of them.

    - ``step``: the global optimizer step after the last finished train step (micro-batches with
      gradient accumulation), set by `SyncMetrics`; None before the first step. Callbacks that
      log at other moments (`WeightDivergence`, `SystemMetrics`) log at this step so that every
      chart shares one x-axis.
    - `flush()`: runs the registered flushers (`SyncMetrics` registers the one that reads its
      probe's ring and logs the held steps). A backup calls it before saving, a report before
      drawing. Under `multi_worker_mirrored` a flush is a collective: every worker calls it at
      the same point, which holds when every worker runs the same callbacks.
    - `record(metrics, step)`: callbacks that log metrics pass them here too; listeners (the
      `SyncReport`) see every point whatever the callbacks' order.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self._flushers: list[Callable[[], None]] = []
        self._listeners: list[Callable[[dict[str, float], int], None]] = []

    def add_flusher(self, fn: Callable[[], None]) -> None:
        if fn not in self._flushers:
            self._flushers.append(fn)

    def add_listener(self, fn: Callable[[dict[str, float], int], None]) -> None:
        if fn not in self._listeners:
            self._listeners.append(fn)

    def flush(self) -> None:
        """Log every metric still held by a callback now (a collective under multi-worker)."""
        for fn in self._flushers:
            fn()

    def record(self, metrics: dict[str, float], step: int) -> None:
        for fn in self._listeners:
            fn(metrics, step)


def check_shared(shared: Any) -> SharedState:
    """``shared`` itself, or a new `SharedState` for None; a clear error for anything else."""
    if shared is None:
        return SharedState()
    if not isinstance(shared, SharedState):
        from keras_sync.errors import UsageError

        raise UsageError(f"Invalid value for argument `shared`. Received: shared={type(shared).__name__}. "
                         "Expected a keras_sync.callbacks.SharedState (the same one for all keras-sync callbacks "
                         "of a fit), or None.")
    return shared
