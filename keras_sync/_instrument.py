"""Measure each replica's own loss and gradient norm inside Keras's default `train_step`.

Keras 3 (TensorFlow backend) runs `train_step` once per replica under `strategy.run`; the
values we want exist only there, before the all-reduce. We wrap the model's `train_step`:
while it is *traced*, `model._compute_loss` and `optimizer.apply_gradients` are shadowed on
the instances by pass-through functions that only remember the tensors they see (the loss,
the local gradients). No op of the step is changed or reordered, so training stays
bit-identical to plain Keras (tests/test_sync_metrics.py checks the weights). The wrapper
then writes ``[loss, grad_norm, examples_seen, learning_rate, step_count]`` of the replica
into row ``(step_count - 1) % ring`` of a ``tf.Variable(synchronization=ON_READ,
aggregation=NONE)`` (one copy per replica, never all-reduced; its last row holds the step
count). The callbacks read the whole ring once every few dozen steps, not after every step:
a read costs ~0.2 ms on the training thread (and is a collective across workers), which at
one read per step was a measurable part of a 5 ms step.

Scaling (so values compare with a single-device run): Keras divides each replica's loss by
the number of replicas, so its local gradient is ``1/N`` of the gradient of the replica's own
mean loss. We report the replica's own mean loss (``loss * N``) and the global norm of the
gradient of that loss (``||grads|| * N``, also divided by the loss scale of a
`LossScaleOptimizer`). The gradient the optimizer applies is the mean of the replicas' ones.

A model that overrides `train_step` keeps its own: we only count the examples of each step
around it (for throughput), and loss and gradient norm are NaN.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Iterator

from keras_sync.strategy import in_multi_worker_mode

log = logging.getLogger("keras_sync")

_MARK = "_keras_sync_instrumented"
_probes: weakref.WeakKeyDictionary[Any, ReplicaProbe] = weakref.WeakKeyDictionary()


def has_default_train_step(model: Any) -> bool:
    """True when the model uses Keras's own TensorFlow `train_step` (no override)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(type(model), "train_step", None) is TensorFlowTrainer.train_step


