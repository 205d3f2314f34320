"""keras-sync quickstart: a small classifier trained data-parallel on 2 simulated CPU replicas.

Run:  python examples/quickstart.py                 (uses examples/quickstart.yaml)
      python examples/quickstart.py --epochs 1 --config my.yaml
The data is generated here (two noisy interleaved spirals), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import keras_sync


def make_data(n: int = 4096, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaved spirals with noise: a small problem a linear model cannot solve."""
    rng = np.random.default_rng(seed)
    t = np.sqrt(rng.uniform(0.05, 1.0, n)) * 3 * np.pi
    label = rng.integers(0, 2, n)
    sign = np.where(label == 0, 1.0, -1.0)
    x = np.stack([sign * t * np.cos(t), sign * t * np.sin(t)], axis=1) / (3 * np.pi)
    x += rng.normal(scale=0.04, size=x.shape)
    return x.astype("float32"), label.astype("float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("quickstart.yaml")))
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    sync = keras_sync.load(args.config)  # keras-sync: first, before any other TensorFlow work
    import keras  # imported after load(): the strategy decides the devices TensorFlow starts with

    print(f"strategy={sync.kind} replicas={sync.num_replicas} workers={sync.num_workers}")
    print(f"per-replica batch={sync.per_replica_batch_size} global batch={sync.global_batch_size}")
    print(f"learning rate: base={sync.base_learning_rate:g} scaled={sync.learning_rate:g} "
          f"({sync.config.learning_rate.scaling}) warmup_steps={sync.warmup_steps()}")

    keras.utils.set_random_seed(0)
    x, y = make_data()
    with sync.scope():  # keras-sync: build and compile inside the strategy's scope
        model = keras.Sequential([
            keras.Input((2,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9),
                      loss="binary_crossentropy", metrics=["accuracy"])
    history = sync.fit(model, x, y, epochs=args.epochs, validation_split=0.1, verbose=2)  # keras-sync
    print(f"final: loss={history.history['loss'][-1]:.4f} val_accuracy={history.history['val_accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
