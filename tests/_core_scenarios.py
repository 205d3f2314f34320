"""Core scenarios, one process per device split (logical devices are fixed once per process).

Usage: python _core_scenarios.py N OUT_DIR
Trains the same model with fixed seeds over N simulated CPU replicas and exercises the session
API; writes what it saw to OUT_DIR/N.json (+ N.json.weights.npy) for tests/test_session.py to check.
N=2 then runs the one-device pass too (N=1: `one_device` on CPU:0 needs no device split, so it
needs no process of its own) and writes OUT_DIR/1.json.
"""

from __future__ import annotations

import sys

import numpy as np
from _scenario import Results

import keras_sync

OUT_DIR = sys.argv[2]
GLOBAL_BATCH = 64
PASSES = {"2": (2, 1), "4": (4,)}[sys.argv[1]]


def record(name, fn):
    results.record(name, fn, expected=(keras_sync.KerasSyncError,))


rng = np.random.default_rng(0)
x = rng.normal(size=(640, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(640, 1))).astype("float32")


def make_model(s):
    keras.utils.set_random_seed(0)
    with s.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(s.lr_schedule(), momentum=0.9), loss="mse")
    return model


def train(s, **fit_kwargs):
    model = make_model(s)
    history = s.fit(model, x, y, epochs=3, shuffle=False, verbose=0, **fit_kwargs)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    return model, history, weights


def via_distribute():
    m = make_model(sync)
    ds = sync.distribute((x, y))
    first = next(iter(ds))
    h = m.fit(ds, epochs=3, verbose=0)
    w = np.concatenate([v.ravel() for v in m.get_weights()])
    return {
        "batch_shape": list(first[0].shape),
        "max_diff_vs_arrays": float(np.abs(w - weights).max()),
        "cardinality": int(ds.cardinality()),
        "loss": h.history["loss"],
    }


def outside_scope():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse")
    sync.fit(m, x, y, epochs=1, verbose=0)


def steps_per_execution():
    keras.utils.set_random_seed(0)
    with sync.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    sync.fit(m, x, y, epochs=1, verbose=0)
    return "trained"


def warmup_schedule():
    s = keras_sync.load(
        {
            **base,
            "learning_rate": {
                "base": 0.1,
                "scaling": "linear",
                "base_batch_size": 32,
                "warmup_epochs": 1,
            },
        }
    )
    sched = s.lr_schedule()  # warmup_epochs: the step count is fixed by fit from the data
    keras.utils.set_random_seed(0)
    with s.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(sched), loss="mse")
    s.fit(m, x, y, epochs=1, verbose=0, shuffle=False)
    values = [float(sched(i)) for i in range(0, 12)]
    config = keras.optimizers.schedules.serialize(sched)
    back = keras.optimizers.schedules.deserialize(config)
    return {
        "peak": s.learning_rate,
        "warmup_steps": sched.warmup_steps,
        "values": values,
        "roundtrip": [float(back(i)) for i in (0, 5, 10, 20)],
        "iterations": int(m.optimizer.iterations.numpy()),
    }


def cross_device_ops():
    out = {}
    for name in ("hierarchical_copy", "reduction_to_one", "auto"):
        s = keras_sync.load(
            {**base, "strategy": {**base["strategy"], "kind": "mirrored", "cross_device_ops": name}}
        )
        ops = getattr(s.strategy.extended, "_cross_device_ops", None)
        _, _, w = train(s)
        out[name] = {
            "ops": type(ops).__name__ if ops is not None else None,
            "max_diff": float(np.abs(w - weights).max()),
        }
    return out


