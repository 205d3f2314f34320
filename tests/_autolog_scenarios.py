"""Autolog-parity and sync-report scenarios on real strategies, one process each.

Usage:
    python _autolog_scenarios.py mirrored OUT_DIR TRACKING_URI
        2 simulated CPU replicas: a run with mlflow.log_model and sync_report: epoch (warmup
        schedule); a plain compiled model on the default strategy; then mlflow.keras.autolog()
        beside sync.fit.
    python -m keras_sync.launch --workers 2 _autolog_scenarios.py multi_worker OUT_DIR CONFIG.yaml
        (CONFIG.yaml: multi_worker_mirrored, mlflow.log_model: true), mlflow.keras.autolog(log_models=False)
        called on both workers.
        one process per worker, log_model on; the other worker exits as soon as its fit returns.
Writes OUT_DIR/<mode>.json (and predictions as .npy) for tests/test_model_logging.py and
tests/test_sync_report.py.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from _scenario import Results, close_run, run_mode

import keras_sync

MODE, OUT = sys.argv[1], Path(sys.argv[2])
results = Results()
record = results.record
rng = np.random.default_rng(0)
X = rng.normal(size=(640, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(640, 1))).astype("float32")
PROBE = X[:32]


def make_model(sync, optimizer):
    import keras

    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return model


def close(sync):
    return close_run(sync, timeout_s=120)


def fit_and_close(sync, model, name, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.time()
        sync.fit(model, X, Y, shuffle=False, verbose=0, **kwargs)
        t1 = time.time()
    np.save(OUT / f"{name}.npy", model.predict(PROBE, verbose=0))
    t2 = time.time()
    run_id = close(sync)
    return {
        "run_id": run_id,
        "fit_start_ms": int(t0 * 1000),
        "fit_end_ms": int(t1 * 1000),
        "closed_ms": int(time.time() * 1000),
        "predicted_ms": int(t2 * 1000),
        "iterations": int(model.optimizer.iterations.numpy()),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }


def mirrored(uri: str) -> None:
    import keras

    base = {"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "batch": {"global": 64}}

    def logged():
        # 512 examples / 64 = 8 steps per epoch, 3 epochs; warmup: the optimizer holds a GradualWarmup.
        sync = keras_sync.load(
            {
                **base,
                "learning_rate": {"base": 0.05, "warmup_steps": 4},
                "mlflow": {
                    "tracking_uri": uri,
                    "experiment": "logged",
                    "log_model": True,
                    "sync_report": "epoch",
                    "log_every_n_steps": 1,
                },
            }
        )
        model = make_model(sync, lambda: keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9))
        return fit_and_close(sync, model, "logged", epochs=3, validation_split=0.2)

    record("logged", logged)

    def compiled():
        # Plain Keras objects only: the logged model keeps its optimizer. No report.
        sync = keras_sync.load(
            {
                "strategy": {"kind": "default"},
                "batch": {"per_replica": 64},
                "mlflow": {
                    "tracking_uri": uri,
                    "experiment": "compiled",
                    "log_model": True,
                    "sync_report": "off",
                },
            }
        )
        model = make_model(sync, lambda: keras.optimizers.Adam(0.01))
        return fit_and_close(sync, model, "compiled", epochs=1)

    record("compiled", compiled)

    def autolog():
        import logging

        import mlflow

        mlflow.keras.autolog()  # its default: log_models=True
        errors: list[str] = []

        class Errors(logging.Handler):
            def emit(self, rec):
                if rec.levelno >= logging.WARNING and rec.name.startswith("mlflow"):
                    errors.append(rec.getMessage()[:300])

        handler = Errors()
        logging.getLogger("mlflow").addHandler(handler)
        try:
            sync = keras_sync.load(
                {
                    **base,
                    "learning_rate": {"base": 0.05},
                    "mlflow": {"tracking_uri": uri, "experiment": "autolog", "log_model": True},
                }
            )
            model = make_model(sync, lambda: keras.optimizers.Adam(0.01))
            out = fit_and_close(sync, model, "autolog", epochs=2)
        finally:
            logging.getLogger("mlflow").removeHandler(handler)
            mlflow.keras.autolog(disable=True)
        out["mlflow_warnings"] = errors
        out["active_after"] = mlflow.active_run() is not None
        return out

    record("autolog", autolog)


def multi_worker(config: str) -> None:
    sync = keras_sync.load(config)
    import keras
    import mlflow

    # On every worker, as a user's script would: only the chief's fit may log (one run), and the
    # model is keras-sync's (autolog's own model logging is off here).
    mlflow.keras.autolog(log_models=False)

    ds = sync.distribute((X, Y))
    model = make_model(sync, lambda: keras.optimizers.SGD(0.05))
    sync.fit(model, ds, epochs=2, verbose=0)
    if not sync.is_chief:
        os._exit(
            0
        )  # gone at once: a collective in the chief's model logging would now fail or hang
    np.save(OUT / "multi_worker.npy", _local_predict(model))
    results.update(kind=sync.kind, replicas=sync.num_replicas, run_id=close(sync))


def _local_predict(model):
    # model.predict is a collective under multi-worker (the other worker has left): call the layers.
    return np.asarray(model(PROBE, training=False))


OUT.mkdir(parents=True, exist_ok=True)
run_mode({"mirrored": mirrored, "multi_worker": multi_worker}, MODE, *sys.argv[3:])
results.dump(OUT / f"{MODE}.json")
