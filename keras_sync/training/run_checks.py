"""Run-time checks of every `Sync.fit`: what really trained against what keras-sync set up
(``examples_per_step``, ``examples_per_epoch``, ``learning_rate``, ``add_loss``, ``direct_fit``).
A violation is one line on the chief and the MLflow tag ``keras_sync.check.<name>``, or a
`CheckFailed` under ``checks.on_violation: error``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from keras_sync.errors import KerasSyncError
from keras_sync.training.context import RunContext
from keras_sync.training.pipeline import is_dataset
from keras_sync.training.py_dataset import is_py_dataset
from keras_sync.training.saving import for_workers, wrap_own
from keras_sync.upstream.keras_fixes import fixed_keras
from keras_sync.upstream.patching import original, patched
from keras_sync.upstream.strategy_facts import built_under


class CheckFailed(KerasSyncError):
    """A run-time check failed under ``checks.on_violation: error``."""


def step_problem(examples: int, steps: int, global_batch: int) -> str | None:
    """What is wrong when ``steps`` steps took ``examples`` (each the global batch, the last at most).

    >>> step_problem(331, 11, 32) is None, step_problem(320, 10, 32) is None
    (True, True)
    >>> step_problem(512, 16, 64)
    '16 train steps took 512 examples (32 per step), but the learning rate was scaled for a global batch of 64'
    """
    if steps <= 0 or (steps - 1) * global_batch < examples <= steps * global_batch:
        return None
    per = examples / steps
    per_text = f"{per:g}" if per == int(per) else f"{per:.1f}"
    return (
        f"{steps} train steps took {examples} examples ({per_text} per step), but the learning "
        f"rate was scaled for a global batch of {global_batch}"
    )


def epoch_problem(examples: int, expected: int) -> str | None:
    """What is wrong when an epoch trained ``examples`` of data of ``expected`` examples.

    >>> epoch_problem(331, 331) is None
    True
    >>> epoch_problem(256, 512)
    'the epoch trained 256 examples (all replicas and workers), but the data has 512: 256 were not trained'
    """
    if examples == expected:
        return None
    what = f"{expected - examples} were not trained"
    if examples > expected:
        what = f"{examples - expected} more than the data (some trained twice)"
    return f"the epoch trained {examples} examples (all replicas and workers), but the data has {expected}: {what}"


def learning_rate_problem(
    applied: float, scaled: float, *, global_batch: int, rule: str, optimizer: str | None = None
) -> str | None:
    """What is wrong when ``optimizer`` (None: ``model.optimizer``) applies a rate not the scaled one.

    >>> learning_rate_problem(0.002, 0.002, global_batch=64, rule="linear") is None
    True
    >>> learning_rate_problem(0.001, 0.002, global_batch=64, rule="linear", optimizer="g_optimizer").split(". ")[-1]
    'Fix: create g_optimizer with learning_rate=sync.lr_schedule() (or sync.learning_rate)'
    """
    if math.isclose(applied, scaled, rel_tol=1e-6):
        return None
    if optimizer is None:
        who, given, fix = "the optimizer's", "of your compile line", "compile with the optimizer's"
    else:
        who, given, fix = f"{optimizer}'s", "your script gives it", f"create {optimizer} with"
    return (
        f"{who} learning rate is {applied:g}, but keras-sync scaled {scaled:g} for the global batch "
        f"{global_batch} (learning_rate.scaling: {rule}): the rate {given} is used as it is. "
        f"Fix: {fix} learning_rate=sync.lr_schedule() (or sync.learning_rate)"
    )


def sums_over_batch(whole: float, shares: list[float]) -> bool:
    """Whether a term's value on some examples is the sum of its values on their equal shares.

    >>> sums_over_batch(10.0, [4.0, 6.0])       # rate * ops.sum(x)
    True
    >>> sums_over_batch(5.0, [4.0, 6.0])        # ops.mean(x): the mean of the shares' means
    False
    >>> sums_over_batch(3.0, [3.0, 3.0]), sums_over_batch(0.0, [0.0, 0.0])  # a weight penalty; nothing
    (False, False)
    """
    size, total = abs(whole) + sum(abs(s) for s in shares), sum(shares)
    return (
        size > 0.0
        and abs(whole - total) <= 1e-2 * size
        and abs(whole - total / len(shares)) > 0.1 * size
    )


def add_loss_problem(model: Any, data: Any, n: int, global_batch: int) -> str | None:
    """The ``add_loss`` finding: the terms on a few examples against those on them twice over."""
    import tensorflow as tf

    try:
        x = _first_rows(model, data, rows=2)
        once = _terms(model, x) if x is not None else []
        doubled = tf.nest.map_structure(lambda a: tf.concat([a, a], 0), x) if once else None
        twice = _terms(model, doubled) if once else []
    except Exception:  # a model or data it cannot call this way is not judged
        return None
    if not once or len(twice) != len(once):
        return None  # no term, or terms that depend on the batch's size: not comparable
    found = [i for i, (a, b) in enumerate(zip(once, twice)) if sums_over_batch(b, [a, a])]
    if not found:
        return None
    return (
        f"add_loss term {', '.join(str(i + 1) for i in found)} of {len(once)} (in the order of "
        f"model.losses) sums over the batch: on {n} replicas it counts 1/{n} of one device's. Fix: "
        f"write it as a mean times the global batch, e.g. add_loss(rate * {global_batch} * "
        "ops.mean(ops.sum(x, axis=-1)))"
    )


def _first_rows(model: Any, x: Any, rows: int) -> Any:
    """The first ``rows`` inputs of arrays or a dataset (not read if zeros show no term), else None."""
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec[0] if isinstance(x.element_spec, tuple) else x.element_spec
        if all(
            isinstance(s, tf.TensorSpec) and s.shape.rank and s.shape[1:].is_fully_defined()
            for s in tf.nest.flatten(spec)
        ):
            zeros = tf.nest.map_structure(lambda s: tf.zeros([rows, *s.shape[1:]], s.dtype), spec)
            if not _terms(model, zeros):
                return None
        x = next(iter(x.take(1)))  # an empty or failing dataset: not judged (the caller)
        x = x[0] if isinstance(x, tuple) else x  # (x, y[, sample_weight])
    leaves = tf.nest.flatten(x)  # a PyDataset or a generator: one leaf without a shape, not read
    if not leaves or any(
        len(getattr(a, "shape", ())) == 0 or (a.shape[0] or 0) < rows for a in leaves
    ):
        return None
    return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[:rows]), x)


def _terms(model: Any, x: Any) -> list[float]:
    """Each `model.losses` term (summed to a scalar, as Keras does) of a `stateless_call` on ``x``."""
    from keras import ops

    kwargs = {"training": False} if "training" in inspect.signature(model.call).parameters else {}
    trainable = [ops.convert_to_tensor(v) for v in model.trainable_variables]
    non_trainable = [ops.convert_to_tensor(v) for v in model.non_trainable_variables]
    _, _, losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
    return [float(ops.convert_to_numpy(ops.sum(ops.cast(term, "float32")))) for term in losses]


def reporter(context: RunContext, writer: Any = None) -> Callable[[str, str], None]:
    """``say(name, message)``: a violation, once per check, as the module docstring says."""
    said: set[str] = set()

    def say(name: str, message: str) -> None:
        if name in said:
            return
        said.add(name)
        line = f"check {name} failed: {message}."
        if context.config.checks.on_violation == "error":
            raise CheckFailed(line + " (checks.on_violation: error)")
        if context.is_chief:
            print(f"keras-sync: {line} (checks.on_violation: warn)", file=sys.stderr, flush=True)
            if writer is not None:
                writer.set_tags({f"keras_sync.check.{name}": message[:4900]})

    return say


def checks_callback(
    context: RunContext,
    writer: Any,
    *,
    global_batch: int,
    expected: int | None,
    data: Any = None,
    backups: Sequence[Any] = (),
) -> Any:
    """The Keras callback of these checks for one `fit` on ``data``; put it last (after ``backups``:
    an epoch they resume mid-way is not counted)."""
    import keras

    from keras_sync.training import instrument
    from keras_sync.training.schedules import configured_rate

    say, config, n = reporter(context, writer), context.config, context.num_replicas
    keys = ("base", "scaling", "base_batch_size")
    lr_set = any(config.source_of(f"learning_rate.{k}") != "default" for k in keys)

    def learning_rate(model: Any) -> str | None:
        if not lr_set:
            return None
        applied = instrument.applied_optimizers(model) or [("optimizer", model.optimizer)]
        problems = [
            learning_rate_problem(
                float(rate),
                context.learning_rate or 0.0,
                global_batch=context.effective_batch_size or global_batch,
                rule=config.learning_rate.scaling,
                optimizer=None if name == "optimizer" else name,
            )
            for name, optimizer in applied
            # a schedule (keras-sync's warmup, or the user's own) is not compared
            if isinstance(rate := configured_rate(optimizer), (int, float))
        ]
        return "; ".join(p for p in problems if p) or None

    checks = {
        "learning_rate": learning_rate,
        "add_loss": lambda model: add_loss_problem(model, data, n, global_batch),
    }

    class RunChecks(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self.skip_epoch = any(b.restored is not None and b.restored.mid_epoch for b in backups)
            self.due = ["learning_rate"] + (["add_loss"] if data is not None and n > 1 else [])
            # A custom train_step's optimizers are known once traced, a model built by its first step.
            self.run_due(
                learning_rate=instrument.has_default_train_step(self.model),
                add_loss=getattr(self.model, "built", False),
            )
            self.probe: Any = instrument.probe_of(self.model)  # the runtime setup callback's
            self.last = self.totals()

        def run_due(self, **ready: bool) -> None:
            for name in [name for name in self.due if ready.get(name, True)]:
                self.due.remove(name)
                if problem := checks[name](self.model):
                    say(name, problem)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.due:
                self.run_due()

        def totals(self) -> tuple[int, int]:
            self.rings = self.probe.read()  # a collective under multi-worker: every worker reads
            count = self.probe.count(self.rings)
            return count, self.probe.examples_at(self.rings, count)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            (count0, examples0), (count, examples) = self.last, self.totals()
            self.last, skip, self.skip_epoch = (count, examples), self.skip_epoch, False
            problem = step_problem(examples - examples0, count - count0, global_batch)
            # Each step but the epoch's last, as far back as the ring reaches: a short batch mid-epoch.
            start = max(count0, count - self.probe.ring)
            seen = [
                examples0 if c == count0 else self.probe.examples_at(self.rings, c)
                for c in range(start, count)
            ]
            for c, (before, now) in enumerate(zip(seen, seen[1:]), start + 1 - count0):
                if problem is None and min(before, now) >= 0 and now - before != global_batch:
                    problem = (
                        f"train step {c} took {now - before} examples, but the learning rate was "
                        f"scaled for a global batch of {global_batch} (only an epoch's last step may "
                        "be short)"
                    )
            if problem:
                say("examples_per_step", f"epoch {epoch + 1}: {problem}")
            problem = None if expected is None else epoch_problem(examples - examples0, expected)
            if problem and not skip and config.verify is None:  # verify stops mid-epoch
                say("examples_per_epoch", f"epoch {epoch + 1}: {problem}")

    return RunChecks()


def _fit_on_purpose(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a plain ``model.fit`` is on purpose: with keras-sync's callbacks or batched data."""
    data, callbacks = args[0] if args else kwargs.get("x"), kwargs.get("callbacks") or []
    ours = any(type(c).__module__.startswith("keras_sync.") for c in callbacks)
    return is_dataset(data) or is_py_dataset(data) or ours


