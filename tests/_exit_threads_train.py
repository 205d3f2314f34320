"""A fit whose dropped tf.data iterators are still referenced when the interpreter exits.

Prints ``thread started at exit: NAME`` on stderr for every thread started after the main thread
is done (Python 3.12 refuses those: "can't create new thread at interpreter shutdown", a
traceback at every exit), then ``fit returned`` once `sync.fit` is back.
"""

import sys
import threading

_start = threading.Thread.start


def _start_watched(self: threading.Thread) -> None:
    if not threading.main_thread().is_alive():
        sys.stderr.write(f"thread started at exit: {self.name}\n")
        sys.stderr.flush()
    _start(self)


threading.Thread.start = _start_watched  # type: ignore[method-assign]

import numpy as np  # noqa: E402

import keras_sync  # noqa: E402

sync = keras_sync.load(
    {"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "mlflow": {"enabled": False}}
)
import keras  # noqa: E402
from tensorflow.python.distribute import input_lib  # noqa: E402

# Every distributed iterator fit makes stays referenced here until the interpreter exits, so the
# releaser still holds them when the main thread is done (as a user's globals may).
kept = []
_iter = input_lib.DistributedDataset.__iter__


def _kept_iter(self):  # type: ignore[no-untyped-def]
    iterator = _iter(self)
    kept.append(iterator)
    return iterator


input_lib.DistributedDataset.__iter__ = _kept_iter
with sync.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 4), "float32")
y = np.zeros((64, 1), "float32")
sync.fit(model, x, y, epochs=2, validation_data=(x, y), verbose=0)
print(f"fit returned; {len(kept)} iterators kept", file=sys.stderr, flush=True)
