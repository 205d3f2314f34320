"""The input pipeline behind `Sync.fit` and `Sync.distribute`: batching, sharding, validation split.

The rules (the README's "Input data" section says the same):

* **Sharding is decided by the data, not by the host.** Arrays are split across workers by
  example (``data``) unless ``batch.shard_policy: off``. A `tf.data.Dataset` whose own options set
  a policy other than ``AUTO`` keeps it (Ray Data and Ray's `prepare_dataset_shard` set ``OFF``:
  the shard is already this worker's); any other dataset gets ``batch.shard_policy``.
* **The global batch is the configured one.** A batched dataset whose batch is not the
  configured global batch, or cannot be read, is rebatched to it (same examples, same order), so
  the scaled learning rate matches the batch trained on.
* **Files decide before training.** Under several workers ``auto`` (or ``file``) becomes ``file``
  when the pipeline reads at least as many files as workers, else ``data`` (TensorFlow's FILE
  sharding would fail at the first step).
* **A worker's own part** (a ``shard`` op, ``OFF`` in its options, ``batch.shard_policy: off``)
  is, under several workers, rebatched per replica and given to the strategy as this worker's
  input: never sharded again, its steps counted from its own length.
* **A `keras.utils.PyDataset`** is read by index, each batch once per epoch, then handled as a
  batched dataset.

Pure helpers (`shard_choice`, `batch_layout`) need no TensorFlow; `keras-sync plan` uses them.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from keras_sync.errors import UsageError
from keras_sync.training.dataset_graph import file_count, has_shard_op
from keras_sync.training.py_dataset import (
    PyDatasetEpochs,
    generator_batches,
    generator_source,
    is_generator,
    is_py_dataset,
    py_dataset_batches,
    py_dataset_source,
)

log = logging.getLogger("keras_sync")


@dataclass(frozen=True)
class ShardChoice:
    """The shard policy one input gets (``auto``, ``data``, ``file`` or ``off``) and why."""

    policy: str
    reason: str


def shard_choice(
    kind: Literal["arrays", "dataset"], *, configured: str, own: str | None = None
) -> ShardChoice:
    """The shard policy of an input: decided by the data and the config, never by the host.

    Args:
        kind: ``"arrays"`` (numpy arrays, batched by keras-sync) or ``"dataset"`` (a `tf.data.Dataset`).
        configured: ``batch.shard_policy``.
        own: the policy set in the dataset's own options (lower case), None for arrays.

    >>> shard_choice("arrays", configured="auto").policy
    'data'
    >>> shard_choice("dataset", configured="auto", own="off").reason
    "set in the dataset's own options, as Ray Data and prepare_dataset_shard do: it is already this worker's shard"
    >>> shard_choice("dataset", configured="file", own="auto").policy
    'file'
    """
    if kind == "arrays":
        if configured == "off":
            return ShardChoice(
                "off", "batch.shard_policy: off (each worker's arrays are its own part)"
            )
        extra = (
            "; batch.shard_policy: file needs files, arrays have none"
            if configured == "file"
            else ""
        )
        return ShardChoice("data", f"arrays are split across workers by example{extra}")
    if own is not None and own != "auto":
        ray = (
            ", as Ray Data and prepare_dataset_shard do: it is already this worker's shard"
            if own == "off"
            else ""
        )
        return ShardChoice(own, f"set in the dataset's own options{ray}")
    if configured == "auto":
        return ShardChoice(
            "auto",
            "batch.shard_policy: auto, by file when the pipeline reads at least as many files "
            "as there are workers, else by example",
        )
    return ShardChoice(configured, f"batch.shard_policy: {configured}")


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
    """What the pipeline did with the training data of one `fit` (``Sync.input_facts``), for run-time checks.

    Attributes:
        source: ``arrays``, ``tf.data.Dataset``, ``keras.utils.PyDataset`` or ``distributed dataset``.
        shard_policy: the policy TensorFlow applies across workers (``data``, ``file``, ``off``);
            ``off`` with ``own_part`` means each worker trains its own part.
        own_part: each worker's data is its own part (a ``shard`` op, ``OFF`` in its options,
            ``batch.shard_policy: off``), distributed by keras-sync without sharding.
        examples_per_epoch: the examples the job trains per epoch (all workers), when known.
        worker_examples_per_epoch: this worker's examples per epoch, when known (its part, or
            its share of a split input when the split is even).
        steps_per_epoch: optimizer steps per epoch when known (before gradient accumulation).
    """

    source: str
    shard_policy: str
    own_part: bool = False
    examples_per_epoch: int | None = None
    worker_examples_per_epoch: int | None = None
    steps_per_epoch: int | None = None


@dataclass(eq=False)
class InputPipeline:
    """Turns what a user passes to `fit`/`distribute` into what the strategy trains on.

    Attributes: the session facts it needs: global batch, replica and worker counts, whether
    this process is the chief, ``drop_remainder`` and ``shard_policy`` from the config, the scaled
    learning rate (for the messages), and when arrays must become a dataset: always under
    `multi_worker_mirrored` (Keras requires it), and for `fit` with a backup in a script that set
    no TensorFlow seed (its seeded shuffle lets a resumed job replay the order; see `tf_seed_set`);
    the strategy (a worker's own part becomes its input).
    """

    global_batch: int
    num_replicas: int
    num_workers: int
    is_chief: bool
    drop_remainder: bool
    shard_policy: str
    multi_worker: bool
    replay_order: bool
    learning_rate: float = 0.0
    strategy: Any = None
    #: Arrays become a dataset as under `multi_worker_mirrored`: a `keras-sync verify` reference of a
    #: multi-worker recording trains the batches in its order (`keras_sync.training.verify_record`).
    arrays_as_dataset: bool = False
    #: What the last `prepare(method="fit", ...)` did with the training data (None before).
    facts: InputFacts | None = field(default=None, init=False)

    # -- sync.distribute ---------------------------------------------------------------------

    def distribute(
        self, data: Any, *, shuffle: bool = False, seed: int = 1337
    ) -> tuple[Any, int | None]:
        """(dataset batched by the global batch, steps per epoch or None) from arrays or examples."""
        import tensorflow as tf

        is_dataset = isinstance(data, tf.data.Dataset)
        if is_dataset:
            ds = data
        else:
            ds = tf.data.Dataset.from_tensor_slices(tuple(data) if isinstance(data, list) else data)
        n = int(ds.cardinality())
        steps = _steps(n, self.global_batch, self.drop_remainder) if n > 0 else None
        choice = self._choice(ds if is_dataset else None)
        return self._batched(
            ds, self.global_batch, shuffle=shuffle, seed=seed, choice=choice
        ), steps

    # -- sync.fit / evaluate / predict -------------------------------------------------------

    def prepare(
        self, method: str, x: Any, y: Any, kwargs: dict[str, Any], global_batch: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        """(x, y, kwargs) for ``model.<method>``: arrays batched by ``global_batch``, datasets reconciled."""
        if method == "fit":
            kwargs = _validation_input(kwargs)
        described = None
        if is_generator(x):
            described = generator_source(kwargs.get("steps_per_epoch"))
            x = generator_batches(x, method, kwargs)
        if is_py_dataset(x) or described:
            ds, found, examples = py_dataset_batches(x)
            if method == "fit":
                kwargs.setdefault("shuffle", False)
                kwargs["callbacks"] = [PyDatasetEpochs(x)] + list(kwargs.get("callbacks") or [])
                source = "Python generator" if described else "keras.utils.PyDataset"
                x = self.training_dataset(
                    ds,
                    found=(found, "its first batch"),
                    examples=examples,
                    source=source,
                    described=described or py_dataset_source(x, x.num_batches),
                )
            else:
                x = ds  # evaluate/predict: its batches as given, each read once
            return x, y, kwargs
        if is_dataset(x):
            if method == "fit":
                # Keras ignores `shuffle` for datasets but warns about its default True on every fit.
                kwargs.setdefault("shuffle", False)
                x = self.training_dataset(x)
            return x, y, kwargs
        if not (
            self.multi_worker
            or (
                method == "fit"
                and (self.arrays_as_dataset or self.replay_order and not tf_seed_set())
            )
        ):
            kwargs["batch_size"] = global_batch
            if method == "fit":
                n = _array_examples(x, kwargs.get("validation_split"))
                self.facts = InputFacts(
                    "arrays",
                    "data",
                    examples_per_epoch=n,
                    steps_per_epoch=_steps(n, global_batch, False),
                )
                self._say(
                    f"keras-sync: training data: arrays, batched by keras-sync; "
                    f"{batch_layout(global_batch, self.num_replicas, self.num_workers)}",
                    loud=False,
                )
            return x, y, kwargs
        return self._arrays_to_dataset(method, x, y, kwargs, global_batch)

    def training_dataset(
        self,
        ds: Any,
        *,
        found: tuple[int | None, str] | None = None,
        examples: int | None = None,
        source: str = "tf.data.Dataset",
        described: str | None = None,
        choice: ShardChoice | None = None,
    ) -> Any:
        """A batched dataset given to `fit`: its shard policy settled, rebatched to the global batch.

        A dataset that is already each worker's own part (a ``shard`` op in the pipeline, ``OFF``
        in its options, ``batch.shard_policy: off``) is, on several workers, given to the strategy
        as each worker's input (`distribute_datasets_from_function`, per-replica batches): TensorFlow
        neither shards it again nor counts its steps from a global batch it does not hold.
        """
        import tensorflow as tf

        # a DistributedDataset: the user distributed it already
        if not isinstance(ds, tf.data.Dataset):
            self.facts = InputFacts("distributed dataset", "as given")
            self._say(
                "keras-sync: training data: an already distributed dataset, used as given",
                loud=False,
            )
            return ds
        _refuse_unbatched(ds)
        choice = choice or self._choice(ds)
        shard_op = has_shard_op(ds)
        own_part = self.num_workers > 1 and (choice.policy == "off" or shard_op)
        if own_part and choice.policy != "off":
            choice = ShardChoice(
                "off", "a shard op in the pipeline: it is already this worker's part"
            )
        found_size, how = found if found is not None else batch_size_of(ds)
        if examples is None:
            examples = _example_count(ds, found_size)
        # Under several workers an own part is read per replica: each worker trains global/workers of it per step.
        target = self.global_batch // self.num_replicas if own_part else self.global_batch
        loud = self.num_workers > 1
        if found_size == self.global_batch and not own_part:
            note = f"batched by {found_size} ({how}) = the global batch"
        else:
            ds, loud = _rebatch(ds, target, found_size, self.drop_remainder, examples), True
            was = (
                f"batched by {found_size} ({how})" if found_size else f"batch size unknown ({how})"
            )
            to = (
                f"rebatched to {target} per replica, its worker's share of the global batch {self.global_batch}"
                if own_part
                else f"rebatched to the global batch {self.global_batch}"
            )
            note = f"{was}, {to}; the learning rate {self.learning_rate:g} is scaled for {self.global_batch}"
            if found_size is None and self.is_chief:
                warnings.warn(
                    f"keras-sync: cannot tell the batch size of the dataset given to sync.fit ({how}); it was "
                    f"rebatched to the configured global batch {self.global_batch}, so each step trains on "
                    f"{self.global_batch} examples. If its elements are single examples rather than batches, "
                    "pass it through sync.distribute(...) instead. To silence this, end the pipeline with "
                    f".rebatch({self.global_batch}, drop_remainder=True), or give it a fixed batch dimension.",
                    UserWarning,
                    stacklevel=4,
                )
        ds = _with_policy(ds, choice)
        workers = self.num_workers
        if own_part:
            part = f"; each worker trains {self.global_batch // workers} examples of its own part per step"
            batches = int(ds.cardinality())
            per_worker = self._across_workers(batches, -1 if examples is None else examples)
            steps = batches // (self.num_replicas // workers) if batches >= 0 else None
            same = len({b for b, _ in per_worker}) == 1 and batches >= 0
            if batches >= 0 and not same:
                part += (
                    f"; the parts differ in length ({', '.join(str(b) for b, _ in per_worker)} batches of "
                    f"{target}): each epoch ends when every worker's part has"
                )
                steps = None
            job = sum(e for _, e in per_worker) if all(e >= 0 for _, e in per_worker) else None
            self.facts = InputFacts(
                source,
                "off",
                own_part=True,
                examples_per_epoch=job,
                worker_examples_per_epoch=examples,
                steps_per_epoch=steps,
            )
            ds = self._per_worker(ds, known_steps=same)
        else:
            part = ""
            steps = _steps(examples, self.global_batch, self.drop_remainder)
            share = (
                examples // workers
                if examples is not None and examples % (workers * self.global_batch) == 0
                else None
            )
            self.facts = InputFacts(
                source,
                choice.policy,
                examples_per_epoch=examples,
                worker_examples_per_epoch=share if workers > 1 else examples,
                steps_per_epoch=steps,
            )
        self._say(
            f"keras-sync: training data: {described or source} {note}; shard policy {choice.policy} ({choice.reason}){part}; "
            f"{batch_layout(self.global_batch, self.num_replicas, self.num_workers)}",
            loud=loud,
        )
        return ds

    def expected_examples(
        self, facts: InputFacts | None, x: Any, kwargs: dict[str, Any], global_batch: int
    ) -> int | None:
        """The examples one epoch of `fit` trains over all workers, when known before training.

        ``facts``: what `prepare` found (a worker's own part is summed over the workers there; a
        PyDataset counted by its batches). Otherwise arrays count their length (less a
        ``validation_split``) and a `tf.data.Dataset` its examples when its pipeline tells them.
        None when unknown, and with ``steps_per_epoch`` (an epoch is then that many steps). With
        ``drop_remainder`` the last partial global batch is not counted; an own part drops its
        remainder per worker, so its count is then unknown.
        """
        if kwargs.get("steps_per_epoch") is not None or x is None:
            return None
        drops = self.drop_remainder and (self.multi_worker or self.replay_order or is_dataset(x))
        if facts is not None and (facts.own_part or facts.source == "keras.utils.PyDataset"):
            n = facts.examples_per_epoch
            if n is None or (drops and facts.own_part):
                return None
            return n - n % global_batch if drops else n
        import tensorflow as tf

        if is_dataset(x):
            if not isinstance(x, tf.data.Dataset):
                return None
            found, _ = batch_size_of(x)
            n = _example_count(x, found)
            if n is None:
                return None
            if found != global_batch and drops:
                n -= n % global_batch
            if self.num_workers > 1 and own_shard_policy(x) == "off":
                return sum(e for _, e in self._across_workers(0, n))  # each worker's own part
            return n
        if (
            hasattr(x, "__getitem__")
            and not isinstance(x, (list, tuple, dict))
            and not hasattr(x, "shape")
        ):
            return None  # a PyDataset / Sequence: its length is in batches, not examples
        try:
            n = len(tf.nest.flatten(x)[0])
        except TypeError:
            return None
        split = kwargs.get("validation_split")
        if split and kwargs.get("validation_data") is None:
            n = int(n * (1.0 - split))
        return n - n % global_batch if drops else n

    def _per_worker(self, ds: Any, *, known_steps: bool) -> Any:
        """This worker's own part, batched per replica, as the strategy's input on this worker."""
        if int(ds.cardinality()) >= 0 and (
            not known_steps or self.num_replicas // self.num_workers > 1
        ):
            # Keras takes a known length as the steps of every worker: parts of different lengths would
            # leave one worker waiting in a collective for the others, and with several replicas per
            # worker Keras would count per-replica batches. Unknown, the epoch ends when every part has
            # (TensorFlow agrees across workers that all are out of data).
            ds = ds.filter(lambda *_: True)
        return self.strategy.distribute_datasets_from_function(lambda _context: ds)

    def _across_workers(self, batches: int, examples: int) -> list[tuple[int, int]]:
        """(batches, examples) of every worker's part, in worker order: one all-gather, on every worker."""
        import tensorflow as tf

        strategy = self.strategy

        # In a tf.function: eager, MultiWorkerMirroredStrategy.run warns of its overhead on every worker.
        @tf.function(autograph=False)
        def gather() -> Any:
            return strategy.gather(
                strategy.run(lambda: tf.constant([[batches, examples]], tf.int64)), axis=0
            )

        values = gather().numpy().tolist()
        per_replica = self.num_replicas // self.num_workers
        return [tuple(v) for v in values[::per_replica]]

    def _arrays_to_dataset(
        self, method: str, x: Any, y: Any, kwargs: dict[str, Any], global_batch: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        import tensorflow as tf

        sample_weight = kwargs.pop("sample_weight", None)
        shuffle = kwargs.pop("shuffle", True) if method == "fit" else False
        split = kwargs.pop("validation_split", 0.0) if method == "fit" else 0.0
        if split and kwargs.get("validation_data") is None:
            # Same rule as Keras: the last `split` fraction of the arrays, before shuffling.
            n = len(tf.nest.flatten(x)[0])
            cut = int(n * (1.0 - split))
            head = lambda a: tf.nest.map_structure(lambda t: t[:cut], a) if a is not None else None  # noqa: E731
            tail = lambda a: tf.nest.map_structure(lambda t: t[cut:], a) if a is not None else None  # noqa: E731
            kwargs["validation_data"] = self._arrays(
                _parts(tail(x), tail(y), tail(sample_weight)), global_batch, False
            )
            x, y, sample_weight = head(x), head(y), head(sample_weight)
        vd = kwargs.get("validation_data")
        if isinstance(vd, tuple) and not is_dataset(vd[0]):
            kwargs["validation_data"] = self._arrays(vd, global_batch, False)
        if method == "fit":
            # shuffled here, with one seed for all workers; Keras would only warn
            kwargs["shuffle"] = False
            choice = self._choice(None)
            n = len(tf.nest.flatten(x)[0])
            if (
                choice.policy == "off"
                and self.num_workers > 1
                and global_batch == self.global_batch
            ):
                # Each worker's arrays are its own part: read per replica, not sharded, steps from its own length.
                ds = self._arrays(_parts(x, y, sample_weight), global_batch, shuffle)
                return (
                    self.training_dataset(
                        ds,
                        found=(global_batch, "keras-sync's batch"),
                        examples=n,
                        source="arrays",
                        choice=choice,
                    ),
                    None,
                    kwargs,
                )
            self.facts = InputFacts(
                "arrays",
                choice.policy,
                examples_per_epoch=n,
                steps_per_epoch=_steps(n, global_batch, self.drop_remainder),
            )
            self._say(
                f"keras-sync: training data: arrays, shard policy {choice.policy} ({choice.reason}); "
                f"{batch_layout(global_batch, self.num_replicas, self.num_workers)}",
                loud=self.num_workers > 1,
            )
        return self._arrays(_parts(x, y, sample_weight), global_batch, shuffle), None, kwargs

    def _arrays(self, parts: tuple, global_batch: int, shuffle: bool) -> Any:
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
        return self._batched(
            ds, global_batch, shuffle=shuffle, seed=1337, choice=self._choice(None)
        )

    def _batched(
        self, ds: Any, global_batch: int, *, shuffle: bool, seed: int, choice: ShardChoice
    ) -> Any:
        """``ds`` of single examples -> shuffled (one seed for every worker), batched, shard policy set."""
        if shuffle:
            n = int(ds.cardinality())
            ds = ds.shuffle(n if n > 0 else 10_000, seed=seed, reshuffle_each_iteration=True)
        return _with_policy(ds.batch(global_batch, drop_remainder=self.drop_remainder), choice)

    def _choice(self, ds: Any | None) -> ShardChoice:
        if ds is None:
            return shard_choice("arrays", configured=self.shard_policy)
        choice = shard_choice("dataset", configured=self.shard_policy, own=own_shard_policy(ds))
        if self.num_workers <= 1 or choice.policy not in ("auto", "file"):
            return choice
        # Decided here, before training: TensorFlow's FILE sharding fails at the first step when the
        # pipeline reads fewer files than there are workers ("Could not apply FILE based sharding").
        files = file_count(ds)
        workers = self.num_workers
        if files is None:
            if choice.policy == "file":
                return ShardChoice(
                    "data",
                    "batch.shard_policy: file, but the pipeline reads no files: split by example",
                )
            return ShardChoice(
                "data",
                "batch.shard_policy: auto and the pipeline reads no files: TensorFlow splits "
                "it by example",
            )
        if files < workers:
            return ShardChoice(
                "data",
                f"the pipeline reads {files} file{'s' * (files != 1)} for {workers} workers, "
                "too few to shard by file: split by example",
            )
        return ShardChoice(
            "file",
            f"batch.shard_policy: {choice.policy} and the pipeline reads {files} files for "
            f"{workers} workers: each worker reads its own files",
        )

    def _say(self, line: str, *, loud: bool) -> None:
        """One line about the input on the chief: printed when it matters (several workers, a
        changed batch), else only logged."""
        log.info("%s", line)
        if loud and self.is_chief:
            print(line, file=sys.stderr, flush=True)


# -- tf.data helpers ---------------------------------------------------------------------------


def tf_seed_set() -> bool:
    """Whether the script set TensorFlow's global seed (`keras.utils.set_random_seed`, `tf.random.set_seed`).

    Then Keras's own shuffle of arrays draws the same order in every run, and a resume replays it:
    with a backup, arrays are left to Keras, so a seeded script trains the same weights with and
    without ``fault_tolerance.backup_dir``. Unseeded, keras-sync shuffles with its own seed.
    """
    from keras_sync.upstream.tf_runtime import global_seed_set

    return global_seed_set()


def is_dataset(x: Any) -> bool:
    """Whether ``x`` is a `tf.data.Dataset` or a distributed dataset (not arrays)."""
    import tensorflow as tf

    return isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)) or hasattr(
        x, "element_spec"
    )


