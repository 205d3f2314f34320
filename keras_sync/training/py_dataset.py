"""A `keras.utils.PyDataset` or a Python generator read by index, each batch once per epoch, in
order, as on one device (Keras's own readers train some batches twice under a strategy)."""

from __future__ import annotations

import threading
import types
from typing import Any

from keras_sync.errors import UsageError


def is_py_dataset(x: Any) -> bool:
    """Whether ``x`` is a `keras.utils.PyDataset` (or a legacy `keras.utils.Sequence`, the same class)."""
    return any(c.__name__ == "PyDataset" and "keras" in c.__module__ for c in type(x).__mro__)


class GeneratorBatches:
    """A Python generator's batches by index, the last ``keep`` kept: a restarted reader rereads them."""

    num_batches = None  # endless to the reader: a generator ends when it ends

    def __init__(self, generator: Any, keep: int = 256) -> None:
        self._generator, self._keep = generator, keep
        self._kept: dict[int, Any] = {}
        self._next = 0
        self._ended = False
        self._lock = threading.Lock()

    def __getitem__(self, i: int) -> Any:
        """Batch ``i``, or None past the generator's end."""
        with self._lock:
            while self._next <= i and not self._ended:  # None: the generator's end
                self._kept[self._next] = next(self._generator, None)
                self._ended = self._kept[self._next] is None
                self._kept.pop(self._next - self._keep, None)
                self._next += 1
            if i in self._kept or i >= self._next:
                return self._kept.get(i)
        msg = f"keras-sync was asked for batch {i} of a Python generator again after {self._next - i} newer ones; it keeps the last {self._keep}. Fix: give the data as a keras.utils.PyDataset or a tf.data.Dataset."
        raise UsageError(msg)


def python_batches(x: Any, method: str, kwargs: dict[str, Any]) -> GeneratorBatches | None:
    """``x`` as batches read by index (PyDataset, generator) or None; some generators are refused."""
    if is_py_dataset(x):
        return x
    if not isinstance(x, types.GeneratorType):  # what Keras's adapters test
        return None
    epochs = int(kwargs.get("epochs", 1))
    if method == "fit" and kwargs.get("steps_per_epoch") is None and epochs > 1:
        msg = f"sync.fit received a Python generator with epochs={kwargs.get('epochs')} and no steps_per_epoch: the first epoch would read it to its end. Fix: pass steps_per_epoch=<batches per epoch> (an endless generator), or give a keras.utils.PyDataset or a tf.data.Dataset."
        raise UsageError(msg)
    return GeneratorBatches(x)


def _standardize(batch: Any) -> Any:
    """A batch as Keras reads it: an array is ``(x,)``, a list a tuple."""
    import numpy as np

    if isinstance(batch, np.ndarray):
        return (batch,)
    return tuple(batch) if isinstance(batch, list) else batch


def py_dataset_batches(pyds: Any) -> tuple[Any, int, int | None]:
    """(a `tf.data.Dataset` of the batches read by index, the first batch's size, examples per epoch)."""
    import numpy as np
    import tensorflow as tf

    try:
        n = pyds.num_batches
    except NotImplementedError:
        msg = f"sync.fit received a keras.utils.PyDataset without a length ({type(pyds).__name__} has neither __len__ nor num_batches); keras-sync reads a PyDataset by index, each batch once per epoch. Fix: give it __len__, or a num_batches property (None for an endless one, with steps_per_epoch in fit)."
        raise UsageError(msg) from None
    generator = isinstance(pyds, GeneratorBatches)
    first = pyds[0] if n is None or n > 0 else None
    if first is None:
        what = "Python generator" if generator else f"keras.utils.PyDataset ({type(pyds).__name__})"
        msg = f"sync.fit received an empty {what}, 0 batches. Fix: give it at least one batch."
        raise UsageError(msg)
    first = _standardize(first)
    flat = [np.asarray(a) for a in tf.nest.flatten(first)]

    def read(i: Any) -> list[Any]:
        batch = pyds[int(i)]
        if batch is None:  # past a generator's end: a False flag and empty parts
            return [np.bool_(False)] + [np.zeros((0,) + a.shape[1:], a.dtype) for a in flat]
        return [np.bool_(True)] + [np.asarray(a) for a in tf.nest.flatten(_standardize(batch))]

    def load(i: Any) -> Any:
        ok, *parts = tf.py_function(read, [i], [tf.bool] + [tf.as_dtype(a.dtype) for a in flat])
        for part, a in zip(parts, flat):
            part.set_shape((None,) + a.shape[1:])
        return ok, tf.nest.pack_sequence_as(first, parts)

    workers = max(1, int(getattr(pyds, "workers", 1) or 1))
    indices = tf.data.Dataset.range(n) if n is not None else tf.data.Dataset.counter()
    ds = indices.map(load, num_parallel_calls=workers, deterministic=True)
    if generator:
        ds = ds.take_while(lambda ok, _: ok)
    size = int(np.shape(flat[0])[0])
    examples = None
    if n is not None:
        last = _standardize(pyds[n - 1]) if n > 1 else first
        examples = (n - 1) * size + int(np.shape(tf.nest.flatten(last)[0])[0])
    return ds.map(lambda _, batch: batch), size, examples
