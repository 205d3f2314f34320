"""keras-io examples ported with keras-sync's three lines, each against one device (tests/test_ported_examples.py).

Usage: python _ported_examples.py replicas OUT_JSON   (2 simulated CPU replicas, then one device)
       python _ported_examples.py worker OUT_JSON     (one of 2 workers; TF_CONFIG from the environment)

Each case trains the same model with the same seeds, data and global batch; the test compares a
run of several replicas with the one-device run that the `replicas` mode also writes.
"""

from __future__ import annotations

import sys

import numpy as np
from _scenario import Results

import keras_sync

MODE, OUT = sys.argv[1], sys.argv[2]
GLOBAL = 8
VOCAB, LENGTH, WIDTH = 12, 6, 8
results = Results(mode=MODE)


def load(kind: str, replicas: int = 0) -> keras_sync.Sync:
    return keras_sync.load(
        {
            "strategy": {"kind": kind, "simulated_cpu_replicas": replicas},
            "batch": {"global": GLOBAL},
            "mlflow": {"enabled": False},
        }
    )


# The first load sets up the devices (2 logical CPUs, or the worker's cluster) before TensorFlow starts.
first = load("mirrored", 2) if MODE == "replicas" else load("multi_worker_mirrored")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def weights(model) -> list:
    return [w.tolist() for w in model.get_weights()]


# -- 1. sparse gradients: the text-classification transformer's position table -------------------


def position_table(sync):
    """One Adam step on a 4-row position table looked up with arange (each row once per replica)."""

    class Positions(keras.Model):
        def __init__(self):
            super().__init__()
            self.table = keras.layers.Embedding(4, 2, embeddings_initializer="ones")

        def call(self, x):
            return x + keras.ops.sum(self.table(keras.ops.arange(4)))

    with sync.scope():
        model = Positions()
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    x = np.zeros((GLOBAL, 1), "float32")
    sync.fit(model, x, np.full((GLOBAL, 1), 100.0, "float32"), epochs=1, verbose=0, shuffle=False)
    return {"delta": (model.get_weights()[0] - 1.0).tolist()}


def text_data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(64, LENGTH)).astype("int32")
    tokens[:, 1] = tokens[:, 0]  # every sequence uses a token twice
    labels = (tokens.sum(axis=1, keepdims=True) % 2).astype("float32")
    return tokens, labels


def repeated_tokens(sync):
    """A token embedding looked up with repeated ids (a sparse gradient with duplicate rows) trains as a
    one-hot matmul of the same table (a dense gradient), with Adam."""
    x, y = text_data()

    class Tokens(keras.Model):
        def __init__(self, one_hot):
            super().__init__()
            self.one_hot = one_hot
            self.table = keras.layers.Embedding(VOCAB, 4)
            self.head = keras.layers.Dense(1)

        def call(self, tokens):
            if self.one_hot:
                self.table.build((None,))
                vectors = keras.ops.matmul(keras.ops.one_hot(tokens, VOCAB), self.table.embeddings)
            else:
                vectors = self.table(tokens)
            return self.head(keras.ops.mean(vectors, axis=1))

    out = {}
    for name in ("lookup", "one_hot"):
        keras.utils.set_random_seed(1)
        with sync.scope():
            model = Tokens(name == "one_hot")
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        sync.fit(model, x, y, epochs=2, verbose=0, shuffle=False)
        out[name] = weights(model)
    return out


def transformer(sync):
    """The keras-io text-classification transformer (token + position embedding, one block), with Adam."""
    x, y = text_data()

    class TokenAndPosition(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.tokens = keras.layers.Embedding(VOCAB, WIDTH)
            self.positions = keras.layers.Embedding(LENGTH, WIDTH)

        def call(self, x):
            return self.tokens(x) + self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1]))

    keras.utils.set_random_seed(2)
    with sync.scope():
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = TokenAndPosition()(inputs)
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, WIDTH)(h, h))
        h = keras.layers.LayerNormalization()(
            h + keras.layers.Dense(WIDTH)(keras.layers.Dense(16, "relu")(h))
        )
        out = keras.layers.Dense(1, "sigmoid")(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, out)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = sync.fit(
        model, x[:48], y[:48], epochs=2, verbose=0, shuffle=False, validation_data=(x[48:], y[48:])
    )
    return {"weights": weights(model), "val_loss": history.history["val_loss"]}


