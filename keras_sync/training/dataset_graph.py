"""What a `tf.data` pipeline is made of, read from its graph: a ``shard`` op, the files it reads
(`keras_sync.training.pipeline` decides sharding from these)."""

from __future__ import annotations

from typing import Any


def _walk(ds: Any) -> Any:
    """Every dataset of the pipeline that ends in ``ds`` (each once), through all inputs (zip, concatenate)."""
    seen: set[int] = set()
    todo = [ds]
    while todo and len(seen) < 1000:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        yield d
        try:
            todo.extend(d._inputs())
        except (AttributeError, NotImplementedError):
            pass


def has_shard_op(ds: Any) -> bool:
    """Whether the pipeline contains a ``shard`` op (the user split the data across workers)."""
    return any(type(d).__name__ in ("_ShardDataset", "ShardDataset") for d in _walk(ds))


# The source ops TensorFlow's FILE auto-sharding looks for (tensorflow/core/grappler/optimizers/data/auto_shard.cc).
_READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")
_READER_OPS = frozenset(
    {*_READERS, "TFRecordDatasetV2", "FixedLengthRecordDatasetV2", "ArrayRecordDataset"}
)
_READER_CLASSES = frozenset(f"{name}V{v}" for name in _READERS for v in (1, 2))


def file_count(ds: Any) -> int | None:
    """The number of files the pipeline reads (the fewest, if it reads several sets); None: none.

    A reader made from file names, or an ``interleave``/``flat_map`` whose function makes one:
    the files are the elements of its input dataset, counted from its cardinality (or read).
    """
    counts = []
    for d in _walk(ds):
        if type(d).__name__ in _READER_CLASSES or _function_reads_files(d):
            try:
                names = d._inputs()[0]
            except (AttributeError, IndexError, NotImplementedError):
                continue
            n = int(names.cardinality())
            if n == -2:  # unknown (e.g. filtered names): count them, file names only
                n = int(names.reduce(0, lambda c, _: c + 1))
            if n >= 0:
                counts.append(n)
    return min(counts) if counts else None


def _function_reads_files(ds: Any) -> bool:
    func = getattr(getattr(ds, "_map_func", None), "function", None)
    if func is None:
        return False
    try:
        graph = func.graph.as_graph_def()
    except Exception:
        return False
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    return bool(ops & _READER_OPS)
