"""An ordinary single-device Keras script: a regression MLP on generated data.

Compare with keras_sync_version.py: the difference is the few lines marked `# keras-sync` there.
"""

import argparse

import keras
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 10)).astype("float32")
y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] ** 2 + 0.1 * rng.normal(size=(2048, 1))).astype("float32")

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((10,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
history = model.fit(x, y, batch_size=32, epochs=args.epochs, validation_split=0.1, verbose=2)
print(f"final val_loss={history.history['val_loss'][-1]:.4f}")