class ReplicaProbe:
    """The per-replica values of the last train step, for one model.

    Build it with `instrument(model)`. ``per_replica_supported`` says whether loss and gradient
    norm are measured (False for a model with its own `train_step`).
    """

    #: Columns of a ring row.
    LOSS, GRAD_NORM, EXAMPLES, LR, COUNT = range(5)

    def __init__(self, model: Any, ring: int = 64):
        import tensorflow as tf

        self.model = model
        self.strategy = model.distribute_strategy
        self.num_replicas = int(self.strategy.num_replicas_in_sync)
        self.per_replica_supported = has_default_train_step(model)
        if self.per_replica_supported:
            from keras_sync import _internals

            _internals.require("per_replica_metrics")  # what the shims below shadow must still be called
        #: Rows of the ring: the steps a reader may fall behind (with room for steps_per_execution).
        self.ring = max(int(ring), 4 * int(getattr(model, "steps_per_execution", 1) or 1))
        with self.strategy.scope():
            # Outside the model: not a weight, never saved in its checkpoints.
            self.var = tf.Variable(
                tf.zeros([self.ring + 1, 5], tf.float64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.NONE,
                name="keras_sync_replica_stats",
            )
        self.multi_worker = in_multi_worker_mode(self.strategy)
        self._components = list(self.strategy.experimental_local_results(self.var))
        self._gather_fn: Callable[[], Any] | None = None

    def read(self) -> list[Any]:
        """Every replica's ring (a ``(ring + 1, 5)`` float64 array), replica 0 first.

        Row ``(c - 1) % ring`` holds ``[loss, grad_norm, examples_seen, learning_rate, c]`` of
        the replica's ``c``-th train step since the probe was made (if not yet overwritten); the
        last row's last column is the count of steps so far. Under a multi-worker strategy this
        is a collective: every worker must call it at the same step (the callbacks do).
        """
        if self.multi_worker:
            return list(self._gather().numpy())
        return [self._read_local(v) for v in self._components]

    def row(self, rings: list[Any], count: int) -> list[Any] | None:
        """Each replica's row of step ``count`` from `read`'s result; None if it was overwritten."""
        rows = [r[(count - 1) % self.ring] for r in rings]
        return rows if count > 0 and all(int(r[self.COUNT]) == count for r in rows) else None

    @staticmethod
    def count(rings: list[Any]) -> int:
        """Train steps run so far (the ring's step counter)."""
        return int(rings[0][-1][ReplicaProbe.COUNT]) if rings else 0

    @staticmethod
    def _read_local(component: Any) -> Any:
        # The raw read op of the per-device component: ~4x faster than `.numpy()` through the
        # distributed variable (measured here: ~120 us vs ~500 us), and this runs on every
        # logged step. Falls back to the public read if TensorFlow moves the op.
        try:
            from tensorflow.python.ops import gen_resource_variable_ops

            return gen_resource_variable_ops.read_variable_op(component.handle, component.dtype).numpy()
        except (ImportError, AttributeError):
            return component.numpy()

    def _gather(self) -> Any:
        if self._gather_fn is None:
            import tensorflow as tf

            var, strategy = self.var, self.strategy

            def replica_fn() -> Any:
                ctx = tf.distribute.get_replica_context()
                return ctx.all_gather(tf.expand_dims(tf.identity(var), 0), axis=0)

            @tf.function
            def gather() -> Any:
                return strategy.experimental_local_results(strategy.run(replica_fn))[0]

            self._gather_fn = gather
        return self._gather_fn()

    def step_fn(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The instrumented `train_step`: ``original`` plus the writes of this replica's values."""
        import tensorflow as tf

        model, var, n, ring = self.model, self.var, float(self.num_replicas), self.ring
        capture = self.per_replica_supported

        def train_step(data: Any) -> Any:
            seen: dict[str, Any] = {}
            # Read before the step: the rate this step applies (a schedule at the current
            # iteration); a read only, so the update is unchanged.
            lr = _learning_rate(model.optimizer)
            with _capture(model, seen) if capture else contextlib.nullcontext():
                logs = original(data)
            examples = tf.cast(_batch_size(data), tf.float64)
            loss = seen.get("loss")
            loss = tf.cast(loss, tf.float64) * n if loss is not None else tf.constant(float("nan"), tf.float64)
            grads = [g for g in seen.get("grads", ()) if g is not None]
            if grads:
                norm = tf.cast(tf.linalg.global_norm([tf.cast(_dense(g), tf.float32) for g in grads]), tf.float64) * n
                scale = seen.get("loss_scale")
                if scale is not None:
                    norm = norm / tf.cast(scale, tf.float64)
            else:
                norm = tf.constant(float("nan"), tf.float64)
            buf = tf.identity(var)
            count = buf[ring, 4] + 1.0
            row = tf.cast(tf.math.floormod(count - 1.0, ring), tf.int32)
            prev = tf.cast(tf.math.floormod(count - 2.0, ring), tf.int32)  # step count - 1 (zeros at first)
            zero = tf.constant(0.0, tf.float64)
            var.assign(tf.tensor_scatter_nd_update(
                buf, tf.stack([tf.stack([row]), tf.constant([ring])]),
                tf.stack([tf.stack([loss, norm, buf[prev, 2] + examples, lr, count]),
                          tf.stack([zero, zero, zero, zero, count])])))
            return logs

        setattr(train_step, _MARK, True)
        return train_step


def instrument(model: Any) -> ReplicaProbe:
    """Install the instrumented `train_step` on ``model`` (once) and return its probe.

    The model keeps it after `fit` (a few cheap ops per step), so a second `fit` does not
    retrace. Call this before `fit` builds its train function (Keras callbacks' `set_model`
    is early enough); a train function built earlier is dropped so that `fit` rebuilds it.
    """
    probe = _probes.get(model)
    if probe is not None and getattr(model.__dict__.get("train_step"), _MARK, False):
        return probe
    probe = ReplicaProbe(model)
    original = type(model).train_step.__get__(model)
    # object.__setattr__: a function is not state for Keras's attribute tracker.
    object.__setattr__(model, "train_step", probe.step_fn(original))
    model.train_function = None
    _probes[model] = probe
    return probe


# MirroredStrategy traces `train_step` once per replica, each in its own thread, switching
# threads inside `apply_gradients` (merge_call): the shims are installed while any replica
# traces, and each thread records into its own dict.
_lock = threading.Lock()
_tls = threading.local()
_installed: dict[int, int] = {}


@contextlib.contextmanager
def _capture(model: Any, seen: dict[str, Any]) -> Iterator[None]:
    """While Keras's `train_step` is traced, remember its loss and local gradients."""
    optimizer = model.optimizer
    with _lock:
        if _installed.get(id(model), 0) == 0:
            _install_shims(model, optimizer)
        _installed[id(model)] = _installed.get(id(model), 0) + 1
    _tls.seen = seen
    try:
        yield
    finally:
        _tls.seen = None
        with _lock:
            _installed[id(model)] -= 1
            if _installed[id(model)] == 0:
                del _installed[id(model)]
                object.__delattr__(model, "_compute_loss")
                object.__delattr__(optimizer, "apply_gradients")


def _install_shims(model: Any, optimizer: Any) -> None:
    compute_loss = model._compute_loss
    apply_gradients = optimizer.apply_gradients

    def _compute_loss(*args: Any, **kwargs: Any) -> Any:
        loss = compute_loss(*args, **kwargs)
        seen = getattr(_tls, "seen", None)
        if seen is not None:
            seen["loss"] = loss
        return loss

    def _apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        seen = getattr(_tls, "seen", None)
        if seen is not None:
            seen["grads"] = [g for g, _ in pairs]
            scale = getattr(optimizer, "dynamic_scale", None)  # LossScaleOptimizer: grads are scaled
            if scale is not None:
                seen["loss_scale"] = scale
        return apply_gradients(pairs, *args, **kwargs)

    # object.__setattr__: plain functions, not state for Keras's attribute tracker.
    object.__setattr__(model, "_compute_loss", _compute_loss)
    object.__setattr__(optimizer, "apply_gradients", _apply_gradients)


def _learning_rate(optimizer: Any) -> Any:
    import tensorflow as tf

    try:
        return tf.cast(optimizer.learning_rate, tf.float64)
    except Exception:  # noqa: BLE001 - an optimizer without a readable rate: no metric
        return tf.constant(float("nan"), tf.float64)


def _batch_size(data: Any) -> Any:
    import tensorflow as tf

    for t in tf.nest.flatten(data):
        if t is not None and hasattr(t, "shape") and len(t.shape) > 0:
            return tf.shape(t)[0]
    return tf.constant(0)


def _dense(g: Any) -> Any:
    import tensorflow as tf

    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g

