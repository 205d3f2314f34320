"""Epoch scenarios: an uneven last batch, a masked loss, `batch_size` given to fit, the run-time invariant checks.

Usage: python _epoch_scenarios.py devices OUT_DIR   (writes OUT_DIR/2.json, then OUT_DIR/1.json)
       keras-sync launch --workers 2 _epoch_scenarios.py mw OUT_DIR   (the chief writes OUT_DIR/mw.json)
"devices": two mirrored replicas over 2 logical CPUs (N=2), then, in the same process, one device
(N=1: `one_device` on CPU:0; it needs no device split, so it needs no process of its own).
Writes what each saw for tests/test_epoch.py to compare.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings

import numpy as np
from _scenario import Results

import keras_sync

MULTI_WORKER = (
    sys.argv[1] == "mw"
)  # under `keras-sync launch --workers 2`: 2 workers, one replica each
if not MULTI_WORKER and sys.argv[1] != "devices":
    raise SystemExit(f"unknown mode {sys.argv[1]!r}; one of devices, mw")
N = 2  # the first pass; "devices" then runs N=1 (see the end)
OUT_DIR = sys.argv[2]
results = Results(n=N)


def record(name, fn):
    results.record(name, fn, expected=(keras_sync.KerasSyncError,))


def session(**sections):
    kind = (
        {"kind": "multi_worker_mirrored"}
        if MULTI_WORKER
        else {
            "kind": "mirrored" if N > 1 else "one_device",
            "simulated_cpu_replicas": N if N > 1 else 0,
        }
    )
    cfg = {
        "strategy": kind,
        "batch": {"global": 32},
        "learning_rate": {"base": 0.05, "scaling": "none"},
        "mlflow": {"enabled": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return keras_sync.load(cfg)


sync = session()

import keras  # noqa: E402  (after load: the devices are set up by then)
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(331, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(331, 1))).astype("float32")
xv = rng.normal(size=(101, 8)).astype("float32")
yv = (xv @ rng.normal(size=(8, 1))).astype("float32")


def make_model(s, optimizer=None):
    keras.utils.set_random_seed(0)
    with s.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=optimizer()
            if optimizer
            else keras.optimizers.SGD(s.lr_schedule(), momentum=0.9),
            loss="mse",
            metrics=["mae"],
        )
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
    h, err = stderr_of(
        lambda: sync.fit(model, x, y, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv))
    )
    ev = sync.evaluate(model, xv, yv, verbose=0, return_dict=True)
    return {
        "weights": flat(model),
        "loss": h.history["loss"],
        "val_loss": h.history["val_loss"],
        "mae": h.history["mae"],
        "evaluate": ev,
        "checks": checks_said(err),
    }


def masked_sequences():
    """A GRU on padded sequences, its loss Keras's mean over the unpadded tokens: replicas with
    unequal padding weighed by their tokens (101 sequences: the last batch of 5 splits 3/2)."""
    lengths = np.random.default_rng(1).integers(2, 11, size=141)
    tokens = np.random.default_rng(2).integers(1, 30, size=(141, 10))
    seqs = np.where(np.arange(10) < lengths[:, None], tokens, 0).astype("int32")
    labels = (seqs * 7) % 5
    keras.utils.set_random_seed(0)
    with sync.scope():
        inputs = keras.Input((10,), dtype="int32")
        h = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
        h = keras.layers.GRU(8, return_sequences=True)(h)
        model = keras.Model(inputs, keras.layers.Dense(5)(h))
        model.compile(
            optimizer=keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    val = (seqs[101:], labels[101:])
    h = sync.fit(
        model, seqs[:101], labels[:101], epochs=2, shuffle=False, verbose=0, validation_data=val
    )
    ev = sync.evaluate(model, *val, verbose=0, return_dict=True)
    return {
        "weights": flat(model),
        "loss": h.history["loss"],
        "val_loss": h.history["val_loss"],
        "evaluate": ev["loss"],
    }


def checks_said(err):
    return [line for line in err.splitlines() if line.startswith("keras-sync: check ")]


def batch_size_global():
    """batch_size=64 kept from a plain Keras script: the global batch (learning_rate.scaling: none here)."""
    model = make_model(sync)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h, err = stderr_of(
            lambda: sync.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        )
    return {
        "weights": flat(model),
        "loss": h.history["loss"],
        "checks": checks_said(err),
        "warnings": [str(w.message) for w in caught if "batch_size" in str(w.message)],
    }


def batch_size_refused():
    s = session(learning_rate={"base": 0.05, "scaling": "linear", "base_batch_size": 32})
    return s.fit(make_model(s), x, y, batch_size=64, epochs=1, verbose=0)


def learning_rate_check(on_violation, mlflow=False):
    """A drop-in user keeps their own compile line: Adam(1e-3) while keras-sync scaled 0.002."""
    tracking = (
        {"enabled": True, "tracking_uri": "sqlite:///checks.db", "system_metrics": False}
        if mlflow
        else {}
    )
    s = session(
        learning_rate={"base": 0.001, "base_batch_size": 16, "scaling": "linear"},
        checks={"on_violation": on_violation},
        mlflow=tracking,
    )
    model = make_model(s, optimizer=lambda: keras.optimizers.Adam(1e-3))
    _, err = stderr_of(lambda: s.fit(model, x, y, epochs=1, verbose=0))
    out = {"checks": checks_said(err), "scaled": s.learning_rate}
    if mlflow:
        from _scenario import close_run
        from mlflow.tracking import MlflowClient

        run_id = close_run(s, 60)
        tags = MlflowClient("sqlite:///checks.db").get_run(run_id).data.tags
        out["tags"] = {k: v for k, v in tags.items() if k.startswith("keras_sync.check")}
    return out


def direct_fit():
    """model.fit out of habit on a model built in sync.scope()."""
    model = make_model(sync)
    _, err = stderr_of(lambda: model.fit(x, y, epochs=1, verbose=0))
    return {"checks": checks_said(err)}


def examples_per_step():
    """A dataset the user distributed: batches of 16 while the rate was scaled for 32."""
    ds = sync.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )
    model = make_model(sync)
    _, err = stderr_of(lambda: sync.fit(model, ds, epochs=1, verbose=0))
    return {"checks": checks_said(err)}


class Stop(Exception):
    pass


class StopAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise Stop("interrupted")


class RestartOptimizer(keras.callbacks.Callback):
    """Restores over keras-sync's backup, as keras.callbacks.BackupAndRestore next to it did."""

    def on_train_begin(self, logs=None):
        self.model.optimizer.iterations.assign(0)


