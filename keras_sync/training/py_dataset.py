"""A `keras.utils.PyDataset` (or a Python generator) read by keras-sync, by index, each batch once
per epoch (see `py_dataset_batches` and `GeneratorBatches`)."""

from __future__ import annotations

import threading
import types
from typing import Any

from keras_sync.errors import UsageError


def is_py_dataset(x: Any) -> bool:
    """Whether ``x`` is a `keras.utils.PyDataset` (or a legacy `keras.utils.Sequence`, the same class)."""
    return any(
        c.__name__ == "PyDataset" and c.__module__.startswith("keras") for c in type(x).__mro__
    )


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
    batches are in flight, keeps them and yields them first after the next ``start()``, which
    begins again at index 0: under a strategy epoch 0 trains a batch twice and the last ones never.

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
            "or a num_batches property (None for an endless one, with steps_per_epoch in fit)."
        ) from None
    if n is not None and n < 1:
        raise UsageError(
            f"sync.fit received an empty keras.utils.PyDataset ({type(pyds).__name__}, 0 batches). "
            "Fix: give it at least one batch."
        )
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
    # None: endless, as in Keras
    indices = tf.data.Dataset.range(n) if n is not None else tf.data.Dataset.counter()
    if isinstance(pyds, GeneratorBatches):
        # A generator ends when it ends: a flag beside each batch, False (and empty parts) past its end.
        def read_or_end(i: Any) -> list[Any]:
            batch = pyds.get(int(i))
            if batch is None:
                return [np.bool_(False)] + [np.zeros((0,) + a.shape[1:], a.dtype) for a in flat]
            return [np.bool_(True)] + [np.asarray(a) for a in tf.nest.flatten(_standardize(batch))]

        def load_or_end(i: Any) -> Any:
            ok, *parts = tf.py_function(read_or_end, [i], [tf.bool] + dtypes)
            for part, a in zip(parts, flat):
                part.set_shape((None,) + a.shape[1:])
            return ok, tf.nest.pack_sequence_as(first, parts)

        ds = indices.map(load_or_end).take_while(lambda ok, _: ok).map(lambda _, batch: batch)
        return ds, size(first), None
    ds = indices.map(load, num_parallel_calls=workers, deterministic=True)
    return ds, size(first), (n - 1) * size(first) + size(last) if n is not None else None


class GeneratorBatches:
    """A Python generator given to `sync.fit`/`evaluate`/`predict`, read by keras-sync by index.

    Keras wraps a generator so that every iterator made over it first replays the batches it
    peeked at (`GeneratorDataAdapter`), and under a strategy a first iterator is made and dropped
    with batches already pulled: some batches train twice, others never. keras-sync numbers the generator's batches in the order it
    yields them and keeps the last ``keep`` of them, so an iterator that starts again at 0 reads the
    same batches, never new ones; each batch trains once, in order, as on one device.
    """

    # endless to the reader: a generator ends when it ends (see py_dataset_batches)
    num_batches = None
    workers = 1
    use_multiprocessing = False

    def __init__(self, generator: Any, keep: int = 256) -> None:
        self._generator = generator
        self._kept: dict[int, Any] = {}
        self._next = 0
        self._ended = False
        self._keep = keep
        self._lock = threading.Lock()

    def get(self, i: int) -> Any:
        """Batch ``i`` (numbered from 0 in the generator's order), or None past the generator's end."""
        with self._lock:
            while self._next <= i and not self._ended:
                try:
                    self._kept[self._next] = next(self._generator)
                except StopIteration:
                    self._ended = True
                    break
                self._next += 1
                self._kept.pop(self._next - 1 - self._keep, None)
            if i in self._kept:
                return self._kept[i]
            if i >= self._next:
                return None
        raise UsageError(
            f"keras-sync read batch {i} of a Python generator again after {self._next - i} newer ones (it keeps "
            f"the last {self._keep}); Keras restarted its reader further back than that. Fix: give the data as a "
            "keras.utils.PyDataset or a tf.data.Dataset (read by index or made again each epoch)."
        )

    def __getitem__(self, i: int) -> Any:
        batch = self.get(i)
        if batch is None:
            raise UsageError(
                "the Python generator given to keras-sync yielded no batch. Fix: give it at least one."
            )
        return batch

    def on_epoch_begin(self) -> None:
        """Nothing: a generator continues from where the last epoch stopped, as in Keras."""

    def on_epoch_end(self) -> None:
        """Nothing (see `on_epoch_begin`)."""


def is_generator(x: Any) -> bool:
    """Whether Keras reads ``x`` as a Python generator (`types.GeneratorType`, as its adapters test)."""
    return isinstance(x, types.GeneratorType)


def generator_batches(x: Any, method: str, kwargs: dict[str, Any]) -> GeneratorBatches:
    """A generator given to ``method``, read by keras-sync; refused in one line where it cannot be exact."""
    steps = kwargs.get("steps_per_epoch" if method == "fit" else "steps")
    if method == "fit" and steps is None and int(kwargs.get("epochs", 1)) > 1:
        raise UsageError(
            f"sync.fit received a Python generator with epochs={kwargs.get('epochs')} and no steps_per_epoch: "
            "its first epoch reads it to the end and the next ones have nothing left (Keras replays its first "
            "2 batches). Fix: pass steps_per_epoch=<batches per epoch> (an endless generator), or give a "
            "keras.utils.PyDataset or a tf.data.Dataset."
        )
    return GeneratorBatches(x)


def generator_source(n_steps: Any) -> str:
    per_epoch = f"{n_steps} batches per epoch (steps_per_epoch)" if n_steps else "read to its end"
    return f"a Python generator, {per_epoch}, read by keras-sync in order, each batch once,"


def py_dataset_source(pyds: Any, n: int | None) -> str:
    workers = int(getattr(pyds, "workers", 1) or 1)
    processes = bool(getattr(pyds, "use_multiprocessing", False))
    how = (
        "one at a time"
        if workers <= 1
        else f"{workers} at a time on threads{' (not processes)' * processes}"
    )
    length = f"of {n} batches" if n is not None else "without end"
    return (
        f"keras.utils.PyDataset {length}, read by keras-sync by index, each once per epoch ({how}),"
    )


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
