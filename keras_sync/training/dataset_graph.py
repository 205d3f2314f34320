"""What a batched `tf.data` pipeline holds, read from its graph: its batch size, its examples per
pass, a ``shard`` op, the files it reads. `keras_sync.training.pipeline` decides from these."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from keras_sync.errors import UsageError
from keras_sync.upstream.tf_runtime import batch_fields, dataset_inputs, map_function

# The source ops TensorFlow's FILE auto-sharding looks for (tensorflow/core/grappler/optimizers/data/auto_shard.cc).
_READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")
_READER_OPS = {*_READERS, "TFRecordDatasetV2", "FixedLengthRecordDatasetV2", "ArrayRecordDataset"}
_READER_CLASSES = {f"{name}V{v}" for name in _READERS for v in (1, 2)}


def own_shard_policy(ds: Any) -> str:
    """The auto-shard policy in the dataset's own options, lower case (``auto`` when not set)."""
    policy = ds.options().experimental_distribute.auto_shard_policy
    return getattr(policy, "name", str(policy)).lower()


def with_policy(ds: Any, policy: str) -> Any:
    """``ds`` with the auto-shard ``policy`` (``auto``, ``data``, ``file``, ``off``) in its options."""
    import tensorflow as tf

    wanted = getattr(tf.data.experimental.AutoShardPolicy, policy.upper())
    if ds.options().experimental_distribute.auto_shard_policy == wanted:
        return ds
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = wanted
    return ds.with_options(options)


def _shapes(ds: Any) -> list[Any]:
    """The shape of every component of the dataset's elements (None: no shape)."""
    import tensorflow as tf

    return [getattr(spec, "shape", None) for spec in tf.nest.flatten(ds.element_spec)]


def _first_dims(ds: Any) -> set[Any]:
    return {s[0] for s in _shapes(ds) if s is not None and s.rank}


def refuse_unbatched(ds: Any) -> None:
    """A batch has a first dimension shared by every component; single examples often do not."""
    ranks = [None if s is None else s.rank for s in _shapes(ds)]
    firsts = _first_dims(ds)
    if 0 in ranks or (None not in firsts and len(firsts) > 1):
        msg = f"sync.fit received a tf.data.Dataset of single examples, not batches (element_spec={ds.element_spec}). Fix: pass it through sync.distribute(dataset), which batches by the global batch, or end it with .batch(n)."
        raise UsageError(msg)


def _batch_op(ds: Any) -> tuple[int | None, bool, Any] | None:
    """(size, drop_remainder, input) of the nearest batch op up the pipeline, through one-input steps."""
    for _ in range(200):
        if (fields := batch_fields(ds)) is not None:
            return fields
        inputs = dataset_inputs(ds)
        if len(inputs) != 1:
            return None
        ds = inputs[0]
    return None


def batch_size_of(ds: Any) -> tuple[int | None, str]:
    """(batch size, how found: static shape or the batch op up the pipeline), or (None, why not)."""
    from keras_sync.upstream.tf_runtime import pipeline_batch_size

    dims = _first_dims(ds)
    if len(dims) == 1 and None not in dims:
        return int(dims.pop()), "static shape"
    size = pipeline_batch_size(ds)
    if size is None and (op := _batch_op(ds)) is not None:
        size = op[0]
    if size is not None:
        return int(size), "its batch op"
    why = "no static batch dimension and no batch op, e.g. from_generator or Ray Data's to_tf"
    return None, why


def example_count(ds: Any, batch: int | None) -> int | None:
    """The examples in one pass of a dataset batched by ``batch``, when the pipeline tells them exactly."""
    batches = int(ds.cardinality())
    if batches < 0 or batch is None:
        return None
    if _first_dims(ds) == {batch}:
        return batches * batch  # every batch is full (static batch dimension)
    op = _batch_op(ds)
    if op is None or op[0] != batch or op[2] is None:
        return None
    examples = int(op[2].cardinality())
    if examples < 0:
        return None
    if op[1]:
        examples -= examples % batch
    # Only when nothing between the batch op and the end filtered or repeated batches.
    return examples if math.ceil(examples / batch) == batches else None


def _walk(ds: Any) -> Iterator[Any]:
    """Every dataset of the pipeline that ends in ``ds`` (each once), through all inputs (zip, concatenate)."""
    seen: set[int] = set()
    todo = [ds]
    while todo and len(seen) < 1000:
        d = todo.pop()
        if id(d) not in seen:
            seen.add(id(d))
            yield d
            todo.extend(dataset_inputs(d))


def has_shard_op(ds: Any) -> bool:
    """Whether the pipeline contains a ``shard`` op (the user split the data across workers)."""
    return any(type(d).__name__ in ("_ShardDataset", "ShardDataset") for d in _walk(ds))


def file_count(ds: Any) -> int | None:
    """The fewest files a reader (or interleave/flat_map making one) of the pipeline reads, or None."""
    counts = []
    for d in _walk(ds):
        if type(d).__name__ in _READER_CLASSES or _function_reads_files(d):
            if not (inputs := dataset_inputs(d)):
                continue
            names = inputs[0]
            n = int(names.cardinality())
            if n == -2:  # unknown (e.g. filtered names): count them, file names only
                n = int(names.reduce(0, lambda c, _: c + 1))
            if n >= 0:
                counts.append(n)
    return min(counts) if counts else None


def _function_reads_files(ds: Any) -> bool:
    func = map_function(ds)
    if func is None:
        return False
    graph = func.graph.as_graph_def()
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    return bool(ops & _READER_OPS)