def own_shard_policy(ds: Any) -> str:
    """The auto-shard policy in the dataset's own options, lower case (``auto`` when not set)."""
    policy = ds.options().experimental_distribute.auto_shard_policy
    return getattr(policy, "name", str(policy)).lower()


def _with_policy(ds: Any, choice: ShardChoice) -> Any:
    import tensorflow as tf

    wanted = getattr(tf.data.experimental.AutoShardPolicy, choice.policy.upper())
    if ds.options().experimental_distribute.auto_shard_policy == wanted:
        return ds
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = wanted
    return ds.with_options(options)


def batch_size_of(ds: Any) -> tuple[int | None, str]:
    """(batch size, how it was found) of a batched dataset; (None, why not) when it cannot be told.

    In order: the static first dimension of every component; TensorFlow's own reading of the
    pipeline (`compute_batch_size`, what `tf.distribute` uses to split batches); the nearest
    ``batch``/``padded_batch`` op up the pipeline through element-wise steps such as ``map``.
    """
    import tensorflow as tf

    dims = {spec.shape[0] for spec in tf.nest.flatten(ds.element_spec) if _rank(spec)}
    if len(dims) == 1 and None not in dims:
        return int(dims.pop()), "static shape"
    from keras_sync.upstream.tf_runtime import pipeline_batch_size

    size = pipeline_batch_size(ds)
    if size is not None:
        return size, "its batch op"
    op = _batch_op(ds)
    if op is not None:
        size = tf.get_static_value(op._batch_size)
        if size is not None:
            return int(size), "its batch op"
    return (
        None,
        "no static batch dimension and no batch op, e.g. from_generator or Ray Data's to_tf",
    )


