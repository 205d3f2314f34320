"""The input pipeline behind `Sync.fit` and `Sync.distribute`: batching, sharding (decided by the
data, never by the host), validation split. A batched dataset is rebatched to the global batch; a
worker's own part is read per replica as that worker's input."""

from __future__ import annotations

import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from keras_sync.errors import UsageError
from keras_sync.training import dataset_graph as graph
from keras_sync.training import py_dataset


@dataclass(frozen=True)
class ShardChoice:
    """The shard policy one input gets (``auto``, ``data``, ``file`` or ``off``) and why."""

    policy: str
    reason: str


def shard_choice(
    kind: Literal["arrays", "dataset"], *, configured: str, own: str | None = None
) -> ShardChoice:
    """The shard policy of ``"arrays"`` or a ``"dataset"`` (its own unless auto), and why."""
    if kind == "arrays" and configured == "off":
        return ShardChoice("off", "batch.shard_policy: off (each worker's arrays are its own part)")
    if kind == "arrays":
        extra = "; batch.shard_policy: file needs files, arrays have none" * (configured == "file")
        return ShardChoice("data", f"arrays are split across workers by example{extra}")
    if own is not None and own != "auto":
        ray = ", as Ray Data and prepare_dataset_shard do: it is already this worker's shard"
        return ShardChoice(own, f"set in the dataset's own options{ray * (own == 'off')}")
    auto = ", by file when the pipeline reads at least as many files as there are workers, else by example"
    return ShardChoice(
        configured, f"batch.shard_policy: {configured}{auto * (configured == 'auto')}"
    )


def batch_layout(global_batch: int, num_replicas: int, num_workers: int) -> str:
    """How one training step's global batch divides over workers and replicas.

    >>> batch_layout(32, 2, 1)
    'global batch 32 = 16 per replica x 2 replicas'
    >>> batch_layout(32, 4, 2)
    'global batch 32 = 16 per worker x 2 workers = 8 per replica x 4 replicas'
    """
    per_replica = f"{global_batch // num_replicas} per replica x {num_replicas} replica{'s' * (num_replicas > 1)}"
    if num_workers <= 1:
        return f"global batch {global_batch} = {per_replica}"
    return f"global batch {global_batch} = {global_batch // num_workers} per worker x {num_workers} workers = {per_replica}"


@dataclass(frozen=True)
class InputFacts:
    """What the pipeline did with one `fit`'s training data (``Sync.input_facts``)."""

    source: str
    shard_policy: str
    own_part: bool = False
    examples_per_epoch: int | None = None
    worker_examples_per_epoch: int | None = None
    steps_per_epoch: int | None = None


def _steps(examples: int | None, batch: int, drop_remainder: bool) -> int | None:
    if examples is None:
        return None
    return examples // batch if drop_remainder else math.ceil(examples / batch)


