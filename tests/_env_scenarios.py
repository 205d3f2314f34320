"""The user's callbacks and models that keras-sync refuses before training, on real strategies.

Usage:
    python _env_scenarios.py replicas OUT.json          2 simulated CPU replicas (MirroredStrategy)
    keras-sync launch --workers 2 _env_scenarios.py workers OUT.json
                                                        2 workers (MWMS); each writes OUT.w<task>.json
With $KS_TF_KERAS (a directory holding the tf_keras package) the Keras 2 cases run too.
Each refusal case records the error and how many batches trained before it (0 = before training).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import numpy as np
from _scenario import Results

import keras_sync
from keras_sync.errors import KerasSyncError

MODE, OUT = sys.argv[1], sys.argv[-1]
WORKERS = MODE == "workers"
results = Results()
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1))).astype("float32")
STRATEGY = (
    {"kind": "multi_worker_mirrored", "connect_timeout_s": 120}
    if WORKERS
    else {"kind": "mirrored", "simulated_cpu_replicas": 2}
)


def config(**sections):
    return {
        "strategy": STRATEGY,
        "batch": {"global": 32},
        "mlflow": {"enabled": False},
        "learning_rate": {"base": 0.05, "scaling": "none"},
        **sections,
    }


SYNC = keras_sync.load(config())
import keras  # noqa: E402  (after load: keras_sync sets up the devices first)


def sync_with(**sections):
    if WORKERS:  # one MultiWorkerMirroredStrategy per process: same strategy, other config
        from keras_sync.config import load_config
        from keras_sync.session import Sync

        cfg = load_config(config(**sections))
        from keras_sync.strategy import Detection

        return Sync(cfg, SYNC.strategy, Detection(SYNC.kind, "reused"))
    return keras_sync.load(config(**sections))


def model_of(sync, lr):
    with sync.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.n = 0

    def on_train_batch_end(self, batch, logs=None):
        self.n += 1


def refused(sync, model, callbacks, **fit):
    counter = Batches()
    try:
        sync.fit(model, X, Y, epochs=2, verbose=0, callbacks=[counter, *callbacks], **fit)
    except KerasSyncError as e:
        return {"error": type(e).__name__, "message": str(e), "batches": counter.n}
    return {
        "trained": True,
        "batches": counter.n,
        "lr": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
    }


def lr_callback_with_warmup(callback):
    sync = sync_with(learning_rate={"base": 0.05, "scaling": "none", "warmup_steps": 4})
    return refused(sync, model_of(sync, sync.lr_schedule()), [callback])


def warmup_then_decay():
    sync = sync_with(
        learning_rate={"base": 0.05, "base_batch_size": 16, "warmup_steps": 4}
    )  # peak 0.1
    decay = keras.optimizers.schedules.ExponentialDecay(
        sync.learning_rate, decay_steps=8, decay_rate=0.5
    )
    schedule = sync.lr_schedule(after=decay)
    model = model_of(sync, schedule)
    out = refused(sync, model, [])
    out["steps"] = int(model.optimizer.iterations.numpy())
    out["lr_at"] = {s: float(schedule(s)) for s in (0, 2, 4, 12)}
    return out


def keras_backup_beside_ours(tmp):
    sync = sync_with(fault_tolerance={"backup_dir": os.path.join(tmp, "ours")})
    return refused(
        sync, model_of(sync, 0.05), [keras.callbacks.BackupAndRestore(os.path.join(tmp, "keras"))]
    )


class StopAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            raise RuntimeError("stop")


class ResetStep(keras.callbacks.Callback):  # restores "its own" state after keras-sync's
    def on_train_begin(self, logs=None):
        self.model.optimizer.iterations.assign(0)


def restored_state_overwritten(tmp):
    sync = sync_with(fault_tolerance={"backup_dir": os.path.join(tmp, "bk"), "save_freq": 2})
    model = model_of(sync, 0.05)
    with contextlib.suppress(RuntimeError):
        sync.fit(model, X, Y, epochs=2, verbose=0, callbacks=[StopAt()])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out = refused(sync, model_of(sync, 0.05), [ResetStep()])
    out["stderr"] = err.getvalue()
    return out


def keras2(warmup):
    sys.path.insert(0, os.environ["KS_TF_KERAS"])
    import tf_keras

    sync = sync_with(
        learning_rate={"base": 0.05, "scaling": "none", "warmup_steps": 4 if warmup else 0},
        mlflow={"enabled": True, "tracking_uri": "sqlite:///" + os.path.join(TMP, "k2.db")},
    )
    try:
        with sync.scope():
            model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(1)])
            model.compile(optimizer=tf_keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
        out = refused(sync, model, [])
    except KerasSyncError as e:
        out = {"error": type(e).__name__, "message": str(e), "at": "compile"}
    out["mlflow_store"] = os.path.exists(os.path.join(TMP, "k2.db"))
    return out


TMP = os.path.dirname(os.path.abspath(OUT))
record = results.record
record(
    "rlrop_warmup",
    lambda: lr_callback_with_warmup(keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0)),
)
record(
    "scheduler_warmup",
    lambda: lr_callback_with_warmup(keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)),
)
record(
    "rlrop_no_warmup",
    lambda: refused(
        SYNC,
        model_of(SYNC, SYNC.lr_schedule()),
        [keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)],
    ),
)
record("warmup_then_decay", warmup_then_decay)
record(
    "keras_backup_pair",
    lambda: keras_backup_beside_ours(os.path.join(TMP, f"kb{SYNC.task[1] or 0}")),
)
if not WORKERS:
    record(
        "restored_state_overwritten", lambda: restored_state_overwritten(os.path.join(TMP, "rs"))
    )
    if os.environ.get("KS_TF_KERAS"):
        record("keras2_fit", lambda: keras2(False))
        record("keras2_warmup", lambda: keras2(True))
results.dump(OUT if not WORKERS else f"{OUT}.w{SYNC.task[1] or 0}.json")
