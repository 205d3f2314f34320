"""Sync-metrics scenarios on real strategies, one process each (logical devices are fixed per process).

Usage:
    python _metrics_scenarios.py mirrored OUT.json TRACKING_URI SERVER_CONFIG.yaml
        2 simulated CPU replicas: the main logged run (sqlite TRACKING_URI), bit-identical weights
        vs plain Keras, a custom train_step with the public callbacks, a restarted job, and a run
        to the real MLflow server whose URI (with credentials) is in SERVER_CONFIG.yaml.
    python _metrics_scenarios.py single OUT.json TRACKING_URI
        the default strategy (one device) with an XLA-compiled step.
    python -m keras_sync.launch --workers 2 _metrics_scenarios.py multi_worker OUT.json CONFIG.yaml
        one process per worker (TF_CONFIG from the launcher); the chief writes OUT.json.
Writes what it saw to OUT.json for tests/test_sync_metrics.py.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
from _scenario import Results, close_run, run_mode

import keras_sync

MODE, OUT = sys.argv[1], sys.argv[2]
results = Results()
record = results.record
rng = np.random.default_rng(0)
X = rng.normal(size=(640, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(640, 1))).astype("float32")


def make_model(sync, cls=None):
    import keras

    keras.utils.set_random_seed(0)
    with sync.scope():
        layers = [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
        model = (cls or keras.Sequential)(layers)
        model.compile(
            optimizer=keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9),
            loss="mse",
            metrics=["mae"],
        )
    return model


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def close(sync):
    return close_run(sync, timeout_s=60)


def mirrored(tracking_uri: str, server_config: str) -> None:
    base = {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"global": 64},
        # base 0.05 tuned at 32, global 64 -> linear peak 0.1, reached after 4 warmup steps
        "learning_rate": {
            "base": 0.05,
            "base_batch_size": 32,
            "scaling": "linear",
            "warmup_steps": 4,
        },
        "mlflow": {
            "tracking_uri": tracking_uri,
            "experiment": "metrics",
            "log_every_n_steps": 2,
            "allreduce_probe": True,
        },
    }
    os.environ["KERAS_SYNC_JOB_ID"] = "job-main"
    sync = keras_sync.load(base)
    import keras

    # 1. The main run: 512 training examples / 64 = 8 steps per epoch, 2 epochs.
    model = make_model(sync)
    h = sync.fit(model, X, Y, epochs=2, shuffle=False, verbose=0, validation_split=0.2)
    first = sync
    results["main"] = {"run_id": close(sync), "history": h.history, "steps": 16}

    # 2. The same job restarted: a new Sync with the same job id continues the run and the steps.
    # (As BackupAndRestore would, the restarted model resumes at the optimizer step it reached.)
    # Part of "main": the main run's metric tests count the restart's steps too.
    reached = int(model.optimizer.iterations.numpy())
    sync2 = keras_sync.load(base)
    model2 = make_model(sync2)
    model2.set_weights(model.get_weights())
    with sync2.scope():
        model2.optimizer.build(model2.trainable_variables)
        model2.optimizer.iterations.assign(reached)
    sync2.fit(model2, X, Y, epochs=1, shuffle=False, verbose=0, validation_split=0.2)
    results["restart"] = {
        "run_id": close(sync2),
        "iterations": int(model2.optimizer.iterations.numpy()),
    }
    del os.environ["KERAS_SYNC_JOB_ID"]

    # 3. Instrumented training is bit-identical to plain Keras under the same strategy.
    def identical():
        plain = make_model(first)
        plain.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        s = keras_sync.load(
            {**base, "mlflow": {**base["mlflow"], "log_every_n_steps": 1, "allreduce_probe": False}}
        )
        ours = make_model(s)
        s.fit(ours, X, Y, epochs=2, shuffle=False, verbose=0)
        close(s)
        a, b = flat(plain), flat(ours)
        return {
            "equal": bool(np.array_equal(a, b)),
            "max_diff": float(np.abs(a - b).max()),
            "trained": float(np.abs(a - flat(make_model(first))).max()),
        }

    record("identical", identical)

    # 4. A model with its own train_step, trained with plain model.fit and the public callbacks.
    def custom_train_step():
        import tensorflow as tf

        from keras_sync.tracking import MlflowWriter

        class OwnStep(keras.Sequential):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss = self.compute_loss(x, y, self(x, training=True))
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                return {"loss": loss}

        writer = MlflowWriter(tracking_uri=tracking_uri, experiment="custom")
        writer.start()
        model = make_model(first, OwnStep)
        cbs = [
            keras_sync.RunParams(writer),
            keras_sync.SyncMetrics(writer, log_every_n_steps=1),
            keras_sync.WeightDivergence(writer),
        ]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=cbs)
        writer.close(timeout_s=60)
        return {
            "run_id": writer.run_id,
            "steps": 20,
            "warnings": [str(w.message) for w in caught if "train_step" in str(w.message)],
        }

    record("custom", custom_train_step)

    # 5. To the real MLflow server, through a config file whose URI carries credentials.
    def server():
        s = keras_sync.load(server_config)
        m = make_model(s)
        s.fit(m, X, Y, epochs=1, shuffle=False, verbose=0)
        return {"run_id": close(s)}

    record("server", server)

    # 6. Longer than the probe's ring (64 rows): 2 epochs of 80 steps at global batch 8, with a
    # warmup over 120 steps (each step's rate differs), logged every step and every 70 steps.
    def long_run():
        out = {}
        for every in (1, 70):
            s = keras_sync.load(
                {
                    "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
                    "batch": {"global": 8},
                    "learning_rate": {"base": 0.01, "scaling": "none", "warmup_steps": 120},
                    "mlflow": {
                        "tracking_uri": tracking_uri,
                        "experiment": f"long-{every}",
                        "log_every_n_steps": every,
                    },
                }
            )
            m = make_model(s)
            s.fit(m, X, Y, epochs=2, shuffle=False, verbose=0)
            schedule = s.lr_schedule()
            out[str(every)] = {
                "run_id": close(s),
                "ring": _probe_ring(m),
                "lr": [float(schedule(step)) for step in range(160)],
            }
        return out

    record("long", long_run)


def _probe_ring(model) -> int:
    from keras_sync.training import instrument as _instrument

    return _instrument.probe_of(model).ring


def single(tracking_uri: str) -> None:
    """The default strategy (one device, XLA-compiled step, Adam): still bit-identical, still logged."""
    import keras

    sync = keras_sync.load(
        {
            "batch": {"per_replica": 32},
            "mlflow": {
                "tracking_uri": tracking_uri,
                "experiment": "single",
                "log_every_n_steps": 1,
            },
        }
    )

    def build():
        keras.utils.set_random_seed(0)
        m = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
        return m

    plain, ours = build(), build()
    plain.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    sync.fit(ours, X, Y, epochs=2, shuffle=False, verbose=0)
    results.update(
        kind=sync.kind,
        jit=bool(ours.jit_compile),
        equal=bool(np.array_equal(flat(plain), flat(ours))),
        run_id=close(sync),
    )


def multi_worker(config: str) -> None:
    sync = keras_sync.load(config)
    ds = sync.distribute((X, Y))
    model = make_model(sync)
    sync.fit(model, ds, epochs=2, verbose=0)
    results.update(
        kind=sync.kind, replicas=sync.num_replicas, workers=sync.num_workers, chief=sync.is_chief
    )
    if sync.is_chief:
        results["run_id"] = close(sync)


run_mode(
    {"mirrored": mirrored, "single": single, "multi_worker": multi_worker}, MODE, *sys.argv[3:]
)
if MODE != "multi_worker" or results.get("chief"):
    results.dump(OUT)
