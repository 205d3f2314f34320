"""Three fits in one keras training process, a new model each time, for tests/test_fit_ends_run.py.

Usage: python _three_fits.py CONFIG_JSON [--new-sync] [--crash-at STEP] [--from-fit N]

The keras-io "Multi-GPU and distributed training with TensorFlow" guide (guides/distributed_training_with_tensorflow)
calls `run_training()` several times in one process, each building and compiling a new model in
the strategy's scope and fitting it. Here: `run_training(epochs)` for epochs 1, 1 and 2 (the third
fit's ``epochs`` param differs), 256 examples at the configured global batch (16: 16 steps an epoch).
``--new-sync``: each `run_training` calls `keras_sync.load()` again, as the guide makes a new
strategy in each. Runs alone or under `keras-sync launch` (a worker's arrays are sharded); prints
``FITS DONE`` at the end. ``--crash-at STEP``: the second fit's process dies (os._exit, as a kill
would) after that optimizer step of its model, its metrics up to it spooled; ``--from-fit N``: start at the
N-th fit (the relaunch of a job whose earlier fits were done).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import keras_sync

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CONFIG = json.loads(sys.argv[1])
NEW_SYNC = "--new-sync" in sys.argv[2:]
CRASH_AT = int(sys.argv[sys.argv.index("--crash-at") + 1]) if "--crash-at" in sys.argv else None
FROM_FIT = int(sys.argv[sys.argv.index("--from-fit") + 1]) if "--from-fit" in sys.argv else 1


def main() -> None:
    sync = keras_sync.load(CONFIG)
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if (
                step == CRASH_AT - 1
            ):  # SyncMetrics logs the steps it holds once they are 0.5 s old: at the next
                time.sleep(0.6)
            if step >= CRASH_AT:
                sync.job_run.current.flush_to_spool()  # what was logged is on disk, as after 0.2 s
                os._exit(9)

    def run_training(epochs: int, crash: bool) -> None:
        nonlocal sync
        if NEW_SYNC:
            sync = keras_sync.load(CONFIG)
        with sync.scope():
            model = keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
            )
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        sync.fit(
            model,
            x,
            y,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[Crash()] if crash else [],
        )

    for fit, epochs in enumerate((1, 1, 2), 1):
        if fit >= FROM_FIT:
            run_training(epochs, crash=CRASH_AT is not None and fit == 2)
    print("FITS DONE", flush=True)


if __name__ == "__main__":
    main()