# -- 2. random streams: the GAN of "customizing what happens in fit", Dropout --------------------


class LatentGAN(keras.Model):
    """The guide's GAN step, cut to what the test reads: latents drawn with the model's seed generator."""

    def __init__(self):
        super().__init__()
        self.generator = keras.layers.Dense(3)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x):
        return self.generator(x)

    def train_step(self, data):
        batch = keras.ops.shape(data[0])[0]
        latents = keras.random.normal((batch, 4), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake = self.generator(latents)
            loss = keras.ops.mean(keras.ops.square(fake))
        grads = tape.gradient(loss, self.generator.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        seen = tf.distribute.get_replica_context().all_gather(fake, axis=0)
        distinct = tf.size(tf.unique(tf.reshape(seen[:, 0], [-1]))[0])
        return {
            "distinct": tf.cast(distinct, "float32"),
            "generated": tf.cast(tf.shape(seen)[0], "float32"),
        }


class DropoutSeen(keras.Model):
    def __init__(self):
        super().__init__()
        self.dropout = keras.layers.Dropout(0.5, seed=7)
        self.dense = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.dense(self.dropout(x, training=training))

    def train_step(self, data):
        x, y = data
        masks = self.dropout(tf.ones_like(x), training=True)
        seen = tf.distribute.get_replica_context().all_gather(masks, axis=0)
        half = tf.shape(seen)[0] // 2
        same = tf.reduce_all(tf.equal(seen[:half], seen[half:]))
        return {"halves_equal": tf.cast(same, "float32")}


def random_streams(sync):
    logs = []
    keep = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs=None, seen=logs: seen.append(
            {k: float(v) for k, v in (logs or {}).items()}
        )
    )
    x = np.zeros((4 * GLOBAL, 4), "float32")
    with sync.scope():
        gan = LatentGAN()
        gan.compile(optimizer=keras.optimizers.SGD(0.01))
    sync.fit(gan, x, x, epochs=1, verbose=0, callbacks=[keep], shuffle=False)
    gan_logs = list(logs)
    logs.clear()
    with sync.scope():
        drop = DropoutSeen()
        drop.compile(optimizer="sgd", loss="mse")
    sync.fit(
        drop,
        np.ones((4 * GLOBAL, 16), "float32"),
        x[:, :1],
        epochs=1,
        verbose=0,
        callbacks=[keep],
        shuffle=False,
    )
    return {"gan": gan_logs, "dropout": list(logs)}


# -- 3. test_step: the guide's custom evaluation ---------------------------------------------------


class GuideTestStep(keras.Model):
    """ "Customizing what happens in fit": the `test_step` with `compute_loss`, a loss tracker and MAE."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.dense(x)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def custom_test_step(sync):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4 * GLOBAL, 2)).astype("float32")
    y = rng.normal(size=(4 * GLOBAL, 1)).astype("float32")
    with sync.scope():
        model = GuideTestStep()
        model.compile(optimizer="sgd", loss="mse")
    values = sync.evaluate(model, x, y, verbose=0, return_dict=True)
    return {k: float(v) for k, v in values.items()}


# -- 7. data order: a seeded dataset that reshuffles each epoch (the weather / image examples) -----


def reshuffled_dataset(sync):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=5).batch(GLOBAL)
    keras.utils.set_random_seed(6)
    with sync.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    sync.fit(model, ds, epochs=3, verbose=0)
    return {"weights": weights(model)}


CASES = {
    "position_table": position_table,
    "repeated_tokens": repeated_tokens,
    "transformer": transformer,
    "random_streams": random_streams,
    "test_step": custom_test_step,
    "reshuffle": reshuffled_dataset,
}
WORKER_CASES = ("position_table", "transformer", "random_streams", "test_step", "reshuffle")


def run(prefix: str, sync, names) -> None:
    for name in names:
        results.record(f"{prefix}{name}", lambda fn=CASES[name]: fn(sync))


if MODE == "replicas":
    run("replicas/", first, CASES)
    run("one_device/", load("default"), CASES)  # plain Keras: no strategy
else:
    run("workers/", first, WORKER_CASES)
results.dump(OUT)
