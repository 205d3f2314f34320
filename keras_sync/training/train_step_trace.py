"""What a replica's `train_step` does while TensorFlow traces it, and the gradient average of a custom one.

Keras sums the replicas' gradients in the optimizer (an all-reduce SUM). Its own `train_step`,
`Model.compute_loss` and every `keras.losses.Loss` object first divide each replica's loss by the
replica count (Keras's ``scale_loss_for_distribution``, `keras_sync.upstream.keras_losses`), so the sum is the gradient of
the mean loss over the global batch, as on one device. A `train_step` written the way the Keras
guides show -- a `GradientTape`, ``keras.ops.mean`` of a loss function, ``optimizer.apply_gradients``
-- skips that division and trains at N x the learning rate on N replicas, silently.

While a replica traces its `train_step` (once per replica, in the replica's own thread under
`MirroredStrategy`), `capture` shims a few functions on the instances, classes and modules that
step reaches; each shim only remembers what it saw in the tracing thread's dict and calls the
original. What it remembers: the loss (Keras's ``_compute_loss`` result, or the first scalar a
`GradientTape` differentiates), the local gradients given to each optimizer's ``apply``, the
optimizer's loss scale, and, for each ``apply`` (each optimizer of a GAN's step on its own),
whether the loss those gradients come from needs no division by the replica count: the tensors
that Keras divided (a `Loss` object, ``compute_loss``, ``add_loss`` terms), that
``tf.nn.compute_average_loss`` returned, or that a Keras `Loss` with ``reduction="sum"`` returned
(a sum over the replica's batch: the replicas' sum is one device's sum) are marked, and the
differentiated target's graph is walked back to them. The user's own code reading
``num_replicas_in_sync`` before an ``apply`` counts for that ``apply`` (a Python number leaves no
tensor to follow).

For a model that overrides `train_step`, under `runtime.train_step_gradients`:
``auto`` divides an ``apply``'s gradients by N when nothing divided their loss (and prints one
line saying so and how to turn it off); ``average`` always divides; ``sum`` never does (Keras's
behaviour). The training ops are otherwise untouched.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from keras_sync.training import loss_scale as _loss_scale

log = logging.getLogger("keras_sync")

POLICIES = ("auto", "average", "sum")
#: What marks a loss keras-sync itself divided in a `LossScaleOptimizer.scale_loss` (mixed_float16).
AT_SCALE_LOSS = "keras-sync, at scale_loss"
_tls = threading.local()


def optimizers_of(model: Any) -> list[Any]:
    """The model's optimizer and any other optimizer it holds as an attribute (a GAN's two)."""
    import keras

    found: dict[int, Any] = {}
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


def gradient_factor(
    policy: str, custom_step: bool, scaled_by: str | None, num_replicas: int
) -> float:
    """The factor keras-sync applies to the local gradients of a replica before Keras sums them.

    >>> gradient_factor("auto", True, None, 4)         # a loss mean over the replica's batch
    0.25
    >>> gradient_factor("auto", True, "a Keras loss", 4), gradient_factor("sum", True, None, 4)
    (1.0, 1.0)
    >>> gradient_factor("average", False, None, 4)     # Keras's own train_step already scales
    1.0
    """
    if not custom_step or num_replicas <= 1 or policy == "sum":
        return 1.0
    if policy == "average" or scaled_by is None:
        return 1.0 / num_replicas
    return 1.0


def averaging_message(
    model: Any,
    num_replicas: int,
    optimizers: list[str] | None = None,
    *,
    at_scale_loss: bool = False,
) -> str:
    """The line printed on the chief when keras-sync averages a custom train_step's gradients.

    ``optimizers``: the attributes of the optimizers whose gradients are averaged, when the step
    applies several (a GAN's). ``at_scale_loss``: the loss is divided in `LossScaleOptimizer.scale_loss`.
    """
    name = type(model).__name__
    which = f" for {', '.join(optimizers)}" if optimizers else ""
    where = (
        f"the loss by {num_replicas} in optimizer.scale_loss (before the float16 backward pass)"
        if at_scale_loss
        else f"them by {num_replicas} at the optimizer"
    )
    return (
        f"keras-sync: {name}.train_step does not divide its loss{which} by the replica count (that loss comes "
        f"from no Keras loss object, compute_loss, tf.nn.compute_average_loss or num_replicas_in_sync), and Keras "
        f"sums the gradients of the {num_replicas} replicas: keras-sync divides {where} so that a "
        "step equals one device's. If your loss is already divided by the replica count or the global batch, "
        "set runtime.train_step_gradients: sum."
    )


def check_probes() -> None:
    """Refuse (one line) when this Keras/TensorFlow no longer has what `capture` shims."""
    import tensorflow as tf

    from keras_sync.errors import UsageError
    from keras_sync.upstream import keras_losses

    missing = keras_losses.missing() + [
        what
        for what, ok in (
            ("tf.nn.compute_average_loss", callable(getattr(tf.nn, "compute_average_loss", None))),
            (
                "tf.distribute.Strategy.num_replicas_in_sync",
                _owner(tf.distribute.Strategy, "num_replicas_in_sync") is not None,
            ),
            (
                "tf.distribute.ReplicaContext.num_replicas_in_sync",
                _owner(tf.distribute.ReplicaContext, "num_replicas_in_sync") is not None,
            ),
        )
        if not ok
    ]
    if missing:
        raise UsageError(
            f"keras-sync cannot tell whether a custom train_step divides its loss by the replica count on this "
            f"Keras/TensorFlow ({', '.join(missing)} not found; {keras_losses.UPSTREAM_ISSUE}). Set "
            "runtime.train_step_gradients: average (your loss is "
            "a mean over the replica's batch) or sum (it is already divided by the replica count or global batch)."
        )


def _owner(cls: type, name: str) -> type | None:
    for klass in cls.__mro__:
        if isinstance(klass.__dict__.get(name), property):
            return klass
    return None


def seen() -> dict[str, Any] | None:
    """The record of the replica tracing in this thread (None outside a `capture`)."""
    return getattr(_tls, "seen", None)


def weighs_by_examples(custom_step: bool, scaled_by: str | None) -> bool:
    """Whether a replica's gradients are weighted by its share of the step's examples.

    Exact when the replica's loss is a mean over its own examples (divided by the replica count):
    Keras's `train_step`, a Keras loss object, or a custom step keras-sync averages. A step that
    divides by the global batch itself (``tf.nn.compute_average_loss``, ``num_replicas_in_sync``)
    is left as written.

    >>> weighs_by_examples(False, "a Keras loss"), weighs_by_examples(True, None)
    (True, True)
    >>> weighs_by_examples(True, "tf.nn.compute_average_loss")
    False
    """
    return not custom_step or scaled_by in (None, "a Keras loss", AT_SCALE_LOSS)


@contextlib.contextmanager
def capture(
    model: Any,
    record: dict[str, Any],
    *,
    custom_step: bool,
    policy: str,
    num_replicas: int,
    accumulator: Any = None,
    example_weight: Any = None,
    stamp: Any = None,
) -> Iterator[None]:
    """While one replica traces ``model.train_step``: fill ``record``, average a custom step's gradients.

    ``record`` gets ``loss``, ``grads`` (every local gradient given to an optimizer), ``loss_scale``
    (a `LossScaleOptimizer`'s), ``scaled_by`` (what divided the loss by the replica count, if
    anything) and ``factor`` (what keras-sync multiplied the gradients by). ``example_weight``
    (a scalar tensor, see `keras_sync.training.instrument._example_weight`) multiplies the gradients too, when
    `weighs_by_examples`. ``stamp`` (a function of tensors -> a timestamp after them), if given,
    times the first apply's gradients into ``reached``, before the apply's all-reduce. With an
    ``accumulator`` (`keras_sync.training.accumulate.GradientAccumulator`), the model optimizer's updates go through it.
    """
    record.update(
        grads=[],
        scaled_by=None,
        factor=1.0,
        custom_step=custom_step,
        policy=policy,
        n=num_replicas,
        accumulator=accumulator,
        example_weight=example_weight,
        marks={},
        targets={},
        read_n=False,
        applies=[],
        names=_optimizer_names(model),
        stamp=stamp,
        reached=None,
    )
    from keras_sync.upstream.patching import patched
    from keras_sync.upstream.replica_seeds import per_replica_seeds

    _tls.seen = record
    try:
        # Keras random ops draw per replica too (see keras_sync.upstream.replica_seeds).
        with patched(_global_patches() + _model_patches(model, custom_step)), per_replica_seeds():
            yield
    finally:
        _tls.seen = None


def _mark(value: Any, what: str) -> Any:
    """Remember ``value`` as a loss that needs no division by the replica count (``what`` says why)."""
    record = seen()
    if record is not None:
        try:
            record["marks"].setdefault(value.ref(), what)
        except (AttributeError, TypeError):  # not a tensor: nothing to follow
            pass
    return value


def _optimizer_names(model: Any) -> dict[int, str]:
    """id(optimizer) -> the model attribute that holds it (``optimizer`` first)."""
    names: dict[int, str] = {}
    for name in ["optimizer", *vars(model)]:
        value = (
            model.__dict__.get(name) if name != "optimizer" else getattr(model, "optimizer", None)
        )
        if value is not None and hasattr(value, "apply_gradients"):
            names.setdefault(id(value), name.lstrip("_"))
    return names


def _upstream_mark(targets: list[Any], marks: dict[Any, str]) -> str | None:
    """The first marked tensor the graph of ``targets`` is computed from (None: none)."""
    stack, visited = list(targets), set()
    while stack:
        t = stack.pop()
        try:
            what = marks.get(t.ref())
            if what is not None:
                return what
            op = t.op
        except (AttributeError, TypeError):
            continue
        if op.name in visited:
            continue
        visited.add(op.name)
        stack.extend(op.inputs)
    return None


def scaled_by_for(record: dict[str, Any], grads: list[Any]) -> str | None:
    """What divided (or summed) the loss these gradients come from; None when nothing did."""
    targets = {
        id(t): t
        for g in grads
        if g is not None
        for t in [record["targets"].get(id(g))]
        if t is not None
    }
    if targets:
        what = _upstream_mark(list(targets.values()), record["marks"])
    else:  # gradients not from a tape we saw: any mark so far counts
        what = next(iter(record["marks"].values()), None)
    if what is None and record["read_n"]:
        what = "num_replicas_in_sync"
    return what


def _global_patches() -> list[Any]:
    """Module/class shims for the loss-scaling detection and the tape's target (all threads; record in ours)."""
    import tensorflow as tf

    from keras_sync.upstream import keras_losses
    from keras_sync.upstream.patching import original

    keras_loss = keras_losses.module()

    scale_fn = original(keras_loss, "scale_loss_for_distribution")

    def scale_loss_for_distribution(value: Any) -> Any:
        return _mark(scale_fn(value), "a Keras loss")

    reduce_fn = original(keras_loss, "reduce_values")

    def reduce_values(
        values: Any, sample_weight: Any = None, reduction: Any = "sum_over_batch_size"
    ) -> Any:
        out = reduce_fn(values, sample_weight, reduction)
        return _mark(out, "a Keras loss with reduction='sum'") if reduction == "sum" else out

    average_fn = original(tf.nn, "compute_average_loss")

    def compute_average_loss(*args: Any, **kwargs: Any) -> Any:
        return _mark(average_fn(*args, **kwargs), "tf.nn.compute_average_loss")

    gradient_fn = original(tf.GradientTape, "gradient")

    def gradient(tape: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        record = seen()
        scalar = getattr(target, "shape", None) is not None and len(target.shape) == 0
        if record is not None and "tape_loss" not in record and scalar:
            record["tape_loss"] = target
        result = gradient_fn(tape, target, *args, **kwargs)
        if record is not None and scalar:
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
    for cls in (tf.distribute.Strategy, tf.distribute.ReplicaContext):
        owner = _owner(cls, "num_replicas_in_sync")
        if owner is not None:
            prop = original(owner, "num_replicas_in_sync")
            patches.append((owner, "num_replicas_in_sync", property(_reading(prop))))
    return patches


def _reading(prop: property) -> Any:
    getter: Any = prop.fget

    def num_replicas_in_sync(self: Any) -> Any:
        record = seen()
        if record is not None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            # TensorFlow and Keras read it for their own bookkeeping; only the user's code counts.
            if not caller.startswith(("tensorflow", "keras", "tf_keras")):
                record["read_n"] = True
        return getter(self)

    return num_replicas_in_sync


def _model_patches(model: Any, custom_step: bool) -> list[Any]:
    """Instance shims on ``model`` and its optimizers for one trace."""
    from keras_sync.training.sparse_rows import merging_update_step, with_inner
    from keras_sync.upstream.patching import original

    patches = []
    if not custom_step:
        compute_loss = original(model, "_compute_loss")

        def _compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(*args, **kwargs)
            record = seen()
            if record is not None:
                record["loss"] = loss
            return loss

        patches.append((model, "_compute_loss", _compute_loss))
    for optimizer in with_inner(optimizers_of(model)):
        # Each row of a sparse gradient once, after the all-reduce (see keras_sync.training.sparse_rows).
        update_step = merging_update_step(original(optimizer, "update_step"))
        patches.append((optimizer, "update_step", update_step))
    for optimizer in optimizers_of(model):
        patches.append((optimizer, "apply", _applying(optimizer, original(optimizer, "apply"))))
        if hasattr(optimizer, "dynamic_scale"):
            scale_loss = _scaling(original(optimizer, "scale_loss"))
            patches.append((optimizer, "scale_loss", scale_loss))
    return patches


def _scaling(scale_loss: Any) -> Any:
    """A `LossScaleOptimizer.scale_loss` that divides an undivided loss by N *before* the backward pass.

    Divided only at the optimizer, the float16 gradients of a replica's mean over B/N examples are
    N x one device's inside the backward pass, and overflow at half the loss scale: more steps are
    skipped than on one device and the scale falls. Dividing the loss here, as a Keras loss
    object does, keeps the backward pass at one device's magnitudes.
    """

    def scale_loss_shim(loss: Any) -> Any:
        out = scale_loss(loss)
        record = seen()
        if (
            record is None
            or not record["custom_step"]
            or record["n"] <= 1
            or record["policy"] == "sum"
        ):
            return out
        what = _upstream_mark([loss], record["marks"]) or (
            "num_replicas_in_sync" if record["read_n"] else None
        )
        if record["policy"] == "auto" and what is not None:
            return out
        import tensorflow as tf

        return _mark(out * tf.cast(1.0 / record["n"], out.dtype), AT_SCALE_LOSS)

    return scale_loss_shim


def _applying(optimizer: Any, apply: Any) -> Any:
    def apply_shim(grads: Any, trainable_variables: Any = None) -> Any:
        record = seen()
        if record is None or getattr(_tls, "in_apply", False):
            return apply(grads, trainable_variables)
        grads = list(grads)
        apply_fn = apply
        if _loss_scale.applies_here(
            optimizer, record["n"]
        ):  # one device's skip decision (see _loss_scale)
            half = [g is not None and _loss_scale.from_float16(g) for g in grads]

            def apply_fn(grads: Any, trainable_variables: Any = None) -> Any:
                return _loss_scale.apply(optimizer, apply, list(grads), trainable_variables, half)
        elif record["n"] > 1 and _loss_scale.clips(
            optimizer
        ):  # clip the sum, as one device (see _loss_scale)

            def apply_fn(grads: Any, trainable_variables: Any = None) -> Any:
                return _loss_scale.apply_summed(optimizer, apply, list(grads), trainable_variables)

        record["grads"].extend(g for g in grads if g is not None)
        if record["stamp"] is not None and record["reached"] is None:
            import tensorflow as tf

            # Created before the apply creates its all-reduce: it does not wait for the others.
            record["reached"] = record["stamp"](
                tf.nest.flatten([g for g in grads if g is not None], expand_composites=True)
            )
        scale = getattr(optimizer, "dynamic_scale", None)  # a LossScaleOptimizer's grads are scaled
        if scale is not None:
            record["loss_scale"] = scale
        scaled_by = scaled_by_for(record, grads)
        factor = (
            1.0
            if scaled_by == AT_SCALE_LOSS
            else gradient_factor(record["policy"], record["custom_step"], scaled_by, record["n"])
        )
        if not record.get("applied"):
            record["scaled_by"], record["factor"] = scaled_by, factor
        record["applied"] = True
        record.setdefault("applied_ids", []).append(id(optimizer))
        record["applies"].append(
            {
                "optimizer": record["names"].get(id(optimizer), type(optimizer).__name__),
                "scaled_by": scaled_by,
                "factor": factor,
            }
        )
        if factor != 1.0:
            grads = [_scaled(g, factor) for g in grads]
        weight = record["example_weight"]
        if weight is not None and weighs_by_examples(
            record["custom_step"], scaled_by
        ):  # this apply's rule
            grads = [_scaled(g, weight) for g in grads]
        accumulator = record["accumulator"]
        _tls.in_apply = True
        try:
            if accumulator is not None and optimizer is accumulator.optimizer:
                return accumulator.apply(apply_fn, grads, trainable_variables)
            return apply_fn(grads, trainable_variables)
        finally:
            _tls.in_apply = False

    return apply_shim


def _scaled(g: Any, factor: float) -> Any:
    import tensorflow as tf

    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


def share_message(model: Any, num_replicas: int, scaled_by: str) -> str:
    """The line printed on the chief when a custom train_step's loss is one replica's share."""
    name = type(model).__name__
    return (
        f"keras-sync: {name}.train_step's loss is divided by the replica count ({scaled_by}), as Keras needs for "
        f"the gradient sum, so the loss the step returns or tracks (history, MLflow `loss`) is one replica's share: "
        f"1/{num_replicas} of the one-device value (sync/loss/replica_<i> are multiplied back to one device's). "
        "To log the one-device value, track loss * self.distribute_strategy.num_replicas_in_sync."
    )


_applied: Any = None


def remember_applied(model: Any, names: list[str]) -> None:
    """Note the attributes of the optimizers ``model``'s traced step applied (in order, once each)."""
    global _applied
    import weakref

    if _applied is None:
        _applied = weakref.WeakKeyDictionary()
    if names:
        _applied[model] = list(dict.fromkeys(names))


def applied_optimizers(model: Any) -> list[tuple[str, Any]]:
    """(attribute, optimizer) of each optimizer ``model``'s train step applies; [] before its first trace."""
    names = _applied.get(model, []) if _applied is not None else []
    out = []
    for name in names:
        value = getattr(model, name, None)
        if value is None:
            value = model.__dict__.get("_" + name)
        if value is not None and hasattr(value, "apply_gradients"):
            out.append((name, value))
    return out
