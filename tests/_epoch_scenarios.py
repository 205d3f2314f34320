"""Epoch scenarios: an uneven last batch, `batch_size` given to fit, the run-time invariant checks.

Usage: python _epoch_scenarios.py N OUT.json
N=1: one device; N=2: two mirrored replicas over logical CPUs. Writes what it saw to OUT.json
for tests/test_epoch.py to compare across the two processes.
"""

from __future__ import annotations

import contextlib
import io
import sys

import numpy as np

import keras_sync
from _scenario import Results

N = int(sys.argv[1])
OUT = sys.argv[2]
results = Results(n=N)


def record(name, fn):
    results.record(name, fn, expected=(keras_sync.KerasSyncError,))


def session(**sections):
    cfg = {
        "strategy": {"kind": "mirrored" if N > 1 else "one_device", "simulated_cpu_replicas": N if N > 1 else 0},
        "batch": {"global": 32},
        "learning_rate": {"base": 0.05, "scaling": "none"},
        "mlflow": {"enabled": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return keras_sync.load(cfg)


sync = session()

import keras  # noqa: E402  (after load: the devices are set up by then)

rng = np.random.default_rng(0)
x = rng.normal(size=(331, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(331, 1))).astype("float32")
xv = rng.normal(size=(101, 8)).astype("float32")
yv = (xv @ rng.normal(size=(8, 1))).astype("float32")


def make_model(s, optimizer=None):
    keras.utils.set_random_seed(0)
    with s.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer or keras.optimizers.SGD(s.lr_schedule(), momentum=0.9), loss="mse",
                      metrics=["mae"])
    return model


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).tolist()


def stderr_of(fn):
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        out = fn()
    return out, buf.getvalue()


def uneven_last_batch():
    """331 examples at global batch 32: the last batch of 11 splits 6/5 over 2 replicas."""
    model = make_model(sync)
    h = sync.fit(model, x, y, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv))
    ev = sync.evaluate(model, xv, yv, verbose=0, return_dict=True)
    return {"weights": flat(model), "loss": h.history["loss"], "val_loss": h.history["val_loss"],
            "mae": h.history["mae"], "evaluate": ev}


record("uneven_last_batch", uneven_last_batch)
results.dump(OUT)
