"""What a replica's `train_step` does while TensorFlow traces it, and the gradient average of a custom one.

Keras sums the replicas' gradients after its losses divided each replica's loss by N; a custom
`train_step` as the Keras guides write it skips that division. `capture` shims what a tracing
replica reaches and decides per optimizer ``apply`` whether the loss was divided
(`runtime.train_step_gradients` ``auto``: divide an undivided one by N, ``average`` always, ``sum`` never).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from keras_sync.errors import UsageError
from keras_sync.training import loss_scale as _loss_scale
from keras_sync.upstream import keras_losses
from keras_sync.upstream.patching import original, patched
from keras_sync.upstream.replica_seeds import per_replica_seeds

#: What marks a loss keras-sync itself divided in a `LossScaleOptimizer.scale_loss` (mixed_float16).
AT_SCALE_LOSS = "keras-sync, at scale_loss"
#: What divides a loss by the replica count and leaves the tracked loss one replica's share.
SHARE_KINDS = ("a Keras loss", "tf.nn.compute_average_loss")
_tls = threading.local()


def named_optimizers(model: Any) -> dict[str, Any]:
    """The model's optimizers (a GAN's two) by attribute name, ``optimizer`` first."""
    found: dict[str, Any] = {}
    for name, value in [("optimizer", getattr(model, "optimizer", None)), *vars(model).items()]:
        if isinstance(value, keras.optimizers.Optimizer) and value not in found.values():
            found.setdefault(name.lstrip("_"), value)
    return found


def gradient_factor(
    policy: str, custom_step: bool, scaled_by: str | None, num_replicas: int
) -> float:
    """The factor keras-sync applies to the local gradients of a replica before Keras sums them.

    >>> gradient_factor("auto", True, None, 4), gradient_factor("auto", True, "a Keras loss", 4)
    (0.25, 1.0)
    >>> gradient_factor("sum", True, None, 4), gradient_factor("average", False, None, 4)
    (1.0, 1.0)
    """
    if not custom_step or num_replicas <= 1 or policy == "sum" or scaled_by == AT_SCALE_LOSS:
        return 1.0
    return 1.0 / num_replicas if policy == "average" or scaled_by is None else 1.0


def weighs_by_examples(custom_step: bool, scaled_by: str | None) -> bool:
    """Whether a replica's gradients are weighted by its share of the step's examples: when its
    loss is a mean over its own examples (not when the step divides by the global batch itself).

    >>> weighs_by_examples(False, "a Keras loss"), weighs_by_examples(True, None)
    (True, True)
    >>> weighs_by_examples(True, "tf.nn.compute_average_loss")
    False
    """
    return not custom_step or scaled_by in (None, "a Keras loss", AT_SCALE_LOSS)


def trace_lines(model: Any, n: int, applies: list[dict[str, Any]], policy: str | None) -> list[str]:
    """The chief's lines on a custom train_step's loss: what keras-sync divides, what is one share."""
    name, lines = type(model).__name__, []
    divided = [a for a in applies if a["factor"] != 1.0 or a["scaled_by"] == AT_SCALE_LOSS]
    if divided and policy == "auto":
        names = dict.fromkeys(a["optimizer"] for a in divided)
        which = f" for {', '.join(names)}" if len({a["optimizer"] for a in applies}) > 1 else ""
        where = f"them by {n} at the optimizer"
        if all(a["scaled_by"] == AT_SCALE_LOSS for a in applies if a["optimizer"] in names):
            where = f"the loss by {n} in optimizer.scale_loss (before the float16 backward pass)"
        lines.append(
            f"keras-sync: {name}.train_step does not divide its loss{which} by the replica count, and "
            f"Keras sums the {n} replicas' gradients: keras-sync divides {where}. If your loss is "
            "already divided by the replica count or the global batch, set "
            "runtime.train_step_gradients: sum."
        )
    shares = sorted({a["scaled_by"] for a in applies if a["scaled_by"] in SHARE_KINDS})
    if shares and n > 1:
        lines.append(
            f"keras-sync: {name}.train_step's loss is divided by the replica count ({shares[0]}): "
            f"the loss it returns (history, MLflow `loss`) is one replica's share: 1/{n} of the "
            "one-device value. Track loss * self.distribute_strategy.num_replicas_in_sync to log that value."
        )
    return lines


def check_probes() -> None:
    """Refuse (one line) when this Keras no longer has the internals `capture` shims."""
    if missing := keras_losses.missing():
        raise UsageError(
            "keras-sync cannot tell whether a custom train_step divides its loss by the replica count "
            f"on this Keras/TensorFlow ({missing}; {keras_losses.UPSTREAM_ISSUE}). "
            "Set runtime.train_step_gradients: average (your loss is a mean over the replica's batch) "
            "or sum (it is already divided by the replica count or global batch)."
        )


def _owner(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if isinstance(k.__dict__.get(name), property)), None)


def seen() -> dict[str, Any] | None:
    """The record of the replica tracing in this thread (None outside a `capture`)."""
    return getattr(_tls, "seen", None)


@contextlib.contextmanager
def capture(model: Any, record: dict[str, Any]) -> Iterator[None]:
    """While one replica traces ``model.train_step``: fill ``record``, average a custom step's gradients.

    ``record`` holds ``custom_step``, ``policy``, ``n``, ``accumulator``, ``example_weight`` and
    ``stamp``; it gets ``loss`` (Keras's step) or ``tape_loss``, ``grads``, ``loss_scale``,
    ``reached``, ``weighted`` (Keras's step: the gradients backprop computed from the example
    weight) and, per ``apply`` in ``applies``, the ``optimizer``'s attribute, ``scaled_by`` (what
    divided its loss) and ``factor``.
    """
    record.update(grads=[], marks={}, targets={}, read_n=False, applies=[], reached=None)
    _tls.seen = record
    try:
        # Keras random ops draw per replica too (see keras_sync.upstream.replica_seeds).
        with (
            patched(_global_patches() + _model_patches(model, record["custom_step"])),
            per_replica_seeds(),
        ):
            yield
    finally:
        _tls.seen = None


def _mark(value: Any, what: str) -> Any:
    """Remember ``value`` as a loss that needs no division by the replica count."""
    record = seen()
    if record is not None:
        with contextlib.suppress(AttributeError, TypeError):  # not a tensor: nothing to follow
            record["marks"].setdefault(value.ref(), what)
    return value


def _scaled_by(record: dict[str, Any], targets: list[Any]) -> str | None:
    """What divided (or summed) the loss ``targets`` come from (no targets: any mark so far)."""
    marks, stack, visited = record["marks"], list(targets), set()
    what = None if targets else next(iter(marks.values()), None)
    while stack and what is None:
        t = stack.pop()
        try:
            what, op = marks.get(t.ref()), t.op
        except (AttributeError, TypeError):
            continue
        if what is None and op.name not in visited:
            visited.add(op.name)
            stack.extend(op.inputs)
    return "num_replicas_in_sync" if what is None and record["read_n"] else what


def _global_patches() -> list[Any]:
    """Module and class shims that mark divided losses and note a tape's target (record in ours)."""
    keras_loss = keras_losses.module()
    scale_fn = original(keras_loss, "scale_loss_for_distribution")
    reduce_fn = original(keras_loss, "reduce_values")
    average_fn = original(tf.nn, "compute_average_loss")
    gradient_fn = original(tf.GradientTape, "gradient")

    def scale_loss_for_distribution(value: Any) -> Any:
        return _mark(scale_fn(value), "a Keras loss")

    def reduce_values(
        values: Any, sample_weight: Any = None, reduction: Any = "sum_over_batch_size"
    ) -> Any:
        out = reduce_fn(values, sample_weight, reduction)
        return _mark(out, "a Keras loss with reduction='sum'") if reduction == "sum" else out

    def compute_average_loss(*args: Any, **kwargs: Any) -> Any:
        return _mark(average_fn(*args, **kwargs), "tf.nn.compute_average_loss")

    def gradient(tape: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        record = seen()
        scalar = getattr(target, "shape", None) is not None and len(target.shape) == 0
        if record is not None and scalar and _seeds_loss_gradient(record, args, kwargs):
            # Keras's own step: backprop starts from the example weight, one scalar op instead
            # of one multiply per gradient at the optimizer.
            kwargs["output_gradients"] = tf.cast(record["example_weight"], target.dtype)
            result = gradient_fn(tape, target, *args, **kwargs)
            record["weighted"] = {id(g): g for g in tf.nest.flatten(result) if g is not None}
        else:
            result = gradient_fn(tape, target, *args, **kwargs)
        if record is not None and scalar:
            record.setdefault("tape_loss", target)
            for g in tf.nest.flatten(result):
                if g is not None:
                    record["targets"][id(g)] = target
        return result

    patches: list[tuple[Any, str, Any]] = [
        (keras_loss, "scale_loss_for_distribution", scale_loss_for_distribution),
        (keras_loss, "reduce_values", reduce_values),
        (tf.nn, "compute_average_loss", compute_average_loss),
        (tf.GradientTape, "gradient", gradient),
    ]
    patches += keras_losses.masked_means_weighed(_masked_weight)
    for cls in (tf.distribute.Strategy, tf.distribute.ReplicaContext):
        owner = _owner(cls, "num_replicas_in_sync")
        if owner is not None:
            getter = original(owner, "num_replicas_in_sync").fget
            patches.append((owner, "num_replicas_in_sync", property(_reading(getter))))
    return patches


def _masked_weight() -> tuple[Any, int] | None:
    record = seen()
    if record is None or record["example_weight"] is None:
        return None
    record["masked"] = True
    return record["example_weight"], record["n"]


def _seeds_loss_gradient(record: dict[str, Any], args: Any, kwargs: Any) -> bool:
    """True for the gradient of the loss in Keras's own `train_step` (the first after its
    ``_compute_loss``), when the replicas' gradients are weighted by their share of examples."""
    return (
        not record["custom_step"]
        and record["example_weight"] is not None
        and record.get("loss") is not None
        and "weighted" not in record
        and len(args) <= 1
        and kwargs.get("output_gradients") is None
    )


def _reading(getter: Any) -> Any:
    def num_replicas_in_sync(self: Any) -> Any:
        record = seen()
        # TensorFlow and Keras read it for their own bookkeeping; only the user's code counts.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if record is not None and not caller.startswith(("tensorflow", "keras", "tf_keras")):
            record["read_n"] = True
        return getter(self)

    return num_replicas_in_sync


def _model_patches(model: Any, custom_step: bool) -> list[Any]:
    """Instance shims on ``model`` and its optimizers for one trace."""
    patches = []
    if not custom_step:
        compute_loss = original(model, "_compute_loss")

        def _compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(*args, **kwargs)
            if (record := seen()) is not None:
                record["loss"] = loss
            return loss

        patches.append((model, "_compute_loss", _compute_loss))
    named = named_optimizers(model)
    for optimizer in _loss_scale.with_inner(list(named.values())):
        # Each row of a sparse gradient once, after the all-reduce (see keras_sync.training.loss_scale).
        update_step = _loss_scale.merging_update_step(original(optimizer, "update_step"))
        patches.append((optimizer, "update_step", update_step))
    for name, optimizer in named.items():
        patches.append(
            (optimizer, "apply", _applying(optimizer, name, original(optimizer, "apply")))
        )
        if hasattr(optimizer, "dynamic_scale"):
            patches.append((optimizer, "scale_loss", _scaling(original(optimizer, "scale_loss"))))
    return patches


def _scaling(scale_loss: Any) -> Any:
    """A `LossScaleOptimizer.scale_loss` that divides an undivided loss by N before the float16
    backward pass, as a Keras loss does (divided later, the gradients overflow at half the scale)."""

    def scale_loss_shim(loss: Any) -> Any:
        out, record = scale_loss(loss), seen()
        if record is None or not record["custom_step"] or record["n"] <= 1:
            return out
        what = _scaled_by(record, [loss])
        if record["policy"] == "sum" or (record["policy"] == "auto" and what is not None):
            return out
        return _mark(out * tf.cast(1.0 / record["n"], out.dtype), AT_SCALE_LOSS)

    return scale_loss_shim


def _applying(optimizer: Any, name: str, apply: Any) -> Any:
    def apply_shim(grads: Any, trainable_variables: Any = None) -> Any:
        record = seen()
        if record is None or getattr(_tls, "in_apply", False):
            return apply(grads, trainable_variables)
        grads, n, apply_fn, half = list(grads), record["n"], apply, None
        if _loss_scale.applies_here(optimizer, n):  # one device's skip decision
            half = [g is not None and _loss_scale.from_float16(g) for g in grads]
        if half is not None or n > 1 and _loss_scale.clips(optimizer):  # clip the sum as one device
            apply_fn = functools.partial(_loss_scale.apply_summed, optimizer, apply, half=half)
        present = [g for g in grads if g is not None]
        record["grads"].extend(present)
        if record["stamp"] is not None and record["reached"] is None:
            # Created before the apply creates its all-reduce: it does not wait for the others.
            record["reached"] = record["stamp"](tf.nest.flatten(present, expand_composites=True))
        if hasattr(optimizer, "dynamic_scale"):  # a LossScaleOptimizer's grads are scaled
            record["loss_scale"] = optimizer.dynamic_scale
        targets = {id(t): t for g in grads if (t := record["targets"].get(id(g))) is not None}
        scaled_by = _scaled_by(record, list(targets.values()))
        factor = gradient_factor(record["policy"], record["custom_step"], scaled_by, n)
        record["applies"].append({"optimizer": name, "scaled_by": scaled_by, "factor": factor})
        if factor != 1.0:
            grads = [_scaled(g, factor) for g in grads]
        weight = record["example_weight"]
        if weight is not None and weighs_by_examples(record["custom_step"], scaled_by):
            weighted = record.get("weighted", {})
            grads = [g if id(g) in weighted else _scaled(g, weight) for g in grads]
        accumulator = record["accumulator"]
        _tls.in_apply = True
        try:
            if accumulator is not None and optimizer is accumulator.optimizer:
                return accumulator.apply(apply_fn, grads, trainable_variables)
            return apply_fn(grads, trainable_variables)
        finally:
            _tls.in_apply = False

    return apply_shim


def _scaled(g: Any, factor: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return None if g is None else g * tf.cast(factor, g.dtype)
