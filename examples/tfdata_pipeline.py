"""A tf.data input pipeline under keras-sync: TFRecord shards on disk, read in parallel.

The data is generated into TFRecord files first (nothing is downloaded). With several workers,
`batch.shard_policy: auto` shards by file, so each worker reads its own files.

Run:  python examples/tfdata_pipeline.py [--epochs N] [--config FILE] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import keras_sync

FEATURES = 12


def write_shards(directory: Path, shards: int = 4, per_shard: int = 512, seed: int = 0) -> list[str]:
    """Write a synthetic classification set as TFRecord files of tf.train.Example protos."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(FEATURES,))
    paths = []
    for s in range(shards):
        path = directory / f"train-{s:02d}-of-{shards:02d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for _ in range(per_shard):
                x = rng.normal(size=(FEATURES,)).astype("float32")
                label = float(x @ w + 0.3 * rng.normal() > 0)
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[label])),
                }))
                writer.write(example.SerializeToString())
        paths.append(str(path))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("quickstart.yaml")))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()

    sync = keras_sync.load(args.config)  # keras-sync: before any other TensorFlow work
    import keras
    import tensorflow as tf

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="keras-sync-tfdata-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p) for p in data_dir.glob("*.tfrecord")) or write_shards(data_dir, shards=4, per_shard=512)

    spec = {"x": tf.io.FixedLenFeature([FEATURES], tf.float32), "y": tf.io.FixedLenFeature([1], tf.float32)}

    def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        ex = tf.io.parse_single_example(record, spec)
        return ex["x"], ex["y"]

    examples = (tf.data.Dataset.from_tensor_slices(files)
                .interleave(tf.data.TFRecordDataset, cycle_length=2, num_parallel_calls=tf.data.AUTOTUNE)
                .map(parse, num_parallel_calls=tf.data.AUTOTUNE)
                # interleave hides the size; telling it lets Keras show progress and avoids a warning
                .apply(tf.data.experimental.assert_cardinality(4 * 512)))
    # keras-sync: batch by the global batch, shard policy from the config, shuffle with one seed on all workers
    train = sync.distribute(examples, shuffle=True).prefetch(tf.data.AUTOTUNE)
    print(f"files={len(files)} replicas={sync.num_replicas} global batch={sync.global_batch_size} "
          f"learning rate={sync.learning_rate:g}")

    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9),
                      loss="binary_crossentropy", metrics=["accuracy"])
    history = sync.fit(model, train, epochs=args.epochs, verbose=2)
    print(f"final: accuracy={history.history['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