def _rank(spec: Any) -> int | None:
    shape = getattr(spec, "shape", None)
    return None if shape is None or shape.rank is None else shape.rank


def _refuse_unbatched(ds: Any) -> None:
    """A batch has a first dimension shared by every component; single examples often do not."""
    import tensorflow as tf

    ranks = [_rank(spec) for spec in tf.nest.flatten(ds.element_spec)]
    firsts = {spec.shape[0] for spec, r in zip(tf.nest.flatten(ds.element_spec), ranks) if r}
    if 0 in ranks or (None not in firsts and len(firsts) > 1):
        raise UsageError(
            "sync.fit received a tf.data.Dataset of single examples, not batches (element_spec="
            f"{ds.element_spec}: no first dimension shared by every component); Keras trains on batches. "
            "Fix: pass it through sync.distribute(dataset), which batches by the global batch, or end it "
            "with .batch(n)."
        )


def _batch_op(ds: Any) -> Any:
    """The nearest dataset up the pipeline that batches (has a ``_batch_size``), through one-input steps."""
    for _ in range(200):
        if getattr(ds, "_batch_size", None) is not None:
            return ds
        try:
            inputs = ds._inputs()
        except (AttributeError, NotImplementedError):
            return None
        if len(inputs) != 1:
            return None
        ds = inputs[0]
    return None


