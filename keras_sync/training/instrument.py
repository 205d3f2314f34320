"""Measure each replica's own loss and gradient norm inside its `train_step`, before the all-reduce.

Each replica writes its row (loss, norm, examples, ...) into a ring of an int64 ON_READ variable
(floats by their bits, so counts stay exact), which the callbacks read every few dozen steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_sync.cluster import strategy_role
from keras_sync.training import train_step_trace as trace
from keras_sync.training.accumulate import replica_local
from keras_sync.upstream import internals as _internals
from keras_sync.upstream.strategy_facts import in_multi_worker_mode


def has_default_train_step(model: Any) -> bool:
    """True when the model uses Keras's own TensorFlow `train_step` (no override)."""
    return getattr(type(model), "train_step", None) is keras.Model.train_step


class ReplicaProbe:
    """The per-replica values of the last train steps of one model; build it with `instrument`."""

    #: Columns of a ring row (as returned by `read`).
    LOSS, GRAD_NORM, EXAMPLES, LR, COUNT, LOSS_SCALE, COMPUTE_US, HOST_US = range(8)
    _WRITTEN = 7  # columns the train step writes; HOST_US comes from the host
    _FLOAT_COLUMNS = (0, 1, 3, 5)

    def __init__(self, model: Any, gradients: str | None, accumulator: Any):
        self.model, self.strategy = model, model.distribute_strategy
        self.num_replicas = int(self.strategy.num_replicas_in_sync)
        self.custom_step = not has_default_train_step(model)
        self.gradients, self.accumulator = gradients, accumulator
        if not self.custom_step:
            _internals.require("per_replica_metrics")  # what the shims shadow must still be called
        #: Rows of the ring: the steps a reader may fall behind (with room for steps_per_execution).
        self.ring = max(64, 4 * int(getattr(model, "steps_per_execution", 1) or 1))
        with self.strategy.scope():  # outside the model: not a weight, never saved
            zeros = tf.zeros([self.ring + 1, self._WRITTEN], tf.int64)
            self.var = replica_local(zeros, "keras_sync_replica_stats")
        self.multi_worker = in_multi_worker_mode(self.strategy)
        #: Workers (processes) of the job; the gathered replicas are worker 0's first.
        self.num_workers = strategy_role(self.strategy).num_workers if self.multi_worker else 1
        self.timed = "TPU" not in type(self.strategy).__name__  # tf.timestamp: no TPU kernel
        #: This worker's host time before each step (us, -1: not measured), by ring row.
        self.host: Any = np.full((self.ring + 1, 1), -1, np.int64)
        self._components = list(self.strategy.experimental_local_results(self.var))
        self._gather = _gather_fn(self.var, self.strategy)  # traced at its first call
        #: Each optimizer ``apply`` of the last trace of replica 0 (see `train_step_trace.capture`).
        self.applies: list[dict[str, Any]] = []
        self._told = False
        #: Whether the traced step's loss was a mean over masked entries (see train_step_trace).
        self.masked_loss = False
        #: `WeightDivergence`'s traced comparison of this model: (variable ids, function).
        self.weight_gather: tuple[tuple[int, ...], Any] | None = None

    def read(self) -> list[Any]:
        """Every replica's ring (``(ring + 1, 8)`` float64), replica 0 first; the last row's
        ``COUNT`` is the steps so far. A collective under multi-worker: every worker calls it."""
        if self.multi_worker:
            return [_decode(r) for r in self._gather(tf.constant(self.host)).numpy()]
        # The raw read op of each per-device component: ~3x faster than through the distributed variable.
        local = [
            tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype) for v in self._components
        ]
        return [_decode(np.concatenate([r.numpy(), self.host], axis=1)) for r in local]

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

    def examples_at(self, rings: list[Any], count: int) -> int:
        """Examples all replicas trained up to step ``count`` (-1: no longer in the ring)."""
        rows = self.row(rings, count) if count > 0 else []
        return -1 if rows is None else int(sum(r[self.EXAMPLES] for r in rows))

    def step_fn(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The instrumented `train_step`: ``original`` plus the writes of this replica's values."""
        model, var, n, ring, probe = self.model, self.var, self.num_replicas, self.ring, self

        def train_step(data: Any) -> Any:
            timed = probe.timed and not getattr(model, "jit_compile", False)
            size = _batch_size(data)
            weight = _example_weight(size, n)  # the step's first collective (n > 1)
            after = [weight] if n > 1 else tf.nest.flatten(data, expand_composites=True)
            t_sync = _stamp(after) if timed else None
            # Each optimizer's rate before the step (a read only): a GAN's step applies two.
            named = trace.named_optimizers(model)
            rates = {k: tf.cast(o.learning_rate, tf.float32) for k, o in named.items()}
            seen: dict[str, Any] = dict(
                custom_step=probe.custom_step,
                n=n,
                example_weight=weight,
                stamp=_stamp if timed else None,
                policy=probe.gradients or "sum",
                accumulator=probe.accumulator,
            )
            with trace.capture(model, seen):
                logs = original(data)
            probe._announce(seen["applies"])
            probe.masked_loss = probe.masked_loss or bool(seen.get("masked"))
            first = seen["applies"][0]["optimizer"] if seen["applies"] else "optimizer"
            loss, norm, scale = _replica_values(seen, n)
            lr = rates.get(first, tf.constant(float("nan"), tf.float32))  # no optimizer: no rate
            floats = tf.unstack(_bits(tf.stack([loss, norm, lr, scale])))
            buf = tf.identity(var)
            count = buf[ring, ReplicaProbe.COUNT] + 1
            row = tf.cast(tf.math.floormod(count - 1, ring), tf.int32)
            prev = tf.cast(tf.math.floormod(count - 2, ring), tf.int32)
            # A gather, not `buf[prev, ...]`: XLA recompiled the step at every step with a slice at a
            # computed row (it needs a strided slice's bounds at compile time).
            examples = tf.gather(buf[:, ReplicaProbe.EXAMPLES], prev) + tf.cast(size, tf.int64)
            zero, compute = tf.constant(0, tf.int64), tf.constant(-1, tf.int64)
            if timed and seen.get("reached") is not None:
                compute = tf.maximum(tf.cast((seen["reached"] - t_sync) * 1e6, tf.int64), zero)
            values = [floats[0], floats[1], examples, floats[2], count, floats[3], compute]
            counter = [zero, zero, zero, zero, count, zero, zero]
            index = tf.stack([tf.stack([row]), tf.constant([ring])])
            update = tf.stack([tf.stack(values), tf.stack(counter)])
            var.assign(tf.tensor_scatter_nd_update(buf, index, update))
            return logs

        train_step.probe = self  # type: ignore[attr-defined]
        return train_step

    def _announce(self, applies: list[dict[str, Any]]) -> None:
        """Keep what replica 0's trace applied; on the chief, say once what keras-sync divides."""
        if not applies:
            return
        self.applies = applies
        if self.custom_step and not self._told and strategy_role(self.strategy).is_chief:
            self._told = True
            for line in trace.trace_lines(self.model, self.num_replicas, applies, self.gradients):
                print(line, file=sys.stderr, flush=True)


def instrument(model: Any, gradients: str | None = None, accumulator: Any = None) -> ReplicaProbe:
    """Install the instrumented `train_step` on ``model`` once, before `fit` builds its train
    function; ``gradients`` (`runtime.train_step_gradients`) or ``accumulator`` None: unchanged."""
    probe = probe_of(model)
    if probe is not None:
        for attr, value in (("gradients", gradients), ("accumulator", accumulator)):
            if value is not None and value != getattr(probe, attr):
                setattr(probe, attr, value)
                model.train_function = None  # retrace with the new setting
        return probe
    probe = ReplicaProbe(model, gradients, accumulator)
    if probe.custom_step and probe.num_replicas > 1 and gradients == "auto":
        trace.check_probes()
    original = type(model).train_step.__get__(model)
    # object.__setattr__: a function is not state for Keras's attribute tracker.
    object.__setattr__(model, "train_step", probe.step_fn(original))
    model.train_function = None
    return probe


def probe_of(model: Any) -> ReplicaProbe | None:
    """The `ReplicaProbe` `instrument` put on ``model``, if any."""
    return getattr(vars(model).get("train_step"), "probe", None)


def holds_unapplied_gradients(model: Any) -> bool:
    """True while gradient accumulation on ``model`` holds micro-batches not applied yet."""
    accumulator = getattr(probe_of(model), "accumulator", None)
    return accumulator is not None and accumulator.pending()


def applied_optimizers(model: Any) -> list[tuple[str, Any]]:
    """(attribute, optimizer) of each optimizer ``model``'s train step applies; [] before its first trace."""
    named, applies = trace.named_optimizers(model), getattr(probe_of(model), "applies", [])
    return [(n, named[n]) for n in dict.fromkeys(a["optimizer"] for a in applies) if n in named]


def _gather_fn(var: Any, strategy: Any) -> Callable[[Any], Any]:
    """Every replica's ring with this worker's host column, gathered from all workers."""

    def replica_fn(host: Any) -> Any:
        row = tf.expand_dims(tf.concat([tf.identity(var), host], axis=1), 0)
        return tf.distribute.get_replica_context().all_gather(row, axis=0)

    @tf.function(autograph=False)
    def gather(host: Any) -> Any:
        return strategy.experimental_local_results(strategy.run(replica_fn, args=(host,)))[0]

    return gather


def _replica_values(seen: dict[str, Any], n: int) -> tuple[Any, Any, Any]:
    """(loss, grad norm, loss scale) of this replica as float32, scaled like one device's."""
    nan = tf.constant(float("nan"), tf.float32)
    custom, applies = seen["custom_step"], seen["applies"]
    # The loss was divided by n (by Keras or the user) unless keras-sync averages the gradients.
    undo = float(n) if not custom or (applies and applies[0]["scaled_by"] is not None) else 1.0
    loss = seen.get("tape_loss" if custom else "loss")
    loss = nan if loss is None else tf.cast(loss, tf.float32) * undo
    scale = seen.get("loss_scale")
    scale = nan if scale is None else tf.cast(scale, tf.float32)
    norm = nan
    if seen["grads"]:
        dense = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in seen["grads"]]
        norm = tf.linalg.global_norm(dense) * undo
        if seen.get("weighted"):  # Keras's step: backprop started from the example weight
            norm = tf.math.divide_no_nan(norm, seen["example_weight"])
        if seen.get("loss_scale") is not None:
            norm = norm / scale
    return loss, norm, scale


def _example_weight(size: Any, n: int) -> Any:
    """This replica's share of the step's ``size`` examples times ``n`` (None with one replica): 1.0
    on an even split, else what makes the summed gradients those of the global batch's mean."""
    if n <= 1:
        return None
    local = tf.cast(size, tf.float32)
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.math.divide_no_nan(local * float(n), total)


def _stamp(after: list[Any]) -> Any:
    """``tf.timestamp()`` (seconds) once every tensor of ``after`` is computed."""
    with tf.control_dependencies([t for t in after if t is not None]):
        return tf.timestamp()


def _decode(ring: Any) -> Any:
    """The int64 ring -> float64 numpy, float columns back from their bits."""
    out = ring.astype(np.float64)
    for col in ReplicaProbe._FLOAT_COLUMNS:
        out[:, col] = ring[:, col].astype(np.uint32).view(np.float32)
    return out


def _bits(x: Any) -> Any:
    return tf.cast(tf.bitcast(tf.cast(x, tf.float32), tf.uint32), tf.int64)


def _batch_size(data: Any) -> Any:
    for t in tf.nest.flatten(data):
        if t is not None and hasattr(t, "shape") and len(t.shape) > 0:
            return tf.shape(t)[0]
    return tf.constant(0)
