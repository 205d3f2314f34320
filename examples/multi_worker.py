"""keras-sync multi-worker example: data-parallel training over worker processes, resumable after a kill.

Run:  keras-sync launch --workers 2 examples/multi_worker.py     (2 workers x 2 simulated replicas)
      python examples/multi_worker.py                            (the same training in one process)
      python examples/multi_worker.py --config my.yaml --epochs 2 --out weights.json
Kill any worker while it trains (or Ctrl-C the launcher), launch again: training resumes from the
last backup (fault_tolerance.backup_dir) at the same batch, and ends with the same weights as a
run that was never interrupted. The data is generated here, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

import keras_sync

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter, once per worker

DEFAULT_CONFIG = Path(__file__).with_name("multi_worker.yaml")


def make_data(n: int = 2048, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy linear regression problem with 16 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(16, 1))) + 0.05 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="keras-sync YAML (default: $KERAS_SYNC_CONFIG, else multi_worker.yaml here)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the final weights here as JSON (chief only)")
    args = parser.parse_args()
    config = args.config or (None if os.environ.get("KERAS_SYNC_CONFIG") else DEFAULT_CONFIG)

    sync = keras_sync.load(config)  # keras-sync: first, before any other TensorFlow work (joins the cluster)
    import keras

    if sync.is_chief:
        print(f"strategy={sync.kind} workers={sync.num_workers} replicas={sync.num_replicas} "
              f"global batch={sync.global_batch_size} learning rate={sync.learning_rate:g}")
    x, y = make_data()
    with sync.scope():
        keras.utils.set_random_seed(0)  # the same initial weights on every worker and every launch
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9), loss="mse")
    history = sync.fit(model, x, y, epochs=args.epochs, verbose=2)  # keras-sync shows the chief's progress only
    if sync.is_chief:
        print(f"final: loss={history.history['loss'][-1]:.5f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"replicas": sync.num_replicas, "workers": sync.num_workers,
                           "weights": [w.tolist() for w in model.get_weights()]}, f)


if __name__ == "__main__":
    main()
