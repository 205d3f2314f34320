"""A keras-sync training script for tests/test_multi_worker.py and tests/test_resume.py.

Usage: python _mwr_train.py CONFIG_JSON OUT_DIR [--kill-at STEP --kill-task I --marker FILE]
              [--epochs N] [--no-shuffle]

CONFIG_JSON is a keras-sync config as JSON text (a dict, as keras_sync.load takes). Runs under
`keras-sync launch` (TF_CONFIG set) or alone. Prints ``step <optimizer step> epoch <e> batch <b>``
after every batch; worker I writes OUT_DIR/w<I>.json with the final weights, the replica count,
the epoch losses and where it resumed. With --kill-at, task I sends itself SIGKILL after that
optimizer step, once (the marker file records that it happened), as a preemption would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 256
FEATURES = 8


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("out_dir")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-task", type=int, default=0)
    p.add_argument("--marker", default=None)
    p.add_argument("--no-shuffle", action="store_true")
    ns = p.parse_args()
    started = time.monotonic()

    import keras_sync

    sync = keras_sync.load(json.loads(ns.config))
    task = sync.task[1] or 0

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")

    with sync.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        # Momentum: a resume that lost the optimizer state would show in the weights.
        model.compile(optimizer=keras.optimizers.SGD(sync.learning_rate, momentum=0.9), loss="mse",
                      metrics=["mae"])

    start: dict = {}

    class Report(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            print(f"step {step} epoch {self._epoch} batch {batch}", flush=True)
            if ns.kill_at == step and task == ns.kill_task and ns.marker and not os.path.exists(ns.marker):
                open(ns.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_begin(self, logs=None):
            # The backup callback runs first: a resumed job shows its restored step here already.
            start["iterations"] = int(self.model.optimizer.iterations.numpy())

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            start.setdefault("epoch", epoch)

    history = sync.fit(model, x, y, epochs=ns.epochs, shuffle=not ns.no_shuffle, verbose=0, callbacks=[Report()])
    result = {
        "task": task,
        "num_replicas": sync.num_replicas,
        "num_workers": sync.num_workers,
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
        "epochs_run": history.epoch,
        "iterations": int(model.optimizer.iterations.numpy()),
        "start": start,
        "elapsed_s": time.monotonic() - started,
    }
    os.makedirs(ns.out_dir, exist_ok=True)
    with open(os.path.join(ns.out_dir, f"w{task}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
