"""The run-time check ``add_loss``: an `add_loss` term that sums over the batch, on several replicas.

Keras divides each `model.losses` term by the replica count, like the main loss: right for a
term that does not grow with the batch (a mean, a weight penalty). A term that sums over the
batch (``add_loss(rate * ops.sum(x))``) is already one share of one device's sum on each
replica, so divided again it counts 1/N of one device's.

The graph does not tell which a term is, so it is measured once per `fit`, before the first
step: the terms are evaluated (`Layer.stateless_call`, inference mode) on a few examples of the
first batch and on the N equal shares the replicas would get. A term whose value on the whole is
the sum of its values on the shares, not their mean, sums over the batch; the check says so in
one line (`keras_sync.training.run_checks`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("keras_sync")

#: Examples per share evaluated (the check needs equal shares, not a full batch).
PER_SHARE = 2


def sums_over_batch(whole: float, shares: list[float]) -> bool:
    """Whether a term's value on a set of examples is the sum of its values on the set's equal shares.

    >>> sums_over_batch(10.0, [4.0, 6.0])       # rate * ops.sum(x)
    True
    >>> sums_over_batch(5.0, [4.0, 6.0])        # ops.mean(x): the mean of the shares' means
    False
    >>> sums_over_batch(3.0, [3.0, 3.0]), sums_over_batch(0.0, [0.0, 0.0])  # a weight penalty; nothing
    (False, False)
    """
    size = abs(whole) + sum(abs(s) for s in shares)
    if size == 0.0:
        return False
    total, mean = sum(shares), sum(shares) / len(shares)
    return abs(whole - total) <= 1e-2 * size and abs(whole - mean) > 0.1 * size


def message(found: list[int], terms: int, n: int, global_batch: int) -> str:
    """The check's line (after ``check add_loss failed: ``) for the terms ``found`` (0-based)."""
    which = ", ".join(str(i + 1) for i in found)
    return (
        f"add_loss term {which} of {terms} (in the order of model.losses) sums over the batch (its value on "
        f"{PER_SHARE * n} examples is the sum, not the mean, of its values on the {n} replicas' shares), and each "
        f"replica's add_loss terms are divided by the replica count (Keras's compute_loss; right for a mean or a "
        f"weight penalty): on {n} replicas it counts 1/{n} of one device's. Fix: write it as a mean times the "
        f"global batch, e.g. add_loss(rate * {global_batch} * ops.mean(ops.sum(x, axis=-1))), which equals one "
        "device"
    )


def sample(x: Any, rows: int) -> Any:
    """The first ``rows`` inputs of ``fit``'s ``x`` (arrays, or a batched dataset's first batch);
    None for other inputs (a `PyDataset`, a distributed dataset: not read twice)."""
    import tensorflow as tf

    if x is None:
        return None
    if isinstance(x, tf.data.Dataset):
        try:
            element = next(iter(x.take(1)))
        except (StopIteration, tf.errors.OpError):
            return None
        if isinstance(element, tuple):  # (x, y[, sample_weight])
            element = element[0]
    elif (
        hasattr(x, "__getitem__")
        and not hasattr(x, "shape")
        and not isinstance(x, (list, tuple, dict))
    ):
        return None  # a PyDataset / Sequence
    else:
        element = x
    leaves = tf.nest.flatten(element)
    if not leaves or any(
        len(getattr(leaf, "shape", ())) == 0 or leaf.shape[0] is None or leaf.shape[0] < rows
        for leaf in leaves
    ):
        return None
    return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[:rows]), element)


def term_values(model: Any, x: Any) -> list[float]:
    """Each `model.losses` term (summed to a scalar, as Keras does) of a side-effect-free call on ``x``."""
    import keras

    ops = keras.ops
    kwargs = {"training": False} if "training" in inspect.signature(model.call).parameters else {}
    trainable = [ops.convert_to_tensor(v) for v in model.trainable_variables]
    non_trainable = [ops.convert_to_tensor(v) for v in model.non_trainable_variables]
    _, _, losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
    return [float(ops.convert_to_numpy(ops.sum(ops.cast(term, "float32")))) for term in losses]


def _zeros(dataset: Any, rows: int) -> Any:
    """Zeros shaped as ``rows`` inputs of a batched dataset's elements (None: a shape not known)."""
    import tensorflow as tf

    spec = dataset.element_spec
    if isinstance(spec, tuple):
        spec = spec[0]
    leaves = tf.nest.flatten(spec)
    if not leaves or any(
        not isinstance(s, tf.TensorSpec)
        or s.shape.rank is None
        or s.shape.rank == 0
        or None in s.shape[1:]
        for s in leaves
    ):
        return None
    return tf.nest.map_structure(lambda s: tf.zeros([rows, *s.shape[1:]], s.dtype), spec)


def problem(model: Any, data: Any, n: int, global_batch: int) -> str | None:
    """The check's finding for ``model`` on ``fit``'s ``data`` over ``n`` replicas; None: nothing
    to say. A dataset is read only when a call on zeros shows `add_loss` terms."""
    import tensorflow as tf

    if n <= 1 or data is None or not getattr(model, "built", False):
        return None
    per = PER_SHARE
    try:
        if isinstance(data, tf.data.Dataset):
            zeros = _zeros(data, per * n)
            if zeros is not None and not term_values(model, zeros):
                return None  # no add_loss term: the data is not read
        x = sample(data, per * n)
        if x is None:
            return None
        whole = term_values(model, x)
        if not whole:
            return None
        shares = [
            term_values(model, tf.nest.map_structure(lambda a, r=r: a[r * per : (r + 1) * per], x))
            for r in range(n)
        ]
    except Exception as exc:  # a check: a model it cannot call this way is not judged
        log.debug("keras-sync: check add_loss skipped: %s: %s", type(exc).__name__, exc)
        return None
    if any(len(s) != len(whole) for s in shares):
        return None  # terms that depend on the batch's size: not comparable
    found = [i for i, value in enumerate(whole) if sums_over_batch(value, [s[i] for s in shares])]
    return message(found, len(whole), n, global_batch) if found else None
