"""An ordinary single-device Keras script: a regression MLP on generated data.

Compare with plain_keras.py: the difference is the few lines marked `# keras-sync` here.
"""

import argparse

import keras
import numpy as np

import keras_sync  # keras-sync

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()
sync = keras_sync.load()  # keras-sync: ./keras_sync.yaml (batch.per_replica: 32, learning_rate.base: 1e-3)

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 10)).astype("float32")
y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] ** 2 + 0.1 * rng.normal(size=(2048, 1))).astype("float32")

keras.utils.set_random_seed(0)
with sync.scope():  # keras-sync
    model = keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(sync.lr_schedule()), loss="mse", metrics=["mae"])  # keras-sync
history = sync.fit(model, x, y, epochs=args.epochs, validation_split=0.1, verbose=2)  # keras-sync
print(f"final val_loss={history.history['val_loss'][-1]:.4f}")
