"""Run-time checks of every `Sync.fit`: what really trained, against what keras-sync set up.

Rules that recognise an input (a ``batch`` op, a shard policy, a loss object) fix the cases they were
written for; these checks look at what happened, so an input nobody tried is loud too:

- ``examples_per_step``: every train step of an epoch took the global batch the learning rate was
  scaled for, but the last (a partial batch);
- ``examples_per_epoch``: the examples trained in an epoch, summed over replicas and workers, equal
  the data's length when it is known before training (arrays, a dataset of known cardinality);
- ``resume``: after a restored backup, the first step trains from the optimizer step restored;
- ``learning_rate``: the learning rate of each optimizer the train step applies is the one keras-sync
  scaled (when the config's ``learning_rate`` section was written); a custom `train_step`'s optimizers
  (a GAN's two, not the unused one of its ``super().compile()``) are known once its first step is traced;
- ``add_loss``: no `add_loss` term sums over the batch on several replicas (`keras_sync.training.add_loss_check`);
- ``direct_fit``: ``model.fit`` called on a model compiled in ``sync.scope()`` without keras-sync's
  callbacks (Keras's default batch, no scaling, no metrics): a guard on that model only.

The counts come from the replica probe (`keras_sync.training.instrument`, already written every step), read once per
epoch. A violation is one line on the chief and the MLflow tag ``keras_sync.check.<name>``; with
``checks.on_violation: error`` the fit stops with that line (`CheckFailed`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from keras_sync.errors import KerasSyncError


class CheckFailed(KerasSyncError):
    """A run-time check failed under ``checks.on_violation: error``."""


def step_problem(examples: int, steps: int, global_batch: int) -> str | None:
    """What is wrong with an epoch of ``steps`` train steps over ``examples`` (None: every step but the
    last took ``global_batch``, the last at most that).

    >>> step_problem(331, 11, 32) is None, step_problem(320, 10, 32) is None
    (True, True)
    >>> step_problem(512, 16, 64)
    '16 train steps took 512 examples (32 per step), but the learning rate was scaled for a global batch of 64'
    """
    if steps <= 0:
        return None
    if (steps - 1) * global_batch < examples <= steps * global_batch:
        return None
    per = examples / steps
    per_text = f"{per:g}" if per == int(per) else f"{per:.1f}"
    return (
        f"{steps} train steps took {examples} examples ({per_text} per step), but the learning rate was scaled "
        f"for a global batch of {global_batch}"
    )


def epoch_problem(examples: int, expected: int) -> str | None:
    """What is wrong with an epoch that trained ``examples`` of data of ``expected`` examples.

    >>> epoch_problem(331, 331) is None
    True
    >>> epoch_problem(256, 512)
    'the epoch trained 256 examples (all replicas and workers), but the data has 512: 256 were not trained'
    """
    if examples == expected:
        return None
    what = (
        f"{expected - examples} were not trained"
        if examples < expected
        else f"{examples - expected} more than the data (some trained twice)"
    )
    return f"the epoch trained {examples} examples (all replicas and workers), but the data has {expected}: {what}"


def learning_rate_problem(
    applied: float, scaled: float, *, global_batch: int, rule: str, optimizer: str | None = None
) -> str | None:
    """What is wrong when an optimizer applies ``applied`` and keras-sync scaled ``scaled``.

    ``optimizer``: the model attribute that holds it, when a custom `train_step` applies other
    optimizers than ``model.optimizer`` (a GAN's ``d_optimizer``); None: the compiled optimizer.

    >>> learning_rate_problem(0.002, 0.002, global_batch=64, rule="linear") is None
    True
    >>> learning_rate_problem(0.001, 0.002, global_batch=64, rule="linear")[:67]
    "the optimizer's learning rate is 0.001, but keras-sync scaled 0.002"
    >>> learning_rate_problem(0.001, 0.002, global_batch=64, rule="linear", optimizer="g_optimizer").split(". ")[-1]
    'Fix: create g_optimizer with learning_rate=sync.lr_schedule() (or sync.learning_rate)'
    """
    if math.isclose(applied, scaled, rel_tol=1e-6):
        return None
    why = f"but keras-sync scaled {scaled:g} for the global batch {global_batch} (learning_rate.scaling: {rule})"
    if optimizer is not None:
        return (
            f"{optimizer}'s learning rate is {applied:g}, {why}: the rate your script gives it is used as it is. "
            f"Fix: create {optimizer} with learning_rate=sync.lr_schedule() (or sync.learning_rate)"
        )
    return (
        f"the optimizer's learning rate is {applied:g}, {why}: the rate of your compile line is used as it is. "
        "Fix: compile with the optimizer's learning_rate=sync.lr_schedule() (or sync.learning_rate)"
    )


class Reporter:
    """Says a violation once per fit and check: one line on the chief, an MLflow tag, or an error."""

    def __init__(self, sync: Any):
        self.sync = sync
        self.error = sync.config.checks.on_violation == "error"
        self.said: set[str] = set()

    def violation(self, name: str, message: str) -> None:
        if name in self.said:
            return
        self.said.add(name)
        line = f"keras-sync: check {name} failed: {message}."
        if self.error:
            raise CheckFailed(line.removeprefix("keras-sync: ") + " (checks.on_violation: error)")
        if not self.sync.is_chief:
            return
        print(line + " (checks.on_violation: warn)", file=sys.stderr, flush=True)
        if self.sync.config.mlflow.enabled:
            from keras_sync.training.job_run import writer_for

            writer = writer_for(self.sync)
            if writer is not None:
                writer.set_tags({f"keras_sync.check.{name}": message[:4900]})


def checks_callback(
    sync: Any,
    *,
    global_batch: int,
    expected: int | None,
    data: Any = None,
    backups: Sequence[Any] = (),
) -> Any:
    """The Keras callback of these checks for one `fit` (put it last: it reads what the others restored).

    ``data``: `fit`'s ``x``, for the ``add_loss`` check (`keras_sync.training.add_loss_check`; None: not checked).
    ``backups``: this fit's keras-sync `BackupAndRestore` callbacks, whose ``restored`` point the
    resume check compares with the step training continues from.
    """
    import keras

    from keras_sync.training import instrument as _instrument
    from keras_sync.training.instrument import ReplicaProbe

    reporter = Reporter(sync)

    class RunChecks(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self._first_batch = True
            self._resumed = next((b.restored for b in backups if b.restored is not None), None)
            self._skip_epoch = self._resumed is not None and self._resumed.mid_epoch
            # Keras's own train_step applies model.optimizer; a custom one's optimizers are known once traced.
            self._rates_due = True
            if _instrument.has_default_train_step(self.model):
                self._check_learning_rate()
            self._add_loss_due = data is not None and sync.num_replicas > 1
            if getattr(self.model, "built", False):  # else once the first step has built it
                self._check_add_loss()
            self._probe: Any = _instrument.probe_of(self.model)
            self._last = self._totals() if self._probe is not None else None

        def _check_learning_rate(self) -> None:
            self._rates_due = False
            if not any(
                sync.config.source_of(f"learning_rate.{k}") != "default"
                for k in ("base", "scaling", "base_batch_size")
            ):
                return
            from keras_sync.training.train_step_trace import applied_optimizers

            # What the traced step applied, each on its own; model.optimizer only when nothing is known.
            applied = applied_optimizers(self.model) or [
                ("optimizer", getattr(self.model, "optimizer", None))
            ]
            problems = []
            for name, optimizer in applied:
                rate = getattr(
                    getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None
                )
                if (
                    rate is None
                    or isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
                    or callable(rate)
                ):
                    continue  # a schedule: keras-sync's warmup, or the user's own (read as the user wrote it)
                try:
                    rate = float(keras.ops.convert_to_numpy(rate))
                except (TypeError, ValueError):
                    continue
                problem = learning_rate_problem(
                    rate,
                    sync.learning_rate,
                    global_batch=sync.effective_batch_size,
                    rule=sync.config.learning_rate.scaling,
                    optimizer=None if name == "optimizer" else name,
                )
                if problem:
                    problems.append(problem)
            if problems:
                reporter.violation("learning_rate", "; ".join(problems))

        def _check_add_loss(self) -> None:
            if not self._add_loss_due:
                return
            self._add_loss_due = False
            from keras_sync.training import add_loss_check as _add_loss_check

            problem = _add_loss_check.problem(self.model, data, sync.num_replicas, global_batch)
            if problem:
                reporter.violation("add_loss", problem)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self._rates_due:  # a custom train_step: its first step has been traced
                self._check_learning_rate()
            self._check_add_loss()

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if not self._first_batch:
                return
            self._first_batch = False
            point = self._resumed
            optimizer = getattr(self.model, "optimizer", None)
            if point is None or optimizer is None:
                return
            now = int(optimizer.iterations.numpy())
            if now != point.iterations:
                reporter.violation(
                    "resume",
                    f"keras-sync restored optimizer step {point.iterations} (epoch "
                    f"{point.epoch + 1}, after batch {point.step}), but training continues from "
                    f"step {now}: something restored over it (e.g. keras.callbacks.BackupAndRestore "
                    "next to fault_tolerance.backup_dir; keep one)",
                )

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            point = self._resumed
            if point is not None and self._first_batch and epoch != point.epoch:
                reporter.violation(
                    "resume",
                    f"keras-sync restored epoch {point.epoch + 1}, but training continues "
                    f"at epoch {epoch + 1}: something restored over it (e.g. "
                    "keras.callbacks.BackupAndRestore next to fault_tolerance.backup_dir; keep one)",
                )

        def _totals(self) -> tuple[int, int]:
            self._rings = rings = (
                self._probe.read()
            )  # a collective under multi-worker: every worker is here
            count = ReplicaProbe.count(rings)
            return count, self._examples_at(count)

        def _examples_at(self, count: int) -> int:
            """Examples trained by all replicas up to train step ``count`` (-1: no longer in the ring)."""
            if count <= 0:
                return 0
            rows = self._probe.row(self._rings, count)
            return int(sum(r[ReplicaProbe.EXAMPLES] for r in rows)) if rows else -1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self._probe is None or self._last is None:
                return
            count, examples = self._totals()
            (count0, examples0), self._last = self._last, (count, examples)
            skip, self._skip_epoch = self._skip_epoch, False
            if examples < 0 or examples0 < 0:
                return
            steps, trained = count - count0, examples - examples0
            problem = step_problem(trained, steps, global_batch)
            # Each step but the epoch's last, as far back as the ring reaches: a short batch mid-epoch.
            first = max(count0 + 1, count - self._probe.ring + 1)
            before = self._examples_at(first - 1) if first - 1 > count0 else examples0
            for c in range(first, count):
                now = self._examples_at(c)
                if problem is None and before >= 0 and now >= 0 and now - before != global_batch:
                    problem = (
                        f"train step {c - count0} took {now - before} examples, but the learning rate was "
                        f"scaled for a global batch of {global_batch} (only an epoch's last step may be short)"
                    )
                before = now
            if problem:
                reporter.violation("examples_per_step", f"epoch {epoch + 1}: {problem}")
            if (
                expected is not None and not skip and sync.config.verify is None
            ):  # verify stops mid-epoch
                problem = epoch_problem(trained, expected)
                if problem:
                    reporter.violation("examples_per_epoch", f"epoch {epoch + 1}: {problem}")

    return RunChecks()


@contextlib.contextmanager
def scope_guarding_fit(sync: Any) -> Iterator[Any]:
    """`Sync.scope`: the strategy's scope, in which each model compiled gets a ``direct_fit`` guard.

    For the length of the block `keras.Model.compile` also puts the guard on the compiled model
    itself (an instance attribute, not Keras's class): its plain ``model.fit`` then says, once,
    that it runs without keras-sync. `Sync.fit` calls the class's `fit`, past the guard. The
    model's own ``fit``, ``evaluate`` and ``predict`` run with Keras fixed for the strategy
    (`keras_fixes.fixed_keras`), as `Sync.fit` does, for the length of each call. Under
    several workers the model also gets the chief-only ``save`` (`saving.chief_writes_on`) and
    ``fit``/``evaluate``/``predict`` that every worker must call (`collective_calls.meets_peers`).
    """
    import keras

    from keras_sync.upstream.patching import original, patched

    keras_compile = original(keras.Model, "compile")

    @functools.wraps(keras_compile)
    def compile(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = keras_compile(model, *args, **kwargs)
        if getattr(model, "_distribute_strategy", None) is sync.strategy:
            ref = weakref.ref(model)
            object.__setattr__(model, "fit", _guarded_fit(sync, ref))
            for name in ("evaluate", "predict"):
                object.__setattr__(model, name, _fixed_call(sync, ref, name))
            if sync.num_workers > 1:  # model.save/save_weights: the chief writes the user's path
                from keras_sync.cluster.collective_calls import meets_peers
                from keras_sync.training.saving import chief_writes_on

                chief_writes_on(model)
                meets_peers(model)  # its fit/evaluate/predict: every worker, or one line
        return result

    with sync.strategy.scope() as strategy, patched([(keras.Model, "compile", compile)]):
        yield strategy


def _guarded_fit(sync: Any, model_ref: Any) -> Any:
    """A model's own `fit`: says once when it runs without keras-sync, then runs the class's `fit`."""
    told = False
    fixed_fit = _fixed_call(sync, model_ref, "fit")

    def fit(*args: Any, **kwargs: Any) -> Any:
        nonlocal told
        model = model_ref()
        callbacks = kwargs.get("callbacks") or []
        # keras-sync's callbacks (sync.callbacks(model), or the public ones alone) mean the user runs
        # their own fit on purpose, as the README shows; so does data they batched themselves (a
        # dataset, sync.distribute): only arrays batched by Keras's own batch_size are the habit.
        ours = any(type(c).__module__.startswith("keras_sync.") for c in callbacks)
        data = args[0] if args else kwargs.get("x")
        if not ours and not told and not _batched_by_user(data):
            told = True
            Reporter(sync).violation(
                "direct_fit",
                f"model.fit called on {type(model).__name__}, built in sync.scope(), without keras-sync: Keras "
                f"batches arrays by its own batch_size (32 unless given), not by the configured global batch "
                f"{sync.global_batch_size} that the learning rate {sync.learning_rate:g} was scaled for, and no "
                "metrics go to MLflow. Fix: sync.fit(model, ...) with the same arguments, or "
                "model.fit(sync.distribute(...), callbacks=sync.callbacks(model))",
            )
        return fixed_fit(*args, **kwargs)

    return fit


def _fixed_call(sync: Any, model_ref: Any, name: str) -> Any:
    """A model's own ``evaluate`` or ``predict``: the class's, with Keras fixed for the strategy."""

    def call(*args: Any, **kwargs: Any) -> Any:
        from keras_sync.upstream.keras_fixes import fixed_keras

        model = model_ref()
        with fixed_keras(sync.strategy):
            return getattr(type(model), name)(model, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _batched_by_user(data: Any) -> bool:
    """Whether ``data`` comes batched (a dataset, a distributed dataset, a PyDataset), not as arrays."""
    from keras_sync.training import pipeline

    return data is not None and (
        pipeline.is_dataset(data) or hasattr(data, "__getitem__") and hasattr(data, "num_batches")
    )
