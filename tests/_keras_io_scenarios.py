"""keras-io examples ported with keras-sync's three lines, on 2 simulated CPU replicas (MirroredStrategy).

Usage: python _keras_io_scenarios.py OUT.json

Each case is a keras-io example as a user ports it (issue 38), with small synthetic data of the
example's kind; tests/test_keras_io_ports.py reads what each saw:
- ``gan``, ``gan_misscaled``: the GAN of "Customizing what happens in `fit()`" (its own d_optimizer and
  g_optimizer given to compile(), which calls super().compile());
- ``image_jit``, ``image_jit_auto``: "Image classification from scratch", whose compile line has
  ``jit_compile=True`` (and the same model with Keras's default, "auto").
Then OUT.json is written, and the script ends as the user's would: the "Multi-GPU distributed
training with TensorFlow" guide with its Input/Dense lines left above ``with sync.scope():``, uncaught,
so that the test reads what the user sees (stderr and the exit code).
"""

from __future__ import annotations

import contextlib
import io
import sys

import numpy as np
from _scenario import Results

import keras_sync

OUT = sys.argv[1]
GLOBAL_BATCH = 64
results = Results()


def config(**sections):
    cfg = {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"global": GLOBAL_BATCH},
        "mlflow": {"enabled": False},
    }
    cfg.update(sections)
    return cfg


sync = keras_sync.load(config())

import keras  # noqa: E402  (after load: the devices are set up by then)
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)


def stderr_of(fn):
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        out = fn()
    return out, buf.getvalue()


def said(err):
    return [line for line in err.splitlines() if line.startswith("keras-sync: ")]


class GAN(keras.Model):
    """The guide's GAN (its train_step as published; call() added, as keras-sync asks of a model without one)."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def call(self, x):
        return self.discriminator(x)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat(
            [tf.ones((batch_size, 1)), tf.zeros((tf.shape(real_images)[0], 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


IMAGES = rng.uniform(size=(256, 8, 8, 1)).astype("float32")  # the guide's MNIST digits, small


def gan_fit(s, g_rate):
    """One epoch of the GAN; the guide's Adam(0.0003) become sync.learning_rate (``g_rate``: the generator's)."""
    keras.utils.set_random_seed(0)
    latent_dim = 4
    with s.scope():
        discriminator = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="leaky_relu"),
                keras.layers.Dense(1),
            ]
        )
        generator = keras.Sequential(
            [
                keras.Input((latent_dim,)),
                keras.layers.Dense(64, activation="sigmoid"),
                keras.layers.Reshape((8, 8, 1)),
            ]
        )
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
        gan.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=s.learning_rate),
            g_optimizer=keras.optimizers.Adam(learning_rate=g_rate),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    dataset = tf.data.Dataset.from_tensor_slices(IMAGES).batch(GLOBAL_BATCH)
    _, err = stderr_of(lambda: s.fit(gan, dataset, epochs=1, verbose=0))
    return {
        "said": said(err),
        "scaled": s.learning_rate,
        "unused_default": float(keras.ops.convert_to_numpy(gan.optimizer.learning_rate)),
        "steps": [int(gan.d_optimizer.iterations.numpy()), int(gan.g_optimizer.iterations.numpy())],
    }


GAN_RATES = {"base": 0.0003, "scaling": "linear", "base_batch_size": GLOBAL_BATCH}


def gan():
    """Both optimizers at the scaled rate; the default RMSprop of super().compile() trains nothing."""
    s = keras_sync.load(
        config(
            learning_rate=GAN_RATES,
            mlflow={
                "enabled": True,
                "tracking_uri": "sqlite:///gan.db",
                "experiment": "gan",
                "system_metrics": False,
            },
        )
    )
    out = gan_fit(s, s.learning_rate)
    from _scenario import close_run
    from mlflow.tracking import MlflowClient

    run_id = close_run(s, 120)
    tags = MlflowClient("sqlite:///gan.db").get_run(run_id).data.tags
    out["check_tags"] = {k: v for k, v in tags.items() if k.startswith("keras_sync.check")}
    return out


def gan_misscaled():
    """The generator's optimizer keeps a rate of its own (0.002): that one is said."""
    return gan_fit(keras_sync.load(config(learning_rate=GAN_RATES)), 0.002)


def image_classifier(jit_compile):
    """The image-classification example's compile line (``jit_compile=None``: left out, Keras's "auto")."""
    keras.utils.set_random_seed(0)
    with sync.scope():
        inputs = keras.Input((16, 16, 3))
        x = keras.layers.Rescaling(1.0 / 255)(inputs)
        x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
        extra = {} if jit_compile is None else {"jit_compile": jit_compile}
        model.compile(
            optimizer=keras.optimizers.Adam(3e-4),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy(name="acc")],
            **extra,
        )
    images = rng.uniform(0, 255, size=(128, 16, 16, 3)).astype("float32")
    labels = rng.integers(0, 2, size=(128, 1)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    h, err = stderr_of(lambda: sync.fit(model, images, labels, epochs=1, verbose=0))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(before, model.get_weights()))
    return {
        "said": said(err),
        "traceback": "Traceback" in err,
        "jit_compile": model.jit_compile,
        "loss": h.history["loss"],
        "moved": moved,
    }


results.record("gan", gan)
results.record("gan_misscaled", gan_misscaled)
results.record("image_jit", lambda: image_classifier(True))
results.record("image_jit_auto", lambda: image_classifier(None))
results.dump(OUT)
sys.stderr.write("keras-io scenarios: the guide's model follows\n")
sys.stderr.flush()

# The distributed guide's get_compiled_model(), with only the Model and compile lines moved into the scope.
inputs = keras.Input(shape=(784,))
x = keras.layers.Dense(256, activation="relu")(inputs)
x = keras.layers.Dense(256, activation="relu")(x)
outputs = keras.layers.Dense(10)(x)
with sync.scope():
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
sync.fit(
    model,
    rng.uniform(size=(128, 784)).astype("float32"),
    rng.integers(0, 10, size=(128,)),
    epochs=1,
    verbose=0,
)
print("the guide's model trained")
