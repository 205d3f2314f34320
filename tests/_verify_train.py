"""A user's training script with keras-sync's three lines, for `keras-sync verify` (tests/test_verify.py).

Usage: python _verify_train.py CASE [noshuffle] [frozen_bn]   (the config: $KERAS_SYNC_CONFIG)

CASE: dense (arrays), uneven (dense on 21 examples: an uneven last batch), dataset (a batched tf.data pipeline), custom_sum (a custom train_step whose
loss is not divided), batchnorm, dropout, add_loss (a term that sums over the batch), masked (a
GRU on padded sequences, its loss a mean over the unpadded tokens), mobilenet
(keras.applications.MobileNetV2 on 32x32 images). Plain SGD: an update's size shows the gradient's.
"""

from __future__ import annotations

import sys

import numpy as np

import keras_sync

CASE = sys.argv[1]
sync = keras_sync.load()
import keras  # noqa: E402
from keras import ops  # noqa: E402

rng = np.random.default_rng(0)
if CASE == "mobilenet":
    x = rng.normal(size=(256, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(256,))
else:
    x = rng.normal(size=(512, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
if CASE == "uneven":  # 21 examples at a global batch of 8: updates of 8, 8 and 5
    x, y = x[:21], y[:21]
if CASE == "masked":  # padded sequences of 2 to 10 tokens: each replica's batch has its own count
    lengths = rng.integers(2, 11, size=128)
    x = np.where(np.arange(10) < lengths[:, None], rng.integers(1, 30, size=(128, 10)), 0)
    y = (x * 7) % 5


class SummedStep(keras.Model):
    """The guide's custom train_step, with the loss not divided by the replica count."""

    def train_step(self, data):
        import tensorflow as tf

        xb, yb = data
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self(xb, training=True) - yb))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class SumPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(1e-3 * ops.sum(h))
        return h


def build():
    if CASE == "masked":  # a per-token loss, averaged by Keras over the unpadded tokens
        inputs = keras.Input((10,), dtype="int32")
        h = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
        h = keras.layers.GRU(8, return_sequences=True)(h)
        return keras.Model(inputs, keras.layers.Dense(5)(h))
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    if CASE == "batchnorm":
        h = keras.layers.BatchNormalization()(h)
    if CASE == "dropout":
        h = keras.layers.Dropout(0.5)(h)
    if CASE == "add_loss":
        h = SumPenalty()(h)
    outputs = keras.layers.Dense(1)(h)
    return (SummedStep if CASE == "custom_sum" else keras.Model)(inputs, outputs)


with sync.scope():
    if CASE == "mobilenet":
        model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
        if (
            "frozen_bn" in sys.argv[2:]
        ):  # BatchNorm in inference mode: no layer depends on the batch
            for layer in model.layers:
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.trainable = False
        model.compile(
            optimizer=keras.optimizers.SGD(sync.lr_schedule()),
            loss="sparse_categorical_crossentropy",
        )
    else:
        model = build()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(
            optimizer=keras.optimizers.SGD(sync.lr_schedule()),
            loss=loss if CASE == "masked" else "mse",
        )
if CASE == "dataset":
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    sync.fit(model, data, epochs=3, verbose=0)
else:
    sync.fit(model, x, y, epochs=3, verbose=0, shuffle="noshuffle" not in sys.argv[2:])
print("the script went on after fit", flush=True)
