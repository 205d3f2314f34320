"""One training process for tests/test_tracking.py: which MLflow run a job writes to.

Usage:
    python _tracking_scenarios.py CONFIG.json OUT.json [CRASH_AT_STEP]

Trains 2 epochs of 20 steps with `sync.fit` on the default strategy (the config decides backup,
tracking URI, spool directory). With CRASH_AT_STEP the process dies (os._exit, as a kill would)
after that optimizer step, before anything is closed. Otherwise it writes OUT.json with the run
id once the run is closed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import keras_sync

CONFIG, OUT = sys.argv[1], sys.argv[2]
CRASH_AT = int(sys.argv[3]) if len(sys.argv) > 3 else None


def main() -> None:
    import keras

    sync = keras_sync.load(json.loads(open(CONFIG).read()))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if CRASH_AT is not None and int(self.model.optimizer.iterations.numpy()) >= CRASH_AT:
                sync.job_run.current.flush_to_spool()  # what was logged is on disk, as after 0.2 s
                os._exit(9)

    sync.fit(model, x, y, epochs=2, shuffle=False, verbose=0, callbacks=[Crash()])
    writer = sync.job_run.current
    sync.close(timeout_s=120)
    with open(OUT, "w") as fh:
        json.dump({"run_id": writer.run_id, "spool": str(writer.spool_path)}, fh)


if __name__ == "__main__":
    main()