def iterator_release():
    """`fit` returns before the tf.data iterators it dropped are destroyed (that can take seconds).

    The source is an endless Python generator (`steps_per_epoch` ends the epochs; a `take` would
    destroy its iterator as soon as it is done): its `finally` runs only when its iterator is
    destroyed, and there it waits for `fit` to have returned (30 s at most). Destroyed on the
    training thread (before the fix), `fit` cannot return meanwhile: the wait times out.
    """
    import threading

    from keras_sync.upstream.keras_fixes import RELEASER

    returned = threading.Event()
    waited = []

    def endless():
        try:
            i = 0
            while True:
                yield x[i % len(x)], y[i % len(y)]
                i += 1
        finally:
            waited.append(returned.wait(30))

    # Which thread drops each distributed iterator's last reference (where TensorFlow destroys it):
    # fit's own loop keeps the current one in a local, so handing the epoch iterator's reference
    # to a thread alone left the last one to the training thread at fit's return.
    import weakref

    from tensorflow.python.distribute import input_lib

    destroyed_on: list[str] = []
    made = input_lib.DistributedDataset.__iter__

    def watched_iter(self):
        iterator = made(self)
        weakref.finalize(iterator, lambda: destroyed_on.append(threading.current_thread().name))
        return iterator

    input_lib.DistributedDataset.__iter__ = watched_iter
    try:
        spec = (tf.TensorSpec((8,), tf.float32), tf.TensorSpec((1,), tf.float32))
        ds = tf.data.Dataset.from_generator(endless, output_signature=spec).batch(GLOBAL_BATCH)
        m = make_model(sync)
        sync.fit(m, ds, epochs=2, steps_per_epoch=4, verbose=0)
        returned.set()
        # Arrays (a known number of batches): each epoch's end makes the next epoch's iterator while
        # fit's loop still holds the one it ends.
        sync.fit(m, x, y, epochs=2, verbose=0)
    finally:
        input_lib.DistributedDataset.__iter__ = made
    return {
        "waited": waited,
        "released": RELEASER.wait(60),
        "iterations": int(m.optimizer.iterations.numpy()),
        "destroyed_on": destroyed_on,
    }


for (
    N
) in PASSES:  # rebinds the module's N, results, base, sync and reference fit that the cases read
    results = Results(n=N)
    base = {
        "strategy": {
            "kind": "mirrored" if N > 1 else "one_device",
            "simulated_cpu_replicas": N if N > 1 else 0,
        },
        "batch": {"global": GLOBAL_BATCH},
        "learning_rate": {"base": 0.05, "scaling": "none"},
        "mlflow": {"enabled": False},
    }
    sync = keras_sync.load(base)
    import keras
    import tensorflow as tf

    results["num_replicas"] = sync.num_replicas
    results["per_replica"] = sync.per_replica_batch_size
    results["global"] = sync.global_batch_size
    results["kind"] = sync.kind
    results["is_chief"] = sync.is_chief
    results["num_workers"] = sync.num_workers
    results["devices"] = list(sync.strategy.extended.worker_devices)

    model, history, weights = train(sync)
    np.save(f"{OUT_DIR}/{N}.json.weights.npy", weights)
    results["loss"] = history.history["loss"]
    results["history_type"] = type(history).__name__

    # Arrays and sync.distribute(...) give the same training.
    record("distribute", via_distribute)
    # Each case below runs only in the pass whose result tests/test_session.py reads (a fit nobody
    # reads costs CPU and proves nothing).
    if N <= 2:
        record("evaluate", lambda: float(sync.evaluate(model, x, y, verbose=0)))
    if N == 2:
        record("predict_shape", lambda: list(sync.predict(model, x, verbose=0).shape))
    if N > 1:
        record("outside_scope", outside_scope)
    # A valid batch_size given to fit (the global batch, with its warning) is tests/test_epoch.py's
    # test_batch_size_argument_is_the_global_batch, which also compares the weights with one device's.
    if N == 2:
        record(
            "bad_batch_size",
            lambda: sync.fit(make_model(sync), x, y, batch_size=0, epochs=1, verbose=0),
        )
    record("steps_per_execution", steps_per_execution)
    record("warmup", warmup_schedule)
    if N == 2:
        record("iterator_release", iterator_release)
        record("cross_device_ops", cross_device_ops)
        record(
            "nccl_on_cpu",
            lambda: keras_sync.load(
                {**base, "strategy": {**base["strategy"], "cross_device_ops": "nccl"}}
            ),
        )
    if N == 4:
        record(
            "unknown_device",
            lambda: keras_sync.load(
                {**base, "strategy": {"kind": "mirrored", "devices": ["/cpu:0", "/gpu:7"]}}
            ),
        )
        record(
            "explicit_devices",
            lambda: (
                keras_sync.load(
                    {**base, "strategy": {"kind": "mirrored", "devices": ["/cpu:0", "CPU:1"]}}
                ).num_replicas
            ),
        )
        record("global_not_divisible", lambda: keras_sync.load({**base, "batch": {"global": 63}}))
    if N == 1:
        # Too late: TensorFlow has initialised its devices (split in 2 by the pass before) in this process.
        record(
            "too_late",
            lambda: keras_sync.load(
                {**base, "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 4}}
            ),
        )
        record(
            "tpu",
            lambda: keras_sync.load(
                {**base, "strategy": {"kind": "tpu", "tpu": {"name": "local"}}}
            ),
        )
    results.dump(f"{OUT_DIR}/{N}.json")
