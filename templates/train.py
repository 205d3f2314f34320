"""Train a small Keras model on generated data, distributed by keras-sync.

A plain Keras script plus the three lines marked `# keras-sync`:
  sync = keras_sync.load()      reads keras_sync.yaml, builds the tf.distribute strategy,
                                scales the batch and learning rate to the replica count
  with sync.scope():            builds the model's variables on every replica
  sync.fit(model, ...)          model.fit with the global batch and the sync metrics to MLflow

Run it (in this directory): python train.py [--epochs N]
See what it will do:        keras-sync plan
Two workers, one machine:   keras-sync launch --workers 2 train.py
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import numpy as np

import keras_sync

if TYPE_CHECKING:
    import keras


def make_data(n: int = 4096, features: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A separable binary task, so accuracy visibly climbs within a few epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (x @ w > 0).astype("float32")
    return x, y


def build_model(features: int, learning_rate: object) -> keras.Model:
    import keras  # after keras_sync.load(): importing Keras starts TensorFlow (~5 s)

    model = keras.Sequential([
        keras.Input(shape=(features,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=learning_rate),
                  loss="binary_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small Keras model with keras-sync.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train (default: 3)")
    args = parser.parse_args()

    # keras-sync: first, before Keras or TensorFlow start: a config mistake is reported in a fraction of a
    # second, and simulated replicas and the cluster are set up before TensorFlow initialises.
    sync = keras_sync.load()  # keras-sync: $KERAS_SYNC_CONFIG, else ./keras_sync.yaml
    print(sync)
    x, y = make_data()
    with sync.scope():  # keras-sync
        model = build_model(x.shape[1], sync.lr_schedule())
    sync.fit(model, x, y, epochs=args.epochs, validation_split=0.1, verbose=2)  # keras-sync


if __name__ == "__main__":
    main()
