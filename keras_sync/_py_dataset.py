"""A `keras.utils.PyDataset` read by keras-sync, by index, each batch once per epoch (see `py_dataset_batches`)."""

from __future__ import annotations

from typing import Any

from keras_sync.errors import UsageError


def is_py_dataset(x: Any) -> bool:
    """Whether ``x`` is a `keras.utils.PyDataset` (or a legacy `keras.utils.Sequence`, the same class)."""
    return any(c.__name__ == "PyDataset" and c.__module__.startswith("keras") for c in type(x).__mro__)


def _standardize(batch: Any) -> Any:
    """A PyDataset batch as Keras reads it: an array is ``(x,)``, a list a tuple."""
    import numpy as np

    if isinstance(batch, np.ndarray):
        return (batch,)
    if isinstance(batch, list):
        return tuple(batch)
    return batch


def py_dataset_batches(pyds: Any) -> tuple[Any, int, int | None]:
    """(a `tf.data.Dataset` of the PyDataset's batches, its first batch's size, its examples per epoch).

    keras-sync reads the PyDataset itself, by index, each batch exactly once per epoch, in order:
    ``range(len).map(py_function(pyds[i]))``, ``pyds.workers`` batches at a time (threads; the
    map keeps the order). Keras's own reader is not used: its `OrderedEnqueuer`, stopped while
    batches are in flight, moves them to ``ready_queue`` (``PyDatasetEnqueuer.stop(drain_queue_and_join=True)``)
    and the next ``start()`` begins again at index 0, so the next read yields those stale batches,
    then 0, 1, ... and stops after ``num_batches``: a batch twice and the last ones never (measured
    with the enqueuer alone: stopped after one read, the next 16 reads were 1..11, 0..4). Under a
    strategy epoch 0 trains so (keras/src/trainers/data_adapters/py_dataset_adapter.py, Keras 3.15.1).

    The examples per epoch are ``(len - 1) x first + last``: they assume equal middle batches.
    """
    import numpy as np
    import tensorflow as tf

    try:
        n = pyds.num_batches
    except NotImplementedError:
        raise UsageError(
            f"sync.fit received a keras.utils.PyDataset without a length ({type(pyds).__name__} has neither __len__ "
            "nor num_batches); keras-sync reads a PyDataset by index, each batch once per epoch. Fix: give it __len__, "
            "or a num_batches property (None for an endless one, with steps_per_epoch in fit).") from None
    if n is not None and n < 1:
        raise UsageError(f"sync.fit received an empty keras.utils.PyDataset ({type(pyds).__name__}, 0 batches). "
                         "Fix: give it at least one batch.")
    first = _standardize(pyds[0])
    last = _standardize(pyds[n - 1]) if n is not None and n > 1 else first
    flat = [np.asarray(a) for a in tf.nest.flatten(first)]
    dtypes = [tf.as_dtype(a.dtype) for a in flat]
    size = lambda b: int(np.shape(tf.nest.flatten(b)[0])[0])  # noqa: E731

    def read(i: Any) -> list[Any]:
        return [np.asarray(a) for a in tf.nest.flatten(_standardize(pyds[int(i)]))]

    def load(i: Any) -> Any:
        parts = tf.py_function(read, [i], dtypes)
        for part, a in zip(parts, flat):
            part.set_shape((None,) + a.shape[1:])
        return tf.nest.pack_sequence_as(first, parts)

    workers = max(1, int(getattr(pyds, "workers", 1) or 1))
    indices = tf.data.Dataset.range(n) if n is not None else tf.data.Dataset.counter()  # None: endless, as in Keras
    ds = indices.map(load, num_parallel_calls=workers, deterministic=True)
    return ds, size(first), (n - 1) * size(first) + size(last) if n is not None else None


def py_dataset_source(pyds: Any, n: int | None) -> str:
    workers = int(getattr(pyds, "workers", 1) or 1)
    processes = bool(getattr(pyds, "use_multiprocessing", False))
    how = "one at a time" if workers <= 1 else f"{workers} at a time on threads{' (not processes)' * processes}"
    length = f"of {n} batches" if n is not None else "without end"
    return f"keras.utils.PyDataset {length}, read by keras-sync by index, each once per epoch ({how}),"


class PyDatasetEpochs:
    """Calls the PyDataset's ``on_epoch_begin``/``on_epoch_end`` as Keras's own reader would."""

    def __new__(cls, pyds: Any) -> Any:
        import keras

        class PyDatasetEpochs(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                pyds.on_epoch_begin()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                pyds.on_epoch_end()

        return PyDatasetEpochs()