def _rebatch(
    ds: Any, global_batch: int, found: int | None, drop_remainder: bool, examples: int | None
) -> Any:
    """``ds`` rebatched to ``global_batch``, keeping a known number of steps when the examples are known."""
    import tensorflow as tf

    out = ds.rebatch(global_batch, drop_remainder=drop_remainder)
    steps = _steps(examples, global_batch, drop_remainder)
    return out if steps is None else out.apply(tf.data.experimental.assert_cardinality(steps))


def _example_count(ds: Any, found: int | None) -> int | None:
    """The number of examples in one pass of a batched dataset, when the pipeline tells it exactly."""
    import tensorflow as tf

    batches = int(ds.cardinality())
    if batches < 0 or found is None:
        return None
    dims = {spec.shape[0] for spec in tf.nest.flatten(ds.element_spec) if _rank(spec)}
    if dims == {found}:
        return batches * found  # every batch is full (static batch dimension)
    op = _batch_op(ds)
    if op is None or tf.get_static_value(op._batch_size) != found:
        return None
    examples = int(op._input_dataset.cardinality())
    drop = bool(tf.get_static_value(op._drop_remainder))
    if examples < 0:
        return None
    if drop:
        examples -= examples % found
    # Only when nothing between the batch op and the end filtered or repeated batches.
    return examples if math.ceil(examples / found) == batches else None


