"""A 3-worker job in which one worker is slow, for tests/test_multi_worker.py.

Usage (under `keras-sync launch --workers 3`): python _slow_worker_train.py CONFIG_JSON SLOW_TASK HOLD_S [SLEEP_S]

Worker SLOW_TASK (-1: none) sleeps SLEEP_S (default 0.2) s before every batch (its input arrives late), as a slow input
pipeline or a busy host would make it. The slow-worker line's hold time is HOLD_S instead of a
minute, so a short job shows it.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    config, slow_task, hold_s = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    sleep_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.2
    import keras
    import numpy as np

    import keras_sync
    from keras_sync.measures import slow_worker as _slow_worker

    _slow_worker.HOLD_S = hold_s
    sync = keras_sync.load(config)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    class Slow(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if task == slow_task:
                time.sleep(sleep_s)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40 * 30, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    sync.fit(model, x, y, epochs=1, shuffle=False, verbose=0, callbacks=[Slow()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
