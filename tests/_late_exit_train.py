"""A 2-worker job whose worker 1 ends its script SLEEP_S seconds after training, for tests/test_multi_worker.py.

Usage (under `keras-sync launch --workers 2`): python _late_exit_train.py SLEEP_S
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    import keras_sync

    sync = keras_sync.load(
        {
            "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
            "batch": {"global": 16},
            "mlflow": {"enabled": False},
        }
    )
    import keras
    import numpy as np

    x = np.ones((64, 4), "float32")
    with sync.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    sync.fit(model, x, x[:, :1], epochs=1, verbose=0)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        time.sleep(float(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
