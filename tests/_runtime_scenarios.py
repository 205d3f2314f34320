"""Training-step scenarios on real strategies, one process per device layout (logical devices are fixed per process).

Usage:
    python _runtime_scenarios.py replicas N OUT.json      N simulated CPU replicas (1: one device)
    keras-sync launch --workers 2 _runtime_scenarios.py workers OUT.json
                                                          2 workers x 1 CPU (MWMS); the chief writes
Every scenario trains the same model from the same seed on the same global batches and records its
final weights (and what keras-sync saw), so tests/test_runtime.py compares layouts with one device.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

import keras_sync

MODE, OUT = sys.argv[1], sys.argv[-1]
N = int(sys.argv[2]) if MODE == "replicas" else 0
GLOBAL_BATCH = 64
results: dict = {}
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(512, 1))).astype("float32")


def config(**runtime):
    if MODE == "workers":
        strategy = {"kind": "multi_worker_mirrored"}
    elif N > 1:
        strategy = {"kind": "mirrored", "simulated_cpu_replicas": N}
    else:
        strategy = {"kind": "one_device"}
    return {"strategy": strategy, "batch": {"global": GLOBAL_BATCH},
            "learning_rate": {"base": 0.05, "scaling": "none"}, "mlflow": {"enabled": False},
            "runtime": runtime}


SYNC = keras_sync.load(config())

import keras  # noqa: E402  (after load: devices and cluster are set up by then)
import tensorflow as tf  # noqa: E402


def record(name, fn):
    try:
        results[name] = fn()
    except Exception as exc:  # keep the traceback for the test's message
        results[name] = {"unexpected": type(exc).__name__, "message": str(exc), "tb": traceback.format_exc()}


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).tolist()


# -- custom train_step (issue 12, item 4) ---------------------------------------------------------


class GuideStep(keras.Sequential):
    """As the Keras 3 guides write it: a tape, keras.ops.mean of a loss function, apply_gradients."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class ComputeLossStep(keras.Sequential):
    """compute_loss (Keras divides by the replica count) and optimizer.apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        return {"loss": loss}


class DividedStep(keras.Sequential):
    """The user divides by num_replicas_in_sync, as tf.distribute tutorials teach."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
            loss = loss / self.distribute_strategy.num_replicas_in_sync
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class AverageLossStep(keras.Sequential):
    """tf.nn.compute_average_loss with an explicit global batch size."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y, self(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


def make(cls, sync=None, optimizer=None, **compile_kwargs):
    sync = sync or SYNC
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = cls([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer or keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9), loss="mse",
                      **compile_kwargs)
    return model


def custom_steps():
    from keras_sync import _instrument

    out = {}
    for name, cls in [("keras", keras.Sequential), ("guide", GuideStep), ("compute_loss", ComputeLossStep),
                      ("divided", DividedStep), ("average_loss", AverageLossStep)]:
        model = make(cls)
        probe = _instrument.instrument(model)  # the per-replica values of every step (the default step too)
        SYNC.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        rings = probe.read()
        steps = probe.count(rings)
        rows = [probe.row(rings, c) for c in range(max(1, steps - probe.ring + 1), steps + 1)]
        out[name] = {"weights": flat(model), "trace": probe.last_trace, "steps": steps,
                     "loss": [[float(r[probe.LOSS]) for r in rs] for rs in rows],
                     "grad_norm": [[float(r[probe.GRAD_NORM]) for r in rs] for rs in rows]}
    # Keras's behaviour on request: the guide's step with its gradients summed.
    s = keras_sync.load(config(train_step_gradients="sum"))
    model = make(GuideStep, s)
    s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
    out["guide_sum"] = {"weights": flat(model)}
    return out


record("custom_steps", custom_steps)

if MODE == "replicas" or SYNC.is_chief:
    results.update(num_replicas=SYNC.num_replicas, num_workers=SYNC.num_workers)
    with open(OUT, "w") as fh:
        json.dump(results, fh)
