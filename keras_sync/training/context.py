"""What keras-sync's callbacks know about a run: a frozen `RunContext` and one `SharedState` per fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from keras_sync.errors import UsageError


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The facts of one distributed `fit` that the callbacks log or use (see `Sync.context`).

    ``steps_per_epoch``: None when the data does not tell it; ``warmup_steps``: ``"unknown"`` for a
    warmup in epochs of unknown length; ``config``: the resolved `keras_sync.Config`, or None.
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
        """The ``sync.*`` MLflow params of these facts (`RunParams` adds versions and devices)."""
        skip = ("kind", "is_chief", "steps_per_epoch", "config")
        names = [f.name for f in dataclasses.fields(self) if f.name not in skip]
        return {"sync.strategy": self.kind, **{f"sync.{n}": getattr(self, n) for n in names}}


class SharedState:
    """The state keras-sync's callbacks share during one `fit`; give the same one to all of them.

    ``step``: the job's step after the last train step (set by `SyncMetrics`), every callback's
    x-axis. `flush` runs the flushers before a backup or a report (a collective under several
    workers); `record` passes every logged point to the listeners (`SyncReport`).

    Args:
        fit: this fit's number in its job (1 for the first).
        steps_before: the last step the job trained before this fit.
        params: the params the job's run has (shared by its fits); None: none yet.
    """

    def __init__(
        self, *, fit: int = 1, steps_before: int = 0, params: dict[str, str] | None = None
    ) -> None:
        self.fit, self.steps_before = fit, steps_before
        self.step: int | None = None
        #: Added to the model's optimizer step to make the job's step (first `job_step`, or a restore).
        self.step_offset: int | None = None
        self._params = {} if params is None else params  # the job's: shared by its fits
        self._flushers: list[Callable[[], None]] = []
        self._listeners: list[Callable[[dict[str, float], int], None]] = []

    def job_step(self, model_step: int) -> int:
        """The job's step of the model's optimizer step (a new model continues after earlier fits)."""
        if self.step_offset is None:
            self.step_offset = max(0, self.steps_before - model_step)
        return self.step_offset + model_step

    def params_to_log(self, params: dict[str, Any]) -> dict[str, Any]:
        """Of ``params``, the new ones, a changed value as ``fit_<n>.<key>`` (MLflow's are immutable)."""
        out: dict[str, Any] = {}
        for key, value in params.items():
            if self._params.get(key, str(value)) != str(value):
                key = f"fit_{self.fit}.{key}"
            if key not in self._params:
                self._params[key], out[key] = str(value), value
        return out

    def add_flusher(self, fn: Callable[[], None]) -> None:
        if fn not in self._flushers:
            self._flushers.append(fn)

    def add_listener(self, fn: Callable[[dict[str, float], int], None]) -> None:
        if fn not in self._listeners:
            self._listeners.append(fn)

    def flush(self) -> None:
        for fn in self._flushers:
            fn()

    def record(self, metrics: dict[str, float], step: int) -> None:
        for fn in self._listeners:
            fn(metrics, step)


class JobState:
    """What the fits of one job in this process share: the last step trained, the params logged."""

    def __init__(self) -> None:
        self._last = SharedState(fit=0)  # before the first fit; its params are the job's

    def next_fit(self) -> SharedState:
        """The `SharedState` of the job's next `fit` (the one before it has ended, or raised)."""
        last = self._last
        steps = max(last.steps_before, last.step or 0)
        self._last = SharedState(fit=last.fit + 1, steps_before=steps, params=last._params)
        return self._last


def check_shared(shared: Any) -> SharedState:
    """``shared`` itself, or a new `SharedState` for None; a `UsageError` for anything else."""
    if shared is None or isinstance(shared, SharedState):
        return shared or SharedState()
    raise UsageError(
        f"Invalid value for argument `shared`. Received: shared={type(shared).__name__}. "
        "Expected a keras_sync.callbacks.SharedState (one for all callbacks of a fit), or None."
    )