@dataclass(eq=False)
class InputPipeline:
    """Turns what a user passes to `fit`/`distribute` into what the strategy trains on."""

    global_batch: int
    num_replicas: int
    num_workers: int
    is_chief: bool
    drop_remainder: bool
    shard_policy: str
    multi_worker: bool
    replay_order: bool
    strategy: Any = None
    arrays_as_dataset: bool = False
    #: What the last `prepare(method="fit", ...)` did with the training data (None before).
    facts: InputFacts | None = field(default=None, init=False)

    def distribute(
        self, data: Any, *, shuffle: bool = False, seed: int = 1337
    ) -> tuple[Any, int | None]:
        """(dataset batched by the global batch, steps per epoch or None) from arrays or examples."""
        ds = self._batched(tuple(data) if isinstance(data, list) else data, shuffle, seed=seed)
        steps = int(ds.cardinality())
        return ds, steps if steps > 0 else None

    def prepare(
        self, method: str, x: Any, y: Any, kwargs: dict[str, Any], global_batch: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        """(x, y, kwargs) for ``model.<method>``: arrays batched by ``global_batch``, datasets reconciled."""
        fit = method == "fit"
        if fit:
            kwargs = _validation_input(kwargs)
        batches = py_dataset.python_batches(x, method, kwargs)
        if batches is not None:
            ds, size, examples = py_dataset.py_dataset_batches(batches)
            if not fit:
                return ds, y, kwargs  # evaluate/predict: its batches as given, each read once
            if batches is x:  # a PyDataset: its epoch hooks, as Keras's own reader calls them
                import keras

                hooks = keras.callbacks.LambdaCallback(
                    on_epoch_begin=lambda *_: batches.on_epoch_begin(),
                    on_epoch_end=lambda *_: batches.on_epoch_end(),
                )
                kwargs["callbacks"] = [hooks, *(kwargs.get("callbacks") or [])]
            source = "keras.utils.PyDataset" if batches is x else "Python generator"
            x = self.training_dataset(ds, size=size, examples=examples, source=source)
        elif is_dataset(x):
            x = self.training_dataset(x) if fit else x
        else:
            from keras_sync.upstream.tf_runtime import global_seed_set

            # A seeded script's own Keras shuffle of arrays draws the same order again after a resume.
            replay = self.replay_order and not global_seed_set()
            if self.multi_worker or fit and (self.arrays_as_dataset or replay):
                return self._arrays_to_dataset(fit, x, y, kwargs, global_batch)
            kwargs["batch_size"] = global_batch
            if fit:
                n = _array_examples(x, kwargs.get("validation_split"))
                steps = _steps(n, global_batch, False)
                self.facts = InputFacts("arrays", "data", False, n, None, steps)
            return x, y, kwargs
        if fit:  # Keras ignores `shuffle` for datasets but warns about its default True every fit
            kwargs.setdefault("shuffle", False)
        return x, y, kwargs

    def training_dataset(
        self,
        ds: Any,
        *,
        size: int | None = None,
        examples: int | None = None,
        source: str = "tf.data.Dataset",
        policy: str | None = None,
    ) -> Any:
        """A batched dataset for `fit`: policy settled, rebatched; an own part read per replica."""
        import tensorflow as tf

        if not isinstance(ds, tf.data.Dataset):  # distributed by the user already
            self.facts = InputFacts("distributed dataset", "as given")
            return ds
        graph.refuse_unbatched(ds)
        policy = policy or self._policy(ds)
        own_part = self.num_workers > 1 and (policy == "off" or graph.has_shard_op(ds))
        policy = "off" if own_part else policy
        size, how = graph.batch_size_of(ds) if size is None else (size, "given")
        examples = graph.example_count(ds, size) if examples is None else examples
        gb, workers = self.global_batch, self.num_workers
        # An own part is read per replica: each worker trains global/workers of it per step.
        target = gb // self.num_replicas if own_part else gb
        rebatched = size != gb or own_part
        if rebatched:
            ds = ds.rebatch(target, drop_remainder=self.drop_remainder)
            steps = _steps(examples, target, self.drop_remainder)
            if steps is not None:  # a known length: progress bar, warmup in epochs
                ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
            if size is None and self.is_chief:
                msg = f"keras-sync: cannot tell the batch size of the dataset given to sync.fit ({how}); it was rebatched to the configured global batch {gb}. Fix: if its elements are single examples, pass it through sync.distribute(...), else end it with .rebatch({gb}, drop_remainder=True)."
                warnings.warn(msg, UserWarning, stacklevel=4)
        ds = graph.with_policy(ds, policy)
        if not own_part:
            trained = share = examples
            if examples is not None and rebatched and self.drop_remainder:
                trained = examples - examples % gb
            if workers > 1:  # this worker's share, when the split is even
                even = examples is not None and examples % (workers * gb) == 0
                share = examples // workers if examples is not None and even else None
            steps = _steps(examples, gb, self.drop_remainder)
            self.facts = InputFacts(source, policy, False, trained, share, steps)
            return ds
        batches = int(ds.cardinality())
        per_worker = self._across_workers(batches, -1 if examples is None else examples)
        same = batches >= 0 and len({b for b, _ in per_worker}) == 1
        # Each part drops its own remainder: the job's count is then not known here.
        known = all(e >= 0 for _, e in per_worker) and not self.drop_remainder
        per_replica = self.num_replicas // workers
        total = sum(e for _, e in per_worker) if known else None
        steps = batches // per_replica if same else None
        self.facts = InputFacts(source, "off", True, total, examples, steps)
        if batches >= 0 and (not same or per_replica > 1):
            # A known length is every worker's steps to Keras (parts of different lengths would
            # hang a collective; per replica it counts batches): unknown, all parts end together.
            ds = ds.filter(lambda *_: True)
        return self.strategy.distribute_datasets_from_function(lambda _: ds)

    def _across_workers(self, batches: int, examples: int) -> list[tuple[int, int]]:
        """(batches, examples) of every worker's part, in worker order: one all-gather."""
        import tensorflow as tf

        strategy = self.strategy

        @tf.function(autograph=False)  # eager, MultiWorkerMirroredStrategy.run warns of overhead
        def gather() -> Any:
            value = strategy.run(lambda: tf.constant([[batches, examples]], tf.int64))
            return strategy.gather(value, axis=0)

        values = gather().numpy().tolist()
        return [tuple(v) for v in values[:: self.num_replicas // self.num_workers]]

    def _arrays_to_dataset(
        self, fit: bool, x: Any, y: Any, kwargs: dict[str, Any], global_batch: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        import tensorflow as tf

        parts = tuple(p for p in (x, y, kwargs.pop("sample_weight", None)) if p is not None)
        n = len(tf.nest.flatten(parts)[0])
        shuffle = kwargs.pop("shuffle", True) if fit else False
        split = kwargs.pop("validation_split", 0.0) if fit else 0.0
        if split and kwargs.get("validation_data") is None:
            # Keras's rule: the last `split` fraction of the arrays, before shuffling.
            n = int(n * (1.0 - split))
            kwargs["validation_data"] = tf.nest.map_structure(lambda t: t[n:], parts)
            parts = tf.nest.map_structure(lambda t: t[:n], parts)
        vd = kwargs.get("validation_data")
        if isinstance(vd, tuple) and not is_dataset(vd[0]):
            kwargs["validation_data"] = self._batched(
                vd if len(vd) > 1 else vd[0], False, global_batch
            )
        ds = self._batched(parts if len(parts) > 1 else parts[0], shuffle, global_batch)
        if not fit:
            return ds, None, kwargs
        kwargs["shuffle"] = False  # shuffled here, with one seed for all workers
        policy = self._policy(None)
        if policy == "off" and self.num_workers > 1 and global_batch == self.global_batch:
            # Each worker's arrays are its own part: read per replica, not sharded, steps from its own length.
            ds = self.training_dataset(
                ds, size=global_batch, examples=n, source="arrays", policy=policy
            )
            return ds, None, kwargs
        trained = n - n % global_batch if self.drop_remainder else n
        steps = _steps(n, global_batch, self.drop_remainder)
        self.facts = InputFacts("arrays", policy, examples_per_epoch=trained, steps_per_epoch=steps)
        return ds, None, kwargs

    def _batched(
        self, data: Any, shuffle: bool, global_batch: int | None = None, seed: int = 1337
    ) -> Any:
        """Arrays or single examples, shuffled (one seed for all workers), batched, policy set."""
        import tensorflow as tf

        own = isinstance(data, tf.data.Dataset)
        ds = data if own else tf.data.Dataset.from_tensor_slices(data)
        policy = self._policy(ds if own else None)
        if shuffle:
            n = int(ds.cardinality())
            ds = ds.shuffle(n if n > 0 else 10_000, seed=seed, reshuffle_each_iteration=True)
        batched = ds.batch(global_batch or self.global_batch, drop_remainder=self.drop_remainder)
        return graph.with_policy(batched, policy)

    def _policy(self, ds: Any | None) -> str:
        """The shard policy of arrays (None) or a dataset; auto/file settled by the files read."""
        if ds is None:
            return shard_choice("arrays", configured=self.shard_policy).policy
        own = graph.own_shard_policy(ds)
        policy = shard_choice("dataset", configured=self.shard_policy, own=own).policy
        if self.num_workers <= 1 or policy not in ("auto", "file"):
            return policy
        files = graph.file_count(ds)
        return "file" if files is not None and files >= self.num_workers else "data"


def is_dataset(x: Any) -> bool:
    """Whether ``x`` is a `tf.data.Dataset` or a distributed dataset (not arrays)."""
    return hasattr(x, "element_spec")


def _array_examples(x: Any, validation_split: float | None) -> int | None:
    import tensorflow as tf

    try:
        n = len(tf.nest.flatten(x)[0])
    except TypeError:
        return None
    return int(n * (1.0 - validation_split)) if validation_split else n


def _validation_input(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``validation_data`` read as the training data is: a PyDataset by index; a generator refused."""
    vd = kwargs.get("validation_data")
    if py_dataset.is_py_dataset(vd):
        return dict(kwargs, validation_data=py_dataset.py_dataset_batches(vd)[0])
    if isinstance(vd, types.GeneratorType):
        msg = "sync.fit received validation_data as a Python generator: each epoch would validate on other data. Fix: give validation_data as arrays, a keras.utils.PyDataset or a tf.data.Dataset."
        raise UsageError(msg)
    return kwargs