def resume(tamper):
    import tempfile

    s = session(fault_tolerance={"backup_dir": tempfile.mkdtemp(prefix="epoch-backup-")})
    model = make_model(s)
    try:
        s.fit(model, x, y, epochs=2, verbose=0, callbacks=[StopAfterFirstEpoch()])
    except Stop:
        pass
    _, err = stderr_of(
        lambda: s.fit(
            model, x, y, epochs=2, verbose=0, callbacks=[RestartOptimizer()] if tamper else None
        )
    )
    return {"checks": checks_said(err), "resumed": "resumed from the backup" in err}


def trained_examples(model):
    """Examples trained so far by every replica of every worker, from keras-sync's replica probe."""
    from keras_sync.training import instrument as _instrument

    probe = _instrument.probe_of(model)
    rings = probe.read()
    rows = probe.row(rings, probe.count(rings))
    return int(sum(r[probe.EXAMPLES] for r in rows))


def own_parts():
    """Each worker passes its own part (every other example), batched by the global batch, shard policy OFF."""
    part = sync.task[1] or 0
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = (
        tf.data.Dataset.from_tensor_slices((x[part::2], y[part::2])).batch(32).with_options(options)
    )
    model = make_model(sync)
    _, err = stderr_of(lambda: sync.fit(model, ds, epochs=1, verbose=0))
    return {"checks": checks_said(err), "trained": trained_examples(model), "data": len(x)}


class StopAtThirdStep(keras.callbacks.Callback):
    """Stops training mid-epoch (as TerminateOnNaN does): the epoch trains 3 of its 11 steps."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.model.stop_training = True


def stopped_mid_epoch():
    """A broken epoch: 96 of 331 examples trained; the examples-per-epoch check must say so."""
    model = make_model(sync)
    _, err = stderr_of(
        lambda: sync.fit(
            model, x, y, epochs=1, verbose=0, shuffle=False, callbacks=[StopAtThirdStep()]
        )
    )
    return {"checks": checks_said(err), "trained": trained_examples(model), "data": len(x)}


record("uneven_last_batch", uneven_last_batch)
record("masked_sequences", masked_sequences)
if MULTI_WORKER:
    record("own_parts", own_parts)
    if sync.is_chief:
        results.dump(f"{OUT_DIR}/mw.json")
    sys.exit(0)
for N in (2, 1):  # rebinds the module's N, results and sync that the cases read
    if N == 1:
        results = Results(n=N)
        sync = session()
        record("uneven_last_batch", uneven_last_batch)
        record("masked_sequences", masked_sequences)
    record("batch_size_global", batch_size_global)
    record("examples_per_step", examples_per_step)
    record("stopped_mid_epoch", stopped_mid_epoch)
    record("resume_clean", lambda: resume(False))
    if N > 1:
        # What tests/test_epoch.py reads only with 2 replicas: not trained on one device.
        record("batch_size_refused", batch_size_refused)
        # The warning also goes to MLflow as a tag: one fit for both (test_a_violation_is_an_mlflow_tag).
        record("learning_rate_warn", lambda: learning_rate_check("warn", mlflow=True))
        record("learning_rate_error", lambda: learning_rate_check("error"))
        record("direct_fit", direct_fit)
        record("resume_tampered", lambda: resume(True))
    results.dump(f"{OUT_DIR}/{N}.json")
