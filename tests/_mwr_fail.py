"""A keras-sync training script whose worker 1 fails after joining the cluster (tests/test_multi_worker.py).

Every worker prints ``pid <pid>``; worker 1 then exits with an error while worker 0 trains and
waits in its collectives for the dead peer.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
print(f"pid {os.getpid()}", flush=True)

import keras_sync  # noqa: E402

sync = keras_sync.load(
    {
        "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 60},
        "batch": {"global": 32},
        "mlflow": {"enabled": False},
    }
)
if sync.task[1] == 1:
    print(f"failing at {time.time():.3f}", flush=True)
    sys.exit("worker 1: simulated failure")

import keras  # noqa: E402
import numpy as np  # noqa: E402

with sync.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 4), "float32")
sync.fit(model, x, x[:, :1], epochs=1000, verbose=0)
