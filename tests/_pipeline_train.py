"""Training with user-batched pipelines through sync.fit, for tests/test_pipeline.py.

argv: MODE OUT [CONFIG_JSON]
  reference  plain Keras on one device at batch 32 and the learning rate keras-sync scales for it
  replicas   2 simulated replicas (mirrored), one fit per input kind, plus the batch/policy probes
  workers    under `keras-sync launch` (multi_worker_mirrored), one fit per input kind
Input kinds: arrays (and each worker's own arrays, batch.shard_policy: off); tf.data pipelines batched by
64; keras.utils.PyDataset (batches of 16; batches of 32, workers=2, threads or processes); pipelines already split per worker (a shard op; AutoShardPolicy.OFF with a known and an
unknown length); TFRecord files (1 file: fewer than the workers; 4 files, laid out so that TensorFlow's
sharding by file trains one device's batch k at step k).
Each writes OUT/<mode>[-w<task>].json: weights per input kind, what the pipeline did (facts), probes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import warnings

import numpy as np

N, FEATURES, EPOCHS, BATCH = 512, 8, 2, 32
BASE_LR = (
    0.05  # tuned for the per-replica batch 16; linear scaling gives 0.1 for the global batch 32
)
USER_BATCH = 64  # the batch the user's own pipeline was written with
UNEVEN = 481  # examples of the uneven user-sharded case


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return x, y


def model(keras, lr, scope=None):
    keras.utils.set_random_seed(0)
    with scope or contextlib.nullcontext():
        m = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        m.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    return m


def flat(m) -> list[float]:
    return np.concatenate([w.ravel() for w in m.get_weights()]).tolist()


def py_dataset(keras, x, y, batch, workers=1, processes=False):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-N // batch)

        def __getitem__(self, i):
            return x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]

    return Batches(workers=workers, use_multiprocessing=processes)


def write_records(tf, x, y, files: int, workers: int, out: str) -> list[str]:
    """The examples in `files` TFRecord files, laid out so that reading them as TensorFlow shards them
    trains batch k of one device at step k: files i and i + workers.. hold the worker i's slice of each
    global batch (one file per worker: examples in order)."""
    rows = np.concatenate([x, y], axis=1)
    per_worker = BATCH // workers
    order = [
        rows[np.arange(N).reshape(-1, BATCH)[:, w * per_worker : (w + 1) * per_worker].ravel()]
        for w in range(workers)
    ]
    names = []
    for f in range(files):
        w, part = f % workers, f // workers
        chunk = np.array_split(order[w], files // workers)[part]
        name = os.path.join(out, f"records-{files}-{f}.tfrecord")
        with tf.io.TFRecordWriter(name) as writer:
            for r in chunk:
                writer.write(r.astype("float32").tobytes())
        names.append(name)
    return names


def inputs(tf, x, y, keras=None, workers=1, index=0, out="."):
    """The pipelines a user brings, each batched by USER_BATCH, none by keras-sync."""

    def gen():
        for i in range(0, N, USER_BATCH):
            yield x[i : i + USER_BATCH], y[i : i + USER_BATCH]

    spec = (tf.TensorSpec([None, FEATURES], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    plain = tf.data.Dataset.from_tensor_slices((x, y))
    off = tf.data.Options()
    off.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    mine = (
        x[index::workers],
        y[index::workers],
    )  # this worker's part, as a user (or Ray) splits it

    def gen_mine():
        for i in range(0, len(mine[0]), 16):
            yield mine[0][i : i + 16], mine[1][i : i + 16]

    def parse(r):
        v = tf.io.decode_raw(r, tf.float32)
        return v[:FEATURES], v[FEATURES:]

    def records(files):
        # each worker its own copy of the same files; the 1-worker run beside the 2-worker job its own too
        here = os.path.join(out, f"records-{workers}workers-w{index}")
        os.makedirs(here, exist_ok=True)
        names = write_records(tf, x, y, files, workers if files >= workers else 1, here)
        return tf.data.TFRecordDataset(names).map(parse).batch(BATCH)

    def endless():  # a Python generator as Keras scripts write them: endless, steps_per_epoch in fit
        while True:
            for i in range(0, N, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    extra = (
        {}
        if keras is None
        else {
            "python_generator": endless,
            "pydataset16": lambda: py_dataset(keras, x, y, 16),
            "pydataset32_threads": lambda: py_dataset(keras, x, y, BATCH, workers=2),
            "pydataset32_processes": lambda: py_dataset(
                keras, x, y, BATCH, workers=2, processes=True
            ),
            "user_shard": lambda: plain.shard(workers, index).batch(16),
            "own_off": lambda: tf.data.Dataset.from_tensor_slices(mine).batch(16).with_options(off),
            "own_off_unknown_length": lambda: tf.data.Dataset.from_generator(
                gen_mine, output_signature=spec
            ).with_options(off),
            "tfrecord1": lambda: records(1),
            "tfrecord4": lambda: records(4),
            # 481 = 241 + 240: 16 and 15 batches of 16 per replica, parts of different lengths
            "user_shard_uneven": lambda: (
                tf.data.Dataset.from_tensor_slices((x[:UNEVEN], y[:UNEVEN]))
                .shard(workers, index)
                .batch(16)
            ),
        }
    )
    return {
        "batch64": lambda: plain.batch(USER_BATCH),
        "batch64_map_prefetch": lambda: (
            plain.batch(USER_BATCH).map(lambda a, b: (a * 1.0, b)).prefetch(2)
        ),
        "generator64": lambda: tf.data.Dataset.from_generator(gen, output_signature=spec),
        **extra,
    }


def fit_all(sync, keras, tf, x, y) -> dict:
    out: dict = {"weights": {}, "warnings": {}, "steps": {}, "facts": {}}
    workers, index = sync.num_workers, sync.task[1] or 0
    kinds = {
        "arrays": None,
        "arrays_own_part": "own_arrays",
        **inputs(tf, x, y, keras, workers, index, os.getcwd()),
    }
    for kind, make in kinds.items():
        m = model(keras, sync.lr_schedule(), sync.scope())
        err = io.StringIO()
        with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if make is None:
                sync.fit(m, x, y, epochs=EPOCHS, shuffle=False, verbose=0)
            elif make == "own_arrays":  # batch.shard_policy: off, each worker loaded its own part
                config = sync.config
                sync.config = dataclasses.replace(
                    config, batch=dataclasses.replace(config.batch, shard_policy="off")
                )
                sync.fit(
                    m, x[index::workers], y[index::workers], epochs=EPOCHS, shuffle=False, verbose=0
                )
                sync.config = config
            elif kind == "python_generator":
                sync.fit(m, make(), steps_per_epoch=N // BATCH, epochs=EPOCHS, verbose=0)
            else:
                sync.fit(m, make(), epochs=EPOCHS, verbose=0)
        out["weights"][kind] = flat(m)
        out["facts"][kind] = (
            dict(vars(sync.input_facts)) if getattr(sync, "input_facts", None) else None
        )
        out["steps"][kind] = int(m.optimizer.iterations.numpy())
        out["warnings"][kind] = [str(w.message) for w in caught if "batch size" in str(w.message)]
        out.setdefault("ran_out", {})[kind] = [
            str(w.message) for w in caught if "ran out of data" in str(w.message)
        ]
    return out


def probes(sync, tf, x, y) -> dict:
    """What the pipeline reads from datasets and which policy they end with."""
    from keras_sync.errors import UsageError
    from keras_sync.training.dataset_graph import batch_size_of, own_shard_policy

    plain = tf.data.Dataset.from_tensor_slices((x, y))
    off = tf.data.Options()
    off.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    found = {
        name: list(batch_size_of(ds))
        for name, ds in {
            "static": plain.batch(64, drop_remainder=True),
            "batch_op": plain.batch(64),
            "map_after_batch": plain.batch(64).map(lambda a, b: (a, b)),
            "parallel_batch": plain.batch(64, num_parallel_calls=2),
            "padded": plain.padded_batch(16),
            "generator": inputs(tf, x, y)["generator64"](),
        }.items()
    }
    pipe = sync._pipeline()
    ray_like = pipe.training_dataset(plain.batch(64).with_options(off))
    distributed = sync.distribute(plain.with_options(off))
    try:
        pipe.training_dataset(plain)
        unbatched = "no error"
    except UsageError as e:
        unbatched = str(e)
    import keras

    from keras_sync.training.py_dataset import py_dataset_batches

    class Endless(keras.utils.PyDataset):
        def __getitem__(self, i):
            return x[:16], y[:16]

    try:
        py_dataset_batches(Endless())
        endless = "no error"
    except UsageError as e:
        endless = str(e)
    refused = {}
    for name, call in {
        "generator_epochs_without_steps": lambda m: sync.fit(
            m, (b for b in [(x[:32], y[:32])] * 4), epochs=2, verbose=0
        ),
        "validation_generator": lambda m: sync.fit(
            m, x, y, validation_data=((x[:32], y[:32]) for _ in range(2)), verbose=0
        ),
    }.items():
        try:
            call(model(keras, 0.1, sync.scope()))
            refused[name] = "no error"
        except UsageError as e:
            refused[name] = str(e)
    # The rebatched dataset keeps a known size (Keras shows progress, warmup_epochs can use it).
    return {
        "found": found,
        "own_off_kept": own_shard_policy(ray_like),
        "distribute_off_kept": own_shard_policy(distributed),
        "arrays_policy": own_shard_policy(sync.distribute((x, y))),
        "rebatched_cardinality": int(pipe.training_dataset(plain.batch(64)).cardinality()),
        "unbatched_error": unbatched,
        "endless_py_dataset_error": endless,
        "refused_generators": refused,
    }


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    x, y = data()
    if mode == "reference":
        import keras

        m = model(keras, BASE_LR * BATCH / 16)
        m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        # What the user's pipeline trained on before: batches of 64 at the rate scaled for 32.
        m64 = model(keras, BASE_LR * BATCH / 16)
        m64.fit(x, y, batch_size=USER_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        m481 = model(keras, BASE_LR * BATCH / 16)
        m481.fit(x[:UNEVEN], y[:UNEVEN], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        result = {
            "weights": flat(m),
            "steps": int(m.optimizer.iterations.numpy()),
            "weights_batch64": flat(m64),
            "weights_uneven": flat(m481),
        }
        name = "reference"
    else:
        import keras_sync

        sync = keras_sync.load(json.loads(sys.argv[3]))
        import keras
        import tensorflow as tf

        result = fit_all(sync, keras, tf, x, y)
        result.update(
            global_batch=sync.global_batch_size,
            learning_rate=sync.learning_rate,
            replicas=sync.num_replicas,
            workers=sync.num_workers,
            is_chief=sync.is_chief,
        )
        if mode == "replicas":
            result["probes"] = probes(sync, tf, x, y)
        name = f"{mode}-w{sync.task[1] or 0}"
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
