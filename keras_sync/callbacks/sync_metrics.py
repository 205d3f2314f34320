"""`SyncMetrics`: per-step synchronisation metrics of a distributed `fit`, written to MLflow."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import keras

from keras_sync.callbacks._once import check_int
from keras_sync.measures import reduce as _reduce
from keras_sync.measures import slow_worker as _slow_worker
from keras_sync.tracking import autolog as _autolog
from keras_sync.training import instrument as _instrument
from keras_sync.training.context import check_shared

_TIMED = "_keras_sync_timed"  # on our wrapper of the train function: the function it wraps

#: Longest a logged step waits in the probe's ring before it is read and queued (single worker).
MAX_HOLD_MS = 500


class SyncMetrics(keras.callbacks.Callback):
    """Log what synchronous data-parallel training is doing, every ``log_every_n_steps`` steps.

    Each logged step gets ``sync/loss/replica_{i}`` and ``sync/grad_norm/replica_{i}`` (replica
    ``i``'s own loss and gradient norm, before the all-reduce), ``sync/loss_spread``,
    ``sync/grad_norm_spread``, ``sync/step_time_ms``, ``sync/examples_per_sec``,
    ``sync/examples_per_sec_per_replica``, ``sync/learning_rate``, ``sync/loss_scale``; for a
    point standing for several steps their peaks ``sync/window_max/loss``,
    ``sync/window_max/loss_spread``, ``sync/window_max/grad_norm`` and
    ``sync/window_max/grad_norm_spread``; with 2 or more workers ``sync/between_steps_ms/worker_{i}``
    and ``sync/compute_ms/worker_{i}`` (a slow worker is named in one line); and the numeric Keras
    logs. docs/reference/metrics.md defines each. Every worker runs it; the one given a ``writer``
    writes. The values wait in a ring inside the train step, read every 32 steps (0.5 s at most
    with one worker), at epoch and train end and before a keras-sync backup (with Keras's
    `BackupAndRestore`, call `emit()` first).

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`; None on workers that only take
            part in the gathers.
        log_every_n_steps: log every N optimizer steps (>= 1), or ``"auto"``: N from 1, 2, 5,
            10, 20, 50, ... so that logged steps are at least 0.1 s apart, plus each epoch's last.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks: this
            callback keeps its ``step`` (the MLflow step, `SharedState.job_step`), registers
            `emit` as a flusher and records every point.

    Example:
        >>> model.fit(ds, epochs=3, callbacks=[SyncMetrics(writer, log_every_n_steps=10)])  # doctest: +SKIP
    """

    def __init__(self, writer: Any = None, *, log_every_n_steps: int | str = 1, shared: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_metrics")
        self.shared = check_shared(shared)
        self.shared.add_flusher(self.emit)
        self.auto = log_every_n_steps == "auto"
        if not self.auto:
            check_int("log_every_n_steps", log_every_n_steps, 1, " or 'auto'")
        self.writer = writer
        # auto: every step is read (every worker alike); the chief thins what it writes.
        self.every = 1 if self.auto else int(log_every_n_steps)
        self.stride, self._keras_logs = 1, True
        self._probe: Any = None
        self._t0, self._examples_at_log, self._first_batch = 0.0, 0.0, 0
        self._count = 0  # train steps the probe has counted, as of the last finished batch
        self._slow = _slow_worker.SlowWorkerWatch()
        self._reset()

    def _reset(self) -> None:
        self.global_step: int | None = None  # the job's step after the last finished one
        self._busy_s, self._steps_since_log = 0.0, 0
        # Logged steps still in the probe's ring: (step, probe count, Keras logs, busy s, steps, ms).
        self._pending: list[tuple[int, int, dict, float, int, int]] = []
        # auto: the last step read but not written, and the time and steps not yet in a point.
        self._held: tuple | None = None
        self._carry_s, self._carry_n = 0.0, 0
        self._returned: float | None = None  # when the train function last returned
        self._window: dict[str, float] | None = None  # peaks since the last written point
        self._window_steps = 0

    def set_model(self, model: Any) -> None:  # before `fit` builds its train function
        super().set_model(model)
        self._probe = _instrument.instrument(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        # mlflow.keras.autolog() logs the Keras logs itself: twice, a key would get two points.
        self._keras_logs = not _autolog.keras_autolog_active()
        self._reset()  # a fit that raised may have left steps and peaks unwritten
        self.shared.step = None
        fn = getattr(self.model, "train_function", None)
        if self._probe.num_workers > 1 and fn is not None and not hasattr(fn, _TIMED):
            self.model.train_function = self._timed(fn)

    def _timed(self, fn: Any) -> Any:
        """The train function, noting this worker's time since its last return for the step it runs."""
        probe = self._probe

        def train_function(*args: Any, **kwargs: Any) -> Any:
            now = time.time()
            if self._returned is not None:
                probe.note_host(self._count + 1, (now - self._returned) * 1e6)
            try:
                return fn(*args, **kwargs)
            finally:
                self._returned = time.time()

        setattr(train_function, _TIMED, fn)
        return train_function

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.global_step is None:  # after every on_train_begin (a backup may have restored it)
            accumulator = getattr(self._probe, "accumulator", None)
            updates = int(self.model.optimizer.iterations.numpy())
            model_step = updates * (accumulator.steps if accumulator else 1)
            self.global_step = self.shared.job_step(model_step)
            self.shared.step = self.global_step
            rings = self._probe.read()
            self._count = self._probe.count(rings)
            rows = self._probe.row(rings, self._count)
            self._examples_at_log = sum(r[self._probe.EXAMPLES] for r in rows) if rows else 0.0
        self._first_batch = batch
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # Per step only bookkeeping; the probe is read every ring/2 steps (`emit`).
        self._busy_s += time.perf_counter() - self._t0
        steps = max(batch - self._first_batch + 1, 1)  # > 1 with steps_per_execution
        self._steps_since_log += steps
        self._count += steps
        prev = self.global_step or 0
        self.global_step = self.shared.step = prev + steps
        if _reduce.crossed_log_step(prev, self.global_step, self.every):
            numbers = _numbers(logs)
            now_ms = int(time.time() * 1000)
            # steps_per_execution > 1: each logged step of the execution gets its own point (its
            # Keras logs go with the last one).
            logged = [s for s in range(prev + 1, self.global_step + 1) if s % self.every == 0]
            per_step = self._busy_s / self._steps_since_log
            since = self.global_step - self._steps_since_log  # the step of the previous point
            for s in logged:
                last = numbers if s == logged[-1] else {}
                count = self._count - (self.global_step - s)
                self._pending.append((s, count, last, per_step * (s - since), s - since, now_ms))
                since = s
            self._busy_s = per_step * (self.global_step - logged[-1])
            self._steps_since_log = self.global_step - logged[-1]
        if not self._pending:
            return
        # Slow steps are held MAX_HOLD_MS at most (a crash loses them); not with several workers,
        # where the read is a collective and clocks would not decide alike.
        late = time.time() * 1000 - self._pending[0][5] >= MAX_HOLD_MS
        if self._count - self._pending[0][1] >= self._probe.ring // 2 or (
            late and not self._probe.multi_worker
        ):
            self.emit()

    def emit(self) -> None:
        """Log the steps still held in the probe's ring (every worker calls it at the same step)."""
        if not self._pending:
            return
        rings = self._probe.read()  # a collective under multi-worker: every worker runs it
        pending, self._pending = self._pending, []
        if self.auto and self.writer is not None:
            self.stride = _reduce.auto_stride(
                [busy_s / n for _, _, _, busy_s, n, _ in pending if n]
            )
        for step, count, logs, busy_s, n_steps, ts in pending:
            rows = self._probe.row(rings, count)
            if rows is None or self.writer is None:  # rows: the ring is read before it wraps
                continue
            examples = sum(r[self._probe.EXAMPLES] for r in rows)
            self._fold_window(rings, count, n_steps)
            if self.auto:
                busy_s, n_steps = busy_s + self._carry_s, n_steps + self._carry_n
                if step % self.stride:  # not written now: its time goes into the next point
                    self._held = (step, rows, examples, logs, busy_s, n_steps, ts)
                    self._carry_s, self._carry_n = busy_s, n_steps
                    continue
                self._held, self._carry_s, self._carry_n = None, 0.0, 0
            self._write(step, rows, examples, logs, busy_s, n_steps, ts)

    def _fold_window(self, rings: list[Any], count: int, n_steps: int) -> None:
        """Fold a point's steps still in the ring into the window's peaks."""
        p = self._probe
        for c in range(max(count - n_steps + 1, 1), count + 1):
            rows = p.row(rings, c)
            if rows is not None:
                self._window = _reduce.window_peaks(
                    self._window,
                    [float(r[p.LOSS]) for r in rows],
                    [float(r[p.GRAD_NORM]) for r in rows],
                )
                self._window_steps += 1

    def _write_held(self) -> None:
        """auto: write the last step read but not written (each epoch's last gets a point)."""
        if self._held is not None:
            held, self._held, self._carry_s, self._carry_n = self._held, None, 0.0, 0
            self._write(*held)

    def _write(
        self, step: int, rows: list, examples: float, logs: dict, busy_s: float, n: int, ts: int
    ) -> None:
        p = self._probe

        def column(index: int) -> list[float]:
            return [float(r[index]) for r in rows]

        metrics = _reduce.replica_metrics(column(p.LOSS), column(p.GRAD_NORM))
        metrics["sync/step_time_ms"] = 1000.0 * busy_s / n
        since = float(examples - self._examples_at_log)
        self._examples_at_log = examples
        metrics.update(_reduce.throughput(since, busy_s, p.num_replicas))
        # NaN: no learning rate read, or no LossScaleOptimizer (mixed_float16's dynamic scale)
        for key, index in (("sync/learning_rate", p.LR), ("sync/loss_scale", p.LOSS_SCALE)):
            if not math.isnan(value := float(rows[0][index])):
                metrics[key] = value
        if p.num_workers > 1:
            times = _slow_worker.worker_times(
                column(p.HOST_US), column(p.COMPUTE_US), p.num_workers
            )
            metrics.update(times)
            between = [
                times.get(_slow_worker.BETWEEN_KEY.format(i=w), float("nan"))
                for w in range(p.num_workers)
            ]
            line = self._slow.update(
                _slow_worker.own_times(times, p.num_workers), between, ts / 1000.0
            )
            if line:
                print(line, file=sys.stderr, flush=True)
        if self._window_steps > 1:  # a point for several steps: their peaks, so no spike is lost
            metrics.update(self._window or {})
        self._window, self._window_steps = None, 0
        if self._keras_logs:
            metrics.update(logs)  # the step's numeric Keras logs
        self.writer.log_metrics(metrics, step=step, timestamp_ms=ts)
        self.shared.record(metrics, step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._returned = None  # validation and epoch-end work come next: not a worker's step time
        self.emit()
        self._write_held()
        if self.writer is None or self.global_step is None or not self._keras_logs:
            return
        val = {k: v for k, v in _numbers(logs).items() if k.startswith("val_")}
        if val:
            self.writer.log_metrics(val, step=self.global_step)
            self.shared.record(val, self.global_step)

    def on_train_end(self, logs: dict | None = None) -> None:
        original = getattr(getattr(self.model, "train_function", None), _TIMED, None)
        if original is not None:
            self.model.train_function = original
        self.emit()
        self._write_held()
        end_of_fit = getattr(self.writer, "end_of_fit", None)
        if end_of_fit is not None:  # delivered, or one warning names why
            end_of_fit()


def _numbers(logs: dict | None) -> dict[str, float]:
    return {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
