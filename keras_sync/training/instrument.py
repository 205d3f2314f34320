"""Measure each replica's own loss and gradient norm inside its `train_step`, at the optimizer.

Keras runs `train_step` once per replica under `strategy.run`; the values wanted exist only there,
before the all-reduce. The model's `train_step` (Keras's or the user's) is wrapped: while it traces,
`keras_sync.training.train_step_trace.capture` shims the optimizer's ``apply`` and the loss
functions with pass-through functions that only remember the tensors they see, so Keras's own
step stays bit-identical to plain Keras.

Each replica writes ``[loss, grad_norm, examples_seen, learning_rate, step_count, loss_scale,
compute_us]`` into row ``(step_count - 1) % ring`` of an int64 ``tf.Variable(synchronization=ON_READ,
aggregation=NONE)`` (one copy per replica, never all-reduced; float32 values stored by their bits,
so counts stay exact and nothing needs float64). The callbacks read the ring every few dozen
steps; under several workers a read is a collective.

``compute_us`` is timed by two ``tf.timestamp`` ops (not under XLA or on a TPU), from the step's
first collective to the replica's gradients; the host's time between two steps is noted by
`note_host` and gathered with the ring as column ``HOST_US``.

Values are scaled to compare with one device: when the loss was divided by the replica count,
loss and norm are multiplied back by N; the norm is also divided by a `LossScaleOptimizer`'s scale.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from keras_sync.cluster import strategy_role
from keras_sync.training import train_step_trace as trace
from keras_sync.upstream.strategy_facts import in_multi_worker_mode

_MARK = "_keras_sync_instrumented"
_probes: weakref.WeakKeyDictionary[Any, ReplicaProbe] = weakref.WeakKeyDictionary()
_announced: weakref.WeakSet[Any] = weakref.WeakSet()


def has_default_train_step(model: Any) -> bool:
    """True when the model uses Keras's own TensorFlow `train_step` (no override)."""
    import keras

    return getattr(type(model), "train_step", None) is keras.Model.train_step