def _steps(examples: int | None, batch: int, drop_remainder: bool) -> int | None:
    if examples is None:
        return None
    return examples // batch if drop_remainder else math.ceil(examples / batch)


def _array_examples(x: Any, validation_split: float | None) -> int | None:
    import tensorflow as tf

    try:
        n = len(tf.nest.flatten(x)[0])
    except TypeError:
        return None
    return int(n * (1.0 - validation_split)) if validation_split else n


def _parts(x: Any, y: Any, sample_weight: Any) -> tuple:
    return tuple(p for p in (x, y, sample_weight) if p is not None)


def steps_of(x: Any, batch_size: int | None, validation_split: float | None) -> int | None:
    """Steps in one epoch of what `fit` trains on (a dataset's cardinality, or arrays / batch)."""
    if is_dataset(x):
        card = getattr(x, "cardinality", -1)
        n = int(card() if callable(card) else card)
        return n if n > 0 else None
    if x is None or batch_size is None:
        return None
    return _steps(_array_examples(x, validation_split), batch_size, False)


def _validation_input(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``validation_data`` read as the training data is: a PyDataset by index; a generator refused."""
    vd = kwargs.get("validation_data")
    if is_py_dataset(vd):
        # each evaluation reads every batch once
        kwargs = dict(kwargs, validation_data=py_dataset_batches(vd)[0])
    elif is_generator(vd):
        raise UsageError(
            "sync.fit received validation_data as a Python generator: Keras evaluates it again every epoch, "
            "each time replaying its first 2 batches and then reading new ones, so no two epochs validate on the "
            "same data (one device or several). Fix: give validation_data as arrays, a keras.utils.PyDataset or a "
            "tf.data.Dataset."
        )
    return kwargs
