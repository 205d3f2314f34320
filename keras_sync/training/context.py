"""What keras-sync's callbacks know about a run: a frozen `RunContext` and one `SharedState`.

No callback reads another callback or a `Sync`'s private state. Each is given:

- a `RunContext`: the facts of the run, fixed when `fit` starts (strategy, replicas, batch sizes,
  learning rate, steps per epoch, the config);
- a `SharedState`: the little that changes during `fit` and more than one callback needs (the
  global step, the hooks that put held metrics in the writer, who listens to logged metrics);
  `Sync.fit` takes a new one for each fit from the job's `JobState` (the fits of one job share
  their steps and params through it).

With one `SharedState` given to all of them they work in any order in the callbacks list.
No TensorFlow, Keras or MLflow here (tests/test_context.py tests it on its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


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
    """The state keras-sync's callbacks share during one `fit`; give the same one to all of them.

    - ``step``: the job's step after the last finished train step, set by `SyncMetrics`; None
      before the first step. It is the model's optimizer step (micro-batches with gradient
      accumulation) plus ``step_offset`` (see `job_step`). Callbacks that log at other moments
      (`WeightDivergence`, `SystemMetrics`) log at this step so that every chart shares one x-axis.
    - `job_step(model_step)`: that step for a model's optimizer step. The fits of one job
      continue each other's steps: the first fit of a new model (optimizer step 0) starts after
      the last step an earlier fit of the job trained (``steps_before``), a model fitted again
      continues its own count. A backup restore sets ``step_offset`` to the one saved with it, so
      a resumed fit logs the steps it trains again at the same steps (MLflow keeps the first point).
    - `params_to_log(params)`: the params of this fit that the job's run lacks; a value that
      differs from an earlier fit's goes under ``fit_<n>.<key>`` (MLflow params are immutable).
    - `flush()`: runs the registered flushers (`SyncMetrics` registers the one that reads its
      probe's ring and logs the held steps). A backup calls it before saving, a report before
      drawing. Under `multi_worker_mirrored` a flush is a collective: every worker calls it at
      the same point, which holds when every worker runs the same callbacks.
    - `record(metrics, step)`: callbacks that log metrics pass them here too; listeners (the
      `SyncReport`) see every point whatever the callbacks' order.
    """

    def __init__(
        self, *, fit: int = 1, steps_before: int = 0, params: dict[str, str] | None = None
    ) -> None:
        self.step: int | None = None
        #: This fit's number in its job (1 for the first), the last step the job trained before it.
        self.fit, self.steps_before = fit, steps_before
        #: Added to the model's optimizer step to make the job's step; fixed by the first `job_step`
        #: of the fit, or by a backup restore before it.
        self.step_offset: int | None = None
        self._params = {} if params is None else params  # the job's: shared by its fits
        self._flushers: list[Callable[[], None]] = []
        self._listeners: list[Callable[[dict[str, float], int], None]] = []

    def job_step(self, model_step: int) -> int:
        """The job's step for the model's optimizer step ``model_step`` (the offset is fixed at the first call).

        >>> shared = SharedState(fit=2, steps_before=16)
        >>> shared.job_step(0), shared.job_step(5)     # a new model: after the 16 steps of fit 1
        (16, 21)
        >>> SharedState(fit=2, steps_before=16).job_step(16)  # the same model fitted again
        16
        """
        if self.step_offset is None:
            self.step_offset = max(0, self.steps_before - model_step)
        return self.step_offset + model_step

    def params_to_log(self, params: dict[str, Any]) -> dict[str, Any]:
        """Of ``params``, those to send: new keys as they are, changed values as ``fit_<n>.<key>``.

        A param an earlier fit of the job logged with the same value (as MLflow stores it: its text)
        is not sent again. Values are returned as given.

        >>> first, third = SharedState(), SharedState(fit=3)
        >>> third._params = first._params
        >>> first.params_to_log({"epochs": 1, "optimizer_name": "SGD"})
        {'epochs': 1, 'optimizer_name': 'SGD'}
        >>> third.params_to_log({"epochs": 2, "optimizer_name": "SGD"})
        {'fit_3.epochs': 2}
        """
        out: dict[str, Any] = {}
        for key, value in params.items():
            text = str(value)
            had = self._params.get(key)
            if had is not None and had != text:
                key = f"fit_{self.fit}.{key}"
                had = self._params.get(key)
            if had is None:
                self._params[key] = text
                out[key] = value
        return out

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


class JobState:
    """What the fits of one job in this process share: the last step trained, the params logged.

    `next_fit` gives each `fit` its `SharedState`: its steps continue after the last step of the
    fits before it (`SharedState.job_step`), and its params are checked against theirs
    (`SharedState.params_to_log`). `keras_sync.training.job_run.job_state` keeps one per job.

    >>> job = JobState()
    >>> first = job.next_fit(); first.step = first.job_step(0) + 16   # 16 steps of a new model
    >>> second = job.next_fit()
    >>> second.fit, second.job_step(0) + 1   # a new model again: its first step
    (2, 17)
    """

    def __init__(self) -> None:
        self.fits = 0
        self.last_step = 0
        self.params: dict[str, str] = {}
        self._current: SharedState | None = None

    def next_fit(self) -> SharedState:
        """The `SharedState` of the job's next `fit` (the one before it has ended, or raised)."""
        if self._current is not None:
            self.last_step = max(self.last_step, self._current.step or 0)
        self.fits += 1
        self._current = SharedState(fit=self.fits, steps_before=self.last_step, params=self.params)
        return self._current


def check_shared(shared: Any) -> SharedState:
    """``shared`` itself, or a new `SharedState` for None; a clear error for anything else."""
    if shared is None:
        return SharedState()
    if not isinstance(shared, SharedState):
        from keras_sync.errors import UsageError

        raise UsageError(
            f"Invalid value for argument `shared`. Received: shared={type(shared).__name__}. "
            "Expected a keras_sync.callbacks.SharedState (the same one for all keras-sync callbacks "
            "of a fit), or None."
        )
    return shared
