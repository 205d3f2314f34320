"""A user's own `model.fit` with keras-sync's callbacks, for tests/test_own_fit.py.

argv: OUT_JSON SQLITE_URI. 2 simulated replicas. Writes what the test checks.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import keras_sync

out_path, uri = sys.argv[1], sys.argv[2]
sync = keras_sync.load(
    {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"per_replica": 16},
        "mlflow": {"tracking_uri": uri, "experiment": "own", "log_every_n_steps": 1},
    }
)
import keras  # noqa: E402

from keras_sync.errors import UsageError  # noqa: E402
from keras_sync.tracking import Writer  # noqa: E402

x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype="float32")


def model():
    with sync.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
    return m


class ListWriter:
    """A writer of the user's own: only the methods of the Writer protocol."""

    def __init__(self):
        self.points: list[tuple[int, dict]] = []
        self.params: dict = {}

    def log_metrics(self, metrics, step, timestamp_ms=None):
        self.points.append((step, dict(metrics)))

    def log_params(self, params):
        self.params.update(params)

    def set_tags(self, tags):
        pass

    def log_text_artifact(self, text, artifact_file):
        pass

    def log_artifact_file(self, local_path, artifact_path=None):
        pass

    def flush(self, timeout_s=None):
        return True


result: dict = {"run_id_before": sync.run_id}
# 1. The user's own fit with sync.callbacks(): 8 steps per epoch, 2 epochs.
m = model()
callbacks = sync.callbacks(m)
result["callbacks"] = [type(c).__name__ for c in callbacks]
m.fit(sync.distribute((x, y)), epochs=2, verbose=0, callbacks=callbacks)
# fit does not wait for MLflow (a first run's store may still be being built): the id once the run exists.
result["run_id"] = sync.job_run.current.wait_for_run(300)
sync.close()
result["run_id_after_close"] = sync.run_id

# 2. A standalone SyncMetrics with a writer of the user's own, under plain model.fit.
own = ListWriter()
result["is_writer"] = isinstance(own, Writer)
m2 = model()
m2.fit(
    sync.distribute((x, y)),
    epochs=1,
    verbose=0,
    callbacks=[keras_sync.SyncMetrics(own, log_every_n_steps=2), keras_sync.RunParams(own, sync)],
)
result["own_steps"] = [s for s, _ in own.points]
result["own_keys"] = sorted({k for _, d in own.points for k in d})
result["own_params"] = sorted(own.params)[:5]


# 4. The public callbacks standalone, sharing one SharedState, in two opposite orders: the same
# points at the same steps; the report draws each epoch's last step (it flushes first) and the
# weight divergence is logged at the sync metrics' step, whichever runs first.
def standalone(order):
    own = ListWriter()
    shared = keras_sync.SharedState()
    report = keras_sync.SyncReport(own, when="epoch", shared=shared)
    drawn = []
    draw = report.log_report
    report.log_report = lambda **kw: (
        drawn.append(
            max(report.history.loss[0].steps, default=0) if 0 in report.history.loss else 0
        ),
        draw(**kw),
    )
    cbs = [
        keras_sync.SyncMetrics(own, log_every_n_steps=1, shared=shared),
        keras_sync.WeightDivergence(own, shared=shared),
        report,
        keras_sync.RunParams(own, sync.context()),
    ]
    m = model()
    m.fit(
        sync.distribute((x, y)),
        epochs=2,
        verbose=0,
        callbacks=cbs if order == "forward" else cbs[::-1],
    )
    return {
        "points": sorted((s, sorted(d)) for s, d in own.points),
        "drawn": drawn,
        "divergence_steps": [s for s, d in own.points if "sync/weight_divergence" in d],
        "params": own.params,
    }


result["forward"], result["reversed"] = standalone("forward"), standalone("reversed")


# 5. log_every_n_steps="auto": fast steps are thinned to a round stride, each epoch's last step kept;
# steps slowed to 0.12 s (a callback sleeping inside the timed part of the step) are all logged.
class Slow(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        import time

        time.sleep(0.12)


def auto(slow):
    own = ListWriter()
    metrics = keras_sync.SyncMetrics(own, log_every_n_steps="auto")
    m = model()
    m.fit(
        sync.distribute((x, y)),
        epochs=3,
        verbose=0,
        callbacks=[metrics] + ([Slow()] if slow else []),
    )
    return {
        "steps": [s for s, d in own.points if "sync/loss/replica_0" in d],
        "stride": metrics.stride,
        "step_time_ms": [d["sync/step_time_ms"] for s, d in own.points if "sync/step_time_ms" in d],
    }


result["auto_fast"], result["auto_slow"] = auto(False), auto(True)

# 3. A backup_dir config is refused by callbacks() in one line.
backed = keras_sync.load(
    {
        "strategy": {"kind": "default"},
        "fault_tolerance": {"backup_dir": "bk"},
        "mlflow": {"enabled": False},
    }
)
try:
    backed.callbacks(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    result["backup_refusal"] = None
except UsageError as e:
    result["backup_refusal"] = str(e)

# 6. issue 23: a GAN's own train_step applies two SGD optimizers; compile() made an RMSprop no step uses.
# And a model without call() (the keras-io VAE as published) is refused before training, with no MLflow run.
import tensorflow as tf  # noqa: E402


class Gan(keras.Model):
    def __init__(self):
        super().__init__()
        self.disc = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        self.gen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
        x, _ = data
        with tf.GradientTape() as tape:
            d_loss = keras.ops.mean(
                keras.ops.softplus(-self.disc(x))
                + keras.ops.softplus(self.disc(self.gen(x[:, :2])))
            )
        grads = tape.gradient(d_loss, self.disc.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.disc.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -keras.ops.mean(self.disc(self.gen(x[:, :2])))
        grads = tape.gradient(g_loss, self.gen.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.gen.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


class GanWithCall(Gan):
    def call(self, x):
        return self.disc(x)


gan_sync = keras_sync.load(
    {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"per_replica": 16},
        "mlflow": {"tracking_uri": uri, "experiment": "gan", "log_every_n_steps": 1},
    }
)
with gan_sync.scope():
    no_call = Gan()
    no_call.compile(
        keras.optimizers.SGD(0.02, momentum=0.9), keras.optimizers.SGD(0.02, momentum=0.9)
    )
try:
    gan_sync.fit(no_call, x, y, epochs=1, verbose=0)
    result["no_call"] = None
except UsageError as e:
    result["no_call"] = str(e)
with gan_sync.scope():
    gan = GanWithCall()
    gan.compile(keras.optimizers.SGD(0.02, momentum=0.9), keras.optimizers.SGD(0.03, momentum=0.8))
gan_sync.fit(gan, x, y, epochs=1, verbose=0)
# fit returns before MLflow has created the run on a busy machine (run_id is None until then): wait for it.
result["gan_run_id"] = gan_sync.job_run.current.wait_for_run(300)
gan_sync.close()
with open(out_path, "w") as f:
    json.dump(result, f)