@contextlib.contextmanager
def scope_guarding_fit(
    strategy: Any, context: RunContext, writer: Callable[[], Any]
) -> Iterator[Any]:
    """`Sync.scope`: each model compiled in it gets ``fit``/``evaluate``/``predict`` of its own."""
    import keras

    keras_compile = original(keras.Model, "compile")

    def in_scope(model: str, method: str) -> Callable[..., Any]:
        told = method != "fit"

        def run(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            nonlocal told
            if not told and not _fit_on_purpose(args, kwargs):
                told = True
                reporter(context, writer())(
                    "direct_fit",
                    f"model.fit called on {model}, built in sync.scope(), without keras-sync: Keras "
                    "batches arrays by its own batch_size (32 unless given), not by the global batch "
                    f"{context.global_batch_size} the learning rate was scaled for. Fix: sync.fit(model, "
                    "...), or model.fit(sync.distribute(...), callbacks=sync.callbacks(model))",
                )
            with fixed_keras(strategy):
                return call(*args, **kwargs)

        return run

    def compile(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = keras_compile(model, *args, **kwargs)
        if built_under(model) is strategy:
            name = type(model).__name__  # not the model: the wrappers it holds keep no cycle
            for method in ("fit", "evaluate", "predict"):
                wrap_own(model, method, in_scope(name, method), "_keras_sync_in_scope")
            if context.num_workers > 1:
                for_workers(model)
        return result

    with (
        strategy.scope() as scope,
        patched([(keras.Model, "compile", functools.wraps(keras_compile)(compile))]),
    ):
        yield scope