class ReplicaProbe:
    """The per-replica values of the last train steps, for one model.

    Build it with `instrument(model)`. ``gradients`` is the `runtime.train_step_gradients`
    policy for a custom `train_step` (``None``: observe only, Keras's sum).
    """

    #: Columns of a ring row (as returned by `read`).
    LOSS, GRAD_NORM, EXAMPLES, LR, COUNT, LOSS_SCALE, COMPUTE_US, HOST_US = range(8)
    _WRITTEN = 7  # columns the train step writes; HOST_US comes from the host
    _FLOAT_COLUMNS = (0, 1, 3, 5)

    def __init__(
        self, model: Any, ring: int = 64, gradients: str | None = None, accumulator: Any = None
    ):
        import tensorflow as tf

        self.model = model
        self.strategy = model.distribute_strategy
        self.num_replicas = int(self.strategy.num_replicas_in_sync)
        self.custom_step = not has_default_train_step(model)
        self.gradients = gradients
        #: The `keras_sync.training.accumulate.GradientAccumulator` the model optimizer's updates go
        #: through (None: none).
        self.accumulator = accumulator
        self.per_replica_supported = True
        if not self.custom_step:
            from keras_sync.upstream import internals as _internals

            _internals.require("per_replica_metrics")  # what the shims shadow must still be called
        #: Rows of the ring: the steps a reader may fall behind (with room for steps_per_execution).
        self.ring = max(int(ring), 4 * int(getattr(model, "steps_per_execution", 1) or 1))
        with self.strategy.scope():
            # Outside the model: not a weight, never saved in its checkpoints.
            self.var = tf.Variable(
                tf.zeros([self.ring + 1, self._WRITTEN], tf.int64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.NONE,
                name="keras_sync_replica_stats",
            )
        self.multi_worker = in_multi_worker_mode(self.strategy)
        #: Workers (processes) of the job; the gathered replicas are worker 0's first.
        self.num_workers = _num_workers(self.strategy) if self.multi_worker else 1
        # tf.timestamp has no XLA kernel and no TPU one.
        self.timed = "TPU" not in type(self.strategy).__name__
        import numpy as np

        #: This worker's host time before each step (us, -1: not measured), by ring row.
        self.host: Any = np.full((self.ring + 1, 1), -1, np.int64)
        self._components = list(self.strategy.experimental_local_results(self.var))
        self._gather_fn: Callable[[Any], Any] | None = None
        #: What the last trace of replica 0 saw (scaled_by, factor): for tests and `plan`-like reports.
        self.last_trace: dict[str, Any] = {}

    def read(self) -> list[Any]:
        """Every replica's ring (a ``(ring + 1, 8)`` float64 numpy array), replica 0 first.

        Row ``(c - 1) % ring`` holds ``[loss, grad_norm, examples_seen, learning_rate, c,
        loss_scale, compute_us, host_us]`` (-1: not timed; ``host_us`` is its worker's) of the replica's ``c``-th train step since the probe was made (if not yet
        overwritten); the last row's ``COUNT`` column is the count of steps so far. Under a
        multi-worker strategy this is a collective: every worker must call it at the same step.
        """
        import numpy as np

        if self.multi_worker:
            return [_decode(r) for r in self._gather(self.host).numpy()]
        return [
            _decode(np.concatenate([self._read_local(v), self.host], axis=1))
            for v in self._components
        ]

    def note_host(self, count: int, micros: float) -> None:
        """This worker's time before its ``count``-th train step (host side, microseconds)."""
        if count > 0:
            self.host[(count - 1) % self.ring, 0] = int(micros)

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
        # The raw read op of the per-device component: ~3x faster than `.numpy()` through the
        # distributed variable, on every logged step.
        import tensorflow as tf

        return tf.raw_ops.ReadVariableOp(resource=component.handle, dtype=component.dtype).numpy()

    def _gather(self, host: Any) -> Any:
        if self._gather_fn is None:
            import tensorflow as tf

            var, strategy = self.var, self.strategy

            def replica_fn(host: Any) -> Any:
                ctx = tf.distribute.get_replica_context()
                return ctx.all_gather(
                    tf.expand_dims(tf.concat([tf.identity(var), host], axis=1), 0), axis=0
                )

            @tf.function(autograph=False)  # no tensor-dependent Python: AutoGraph would only cost
            def gather(host: Any) -> Any:
                return strategy.experimental_local_results(strategy.run(replica_fn, args=(host,)))[
                    0
                ]

            self._gather_fn = gather
        import tensorflow as tf

        return self._gather_fn(tf.constant(host))

    def step_fn(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The instrumented `train_step`: ``original`` plus the writes of this replica's values."""
        import tensorflow as tf

        model, var, n, ring, probe = self.model, self.var, self.num_replicas, self.ring, self

        def train_step(data: Any) -> Any:
            seen: dict[str, Any] = {}
            timed = probe.timed and not getattr(model, "jit_compile", False)
            weight = _example_weight(data, n)  # the step's first collective (n > 1)
            t_sync = (
                _stamp(
                    [weight]
                    if weight is not None
                    else tf.nest.flatten(data, expand_composites=True)
                )
                if timed
                else None
            )
            # Read before the step: the rate this step applies (a schedule at the current
            # iteration); a read only, so the update is unchanged.
            # Every optimizer's: a custom step may apply others than model.optimizer (a GAN's two).
            rates = {id(o): _learning_rate(o) for o in trace.optimizers_of(model)}
            policy = probe.gradients or "sum"
            with trace.capture(
                model,
                seen,
                custom_step=probe.custom_step,
                policy=policy,
                num_replicas=n,
                accumulator=probe.accumulator,
                example_weight=weight,
                stamp=_stamp if timed else None,
            ):
                logs = original(data)
            probe._announce(seen)
            applied = seen.get("applied_ids") or [id(model.optimizer)]
            lr = rates.get(applied[0], _learning_rate(model.optimizer))
            loss, norm, scale = _replica_values(seen, n)
            buf = tf.identity(var)
            count = buf[ring, ReplicaProbe.COUNT] + 1
            row = tf.cast(tf.math.floormod(count - 1, ring), tf.int32)
            # step count - 1 (zeros at first)
            prev = tf.cast(tf.math.floormod(count - 2, ring), tf.int32)
            # A gather, not `buf[prev, ...]`: XLA needs a strided slice's bounds at compile time, so a
            # slice at a computed row made the ring's value a constant input of the compiled step, and
            # XLA (jit_compile, a TPU) compiled the step again at every step (tests/test_runtime.py).
            examples = tf.gather(buf[:, ReplicaProbe.EXAMPLES], prev) + tf.cast(
                _batch_size(data), tf.int64
            )
            zero = tf.constant(0, tf.int64)
            compute = tf.constant(-1, tf.int64)
            if timed and seen.get("reached") is not None:
                compute = tf.maximum(_micros(seen["reached"]) - _micros(t_sync), zero)
            var.assign(
                tf.tensor_scatter_nd_update(
                    buf,
                    tf.stack([tf.stack([row]), tf.constant([ring])]),
                    tf.stack(
                        [
                            tf.stack(
                                [
                                    _bits(loss),
                                    _bits(norm),
                                    examples,
                                    _bits(lr),
                                    count,
                                    _bits(scale),
                                    compute,
                                ]
                            ),
                            tf.stack([zero, zero, zero, zero, count, zero, zero]),
                        ]
                    ),
                )
            )
            return logs

        setattr(train_step, _MARK, True)
        return train_step

    def _announce(self, seen: dict[str, Any]) -> None:
        if not seen.get("applied"):
            return
        applies = seen["applies"]
        self.last_trace = {"scaled_by": seen["scaled_by"], "factor": seen["factor"]}
        if len({a["optimizer"] for a in applies}) > 1:
            self.last_trace["per_optimizer"] = {
                a["optimizer"]: [a["scaled_by"], a["factor"]] for a in applies
            }
        trace.remember_applied(self.model, [a["optimizer"] for a in applies])
        if self.model in _announced or not strategy_role(self.strategy).is_chief:
            return
        _announced.add(self.model)
        import sys

        averaged = [
            a["optimizer"]
            for a in applies
            if a["factor"] != 1.0 or a["scaled_by"] == trace.AT_SCALE_LOSS
        ]
        if averaged and self.gradients == "auto":
            names = averaged if len({a["optimizer"] for a in applies}) > 1 else None
            at_scale_loss = all(
                a["scaled_by"] == trace.AT_SCALE_LOSS for a in applies if a["optimizer"] in averaged
            )
            print(
                trace.averaging_message(
                    self.model, self.num_replicas, names, at_scale_loss=at_scale_loss
                ),
                file=sys.stderr,
                flush=True,
            )
        shares = sorted(
            {
                a["scaled_by"]
                for a in applies
                if a["scaled_by"] in ("a Keras loss", "tf.nn.compute_average_loss")
            }
        )
        if self.custom_step and shares and self.num_replicas > 1:
            print(
                trace.share_message(self.model, self.num_replicas, shares[0]),
                file=sys.stderr,
                flush=True,
            )


def instrument(model: Any, gradients: str | None = None, accumulator: Any = None) -> ReplicaProbe:
    """Install the instrumented `train_step` on ``model`` (once) and return its probe.

    ``gradients``: the `runtime.train_step_gradients` policy for a model that overrides
    `train_step` (``auto``, ``average``, ``sum``); None keeps the current one (or observes only).
    ``accumulator``: a `keras_sync.training.accumulate.GradientAccumulator` for the model's optimizer (None keeps
    the current one).
    The model keeps the wrapper after `fit` (a few cheap ops per step), so a second `fit` does
    not retrace. Call this before `fit` builds its train function (Keras callbacks' `set_model`
    is early enough); a train function built earlier is dropped so that `fit` rebuilds it.
    """
    probe = _probes.get(model)
    if probe is not None and getattr(model.__dict__.get("train_step"), _MARK, False):
        if gradients is not None and gradients != probe.gradients:
            probe.gradients = gradients
            model.train_function = None  # retrace with the new policy
        if accumulator is not None and accumulator is not probe.accumulator:
            probe.accumulator = accumulator
            model.train_function = None
        return probe
    probe = ReplicaProbe(model, gradients=gradients, accumulator=accumulator)
    if probe.custom_step and probe.num_replicas > 1 and gradients == "auto":
        trace.check_probes()
    original = type(model).train_step.__get__(model)
    # object.__setattr__: a function is not state for Keras's attribute tracker.
    object.__setattr__(model, "train_step", probe.step_fn(original))
    model.train_function = None
    _probes[model] = probe
    return probe


def probe_of(model: Any) -> ReplicaProbe | None:
    """The `ReplicaProbe` `instrument` put on ``model``, if any."""
    return _probes.get(model)


def holds_unapplied_gradients(model: Any) -> bool:
    """True while gradient accumulation on ``model`` holds micro-batches not applied yet."""
    accumulator = getattr(probe_of(model), "accumulator", None)
    return accumulator is not None and accumulator.pending()


def _replica_values(seen: dict[str, Any], n: int) -> tuple[Any, Any, Any]:
    """(loss, grad norm, loss scale) of this replica as float32, scaled like one device's."""
    import tensorflow as tf

    nan = tf.constant(float("nan"), tf.float32)
    # The loss was divided by n (by Keras or the user) unless keras-sync averages the gradients.
    undo = float(n) if (not seen["custom_step"] or seen["scaled_by"] is not None) else 1.0
    loss = seen.get("loss") if not seen["custom_step"] else seen.get("tape_loss")
    loss = tf.cast(loss, tf.float32) * undo if loss is not None else nan
    grads = [_dense(g) for g in seen["grads"]]
    scale = seen.get("loss_scale")
    if grads:
        norm = tf.linalg.global_norm([tf.cast(g, tf.float32) for g in grads]) * undo
        if scale is not None:
            norm = norm / tf.cast(scale, tf.float32)
    else:
        norm = nan
    return loss, norm, (tf.cast(scale, tf.float32) if scale is not None else nan)


def _example_weight(data: Any, n: int) -> Any:
    """This replica's share of the step's examples times the replica count: 1.0 when the batch
    splits evenly, else what makes the replicas' summed gradients those of the mean over the
    global batch (a last batch of 11 on 2 replicas is split 6/5; Keras weighs both means alike).

    One scalar all-reduce per step; None with one replica.
    """
    if n <= 1:
        return None
    import tensorflow as tf

    local = tf.cast(_batch_size(data), tf.float32)
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.math.divide_no_nan(local * float(n), total)


def _stamp(after: list[Any]) -> Any:
    """``tf.timestamp()`` (seconds, float64) once every tensor of ``after`` is computed."""
    import tensorflow as tf

    with tf.control_dependencies([t for t in after if t is not None]):
        return tf.timestamp()


def _micros(seconds: Any) -> Any:
    import tensorflow as tf

    return tf.cast(seconds * 1e6, tf.int64)


def _num_workers(strategy: Any) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    from keras_sync.cluster import role

    return role(
        resolver.cluster_spec().as_dict(), resolver.task_type, int(resolver.task_id)
    ).num_workers


def _decode(ring: Any) -> Any:
    """The int64 ring -> float64 numpy (host side): float columns back from their bits."""
    import numpy as np

    ring = np.asarray(ring, dtype=np.int64)
    out = ring.astype(np.float64)
    for col in ReplicaProbe._FLOAT_COLUMNS:
        out[:, col] = ring[:, col].astype(np.uint32).view(np.float32)
    return out


def _bits(x: Any) -> Any:
    import tensorflow as tf

    return tf.cast(tf.bitcast(tf.cast(x, tf.float32), tf.uint32), tf.int64)


def _learning_rate(optimizer: Any) -> Any:
    import tensorflow as tf

    try:
        return tf.cast(optimizer.learning_rate, tf.float32)
    except Exception:
        return tf.constant(float("nan"), tf.float32)


def _batch_size(data: Any) -> Any:
    import tensorflow as tf

    for t in tf.nest.flatten(data):
        if t is not None and hasattr(t, "shape") and len(t.shape) > 0:
            return tf.shape(t)[0]
    return tf.constant(0)


def _dense(g: Any) -> Any:
    import tensorflow as tf

    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
