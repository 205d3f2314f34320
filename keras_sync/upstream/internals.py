"""Every private Keras, TensorFlow and MLflow internal keras-sync relies on, each with a probe.

Where Keras 3 has no public hook for what keras-sync fixes or measures, keras-sync reaches into
the library; this table is the one list of those places. Each entry names the internal, the
feature that needs it, the upstream issue or the reason, and a probe of the shape relied on.
`require(feature)` raises `CompatibilityError` in one line (versions, what is missing, the fix)
when a probe of the feature fails. An entry with ``fallback`` has a public path taken instead.

No TensorFlow, Keras or MLflow import at module import time; a probe imports what it checks.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

from keras_sync.errors import CompatibilityError

# What a refused feature is, in the words of the refusal, and what else the user can do.
FEATURES: dict[str, tuple[str, str]] = {
    "multi_worker_fit": (
        "`fit` under multi-worker multi_worker_mirrored",
        "or train on one worker (strategy.kind: mirrored)",
    ),
    "multi_worker_steps_per_execution": (
        "steps_per_execution > 1 under multi-worker multi_worker_mirrored",
        "or set runtime.steps_per_execution: 1",
    ),
    "multi_worker_strategy": (
        "multi_worker_mirrored with local devices and strategy.connect_timeout_s",
        "or train on one worker (strategy.kind: mirrored)",
    ),
    "exact_resume": (
        "exact mid-epoch resume (fault_tolerance.backup_dir)",
        "or remove fault_tolerance.backup_dir",
    ),
    "quiet_device_datasets": (
        "TensorFlow's per-device datasets without the 'will not be optimized' warning",
        "or ignore the line",
    ),
    "per_replica_metrics": (
        "per-replica loss and gradient norm (sync/loss/replica_*, sync/grad_norm/replica_*)",
        "or set mlflow.enabled: false",
    ),
    "end_of_data": (
        "one optimizer step per batch on a dataset of unknown length",
        "or give the dataset its length (dataset.apply(tf.data.experimental.assert_cardinality(n)))",
    ),
    "system_metrics": (
        "MLflow system metrics (mlflow.system_metrics: true)",
        "or set mlflow.system_metrics: false",
    ),
    "model_strategy": (
        "telling which strategy built a model (the sync.scope() check, chief-only saving)",
        "no public Keras API tells it",
    ),
    "keras_backup_guard": (
        "Keras's BackupAndRestore under multi-worker multi_worker_mirrored (the chief writes it)",
        "or use keras-sync's backup (fault_tolerance.backup_dir) instead",
    ),
    "loss_scale_reduce": (
        "one all-reduce of the gradients per step with mixed_float16 on several replicas (the "
        "loss-scale decision of one device)",
        "the gradients are all-reduced twice instead",
    ),
    "iterator_release": (
        "keeping the iterator Keras drops after reading the first batch's shapes until its threads "
        "are done (a process under a strategy can crash under load without it)",
        "or train on one device (strategy.kind: default)",
    ),
    "replica_random_streams": (
        "independent random draws on each replica (keras.random in a train step, Dropout, "
        "random augmentation)",
        "or train on one replica (strategy.kind: default)",
    ),
    "evaluate_loss": (
        "the loss a custom test_step reports under several replicas (one device's, not a share)",
        "or multiply the loss your test_step tracks by the replica count",
    ),
    "same_data_order": (
        "the data order of one device (Keras reads a batch for its shapes first, which starts an "
        "extra pass of a reshuffling dataset)",
        "the batches differ from one device's",
    ),
    "file_count": (
        "counting the files a pipeline reads before training (fewer files than workers are split "
        "by example, not by file)",
        "or set batch.shard_policy: data",
    ),
}
#: Each library: (floor, newest tested, first excluded). The floor and the cap are pyproject.toml's
#: ranges (tests/test_internals.py checks they agree); the cap is the next major version, as no
#: known break sits below it. A newer release inside the range that moves an internal below is
#: refused by the probes; the fix then pins the newest tested release (`_spec`).
RANGES = {
    "keras": ("3.10", "3.15", "4"),
    "tensorflow": ("2.17", "2.21", "3"),
    "mlflow": ("2.22", "3.17", "4"),
}
_NAMES = {"keras": "Keras", "tensorflow": "TensorFlow", "mlflow": "MLflow"}
TESTED = ", ".join(f"{_NAMES[name]} {lo}-{hi}" for name, (lo, hi, _) in RANGES.items())


def _next_minor(version: str) -> str:
    """``"3.15"`` -> ``"3.16"``."""
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def _spec(library: str, floor: str | None = None, *, distribution: str | None = None) -> str:
    """``keras>=3.10,<3.16``: the tested releases (or from ``floor``; ``distribution`` names the pip
    package, e.g. tensorflow-cpu), what a refusal's fix installs."""
    lo, newest, _ = RANGES[library]
    return f"{distribution or library}>={floor or lo},<{_next_minor(newest)}"


# The fix for each library. TensorFlow is not named by distribution: "tensorflow" would add a
# second TensorFlow next to a project's tensorflow-cpu (or the reverse).
PIN = {
    "keras": f'pip install "{_spec("keras")}"',
    "tensorflow": f"install TensorFlow {RANGES['tensorflow'][0]}-{RANGES['tensorflow'][1]} of the distribution "
    f'you use (e.g. pip install "{_spec("tensorflow", distribution="tensorflow-cpu")}")',
    "mlflow": f'pip install "{_spec("mlflow")}"',
}


@dataclass(frozen=True)
class Internal:
    """One private internal: where it lives, who needs it, why, and how its shape is checked."""

    name: str
    feature: str
    why: str
    probe: Callable[[], str | None]  # None when the shape matches, else what is missing
    fallback: bool = False
    #: The first version of its library that has it (e.g. "3.12" for Keras), when newer than the
    #: supported floor: older versions refuse only its feature, with this floor in the fix.
    since: str | None = None
    #: The private attribute names keras-sync reads or sets on the library's objects through this
    #: entry (``model._initial_epoch``...); tests/test_internals.py checks that every private
    #: attribute the package uses on an object not its own is listed by some entry.
    attrs: tuple[str, ...] = ()


def _release(version: str) -> tuple[int, ...]:
    """``"3.10.0"`` -> (3, 10): the major.minor of a version string (pre-release tags ignored)."""
    return tuple(
        int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:2]
    )


def predates(internal: Internal) -> bool:
    """Whether the installed library is older than ``internal.since`` (then its absence is expected)."""
    if internal.since is None:
        return False
    module = "mlflow" if internal.name.startswith("mlflow") else "keras"
    installed = getattr(importlib.import_module(module), "__version__", "0")
    return _release(installed) < _release(internal.since)


def _get(path: str) -> Any:
    """``"pkg.module:Class.attr"`` -> the object; raises AttributeError/ImportError if moved."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for a in attrs.split(".") if attrs else ():
        obj = getattr(obj, a)
    return obj


def _names(code: CodeType) -> set[str]:
    """Global and attribute names a function's code (and its nested functions) looks up."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, CodeType):
            out |= _names(c)
    return out


def callable_with(path: str, *params: str) -> Callable[[], str | None]:
    """Probe: ``path`` exists, is callable and its first parameters are ``params``."""

    def probe() -> str | None:
        obj = _get(path)
        if not callable(obj):
            return f"`{path}` is not callable"
        got = list(inspect.signature(obj).parameters)[: len(params)]
        return None if got == list(params) else f"`{path}` takes {got}, not {list(params)}"

    return probe


def looks_up(paths: str | tuple[str, ...], *names: str) -> Callable[[], str | None]:
    """Probe: the function at ``paths`` (or those of them that exist, taken together) still looks
    up ``names`` by name, which is what keras-sync replaces or shadows."""
    paths = (paths,) if isinstance(paths, str) else paths

    def probe() -> str | None:
        found: set[str] = set()
        existing = []
        for path in paths:
            try:
                fn = inspect.unwrap(_get(path))
            except (ImportError, AttributeError):
                continue
            existing.append(path)
            found |= _names(fn.__code__)
        if not existing:
            _get(paths[0])  # raises: reported as gone
        missing = [n for n in names if n not in found]
        return None if not missing else f"`{' / '.join(existing)}` no longer uses {missing}"

    return probe


def has_attrs(path: str, *attrs: str) -> Callable[[], str | None]:
    """Probe: the object at ``path`` has ``attrs``."""

    def probe() -> str | None:
        obj = _get(path)
        missing = [a for a in attrs if not hasattr(obj, a)]
        return None if not missing else f"`{path}` has no {missing}"

    return probe


def _is_mwms() -> str | None:
    import tensorflow as tf

    cls = _get(
        "tensorflow.python.distribute.collective_all_reduce_strategy:CollectiveAllReduceStrategy"
    )
    return (
        None
        if cls is tf.distribute.MultiWorkerMirroredStrategy
        else (
            "`CollectiveAllReduceStrategy` is no longer `tf.distribute.MultiWorkerMirroredStrategy`"
        )
    )


def _coordination_fields(*names: str) -> Callable[[], str | None]:
    """Probe: the config TF builds in `configure_coordination_service` has the fields keras-sync sets."""

    def probe() -> str | None:
        fields = _get(
            f"{_CONTEXT}:coordination_config_pb2.CoordinationServiceConfig"
        ).DESCRIPTOR.fields_by_name
        missing = [f for f in names if f not in fields]
        return None if not missing else f"TensorFlow's coordination service config has no {missing}"

    return probe


def nested_code(path: str, name: str) -> CodeType | None:
    """The code of the function ``name`` defined inside the function at ``path`` (None if none)."""
    for c in inspect.unwrap(_get(path)).__code__.co_consts:
        if isinstance(c, CodeType) and c.co_name == name:
            return c
    return None


def _end_of_data() -> str | None:
    code = nested_code(MAKE_FUNCTION, "function")
    if code is None or "one_step_on_data" not in code.co_freevars:
        return f"`{MAKE_FUNCTION}` no longer returns a `function` closing over `one_step_on_data`"
    return None


def _monitors() -> str | None:
    for module, cls in (("cpu", "CPU"), ("disk", "Disk"), ("network", "Network")):
        missing = has_attrs(
            f"{_SYSTEM}.{module}_monitor:{cls}Monitor",
            "collect_metrics",
            "aggregate_metrics",
            "clear_metrics",
        )()
        if missing:
            return missing
    return None


_TRAINER = "keras.src.backend.tensorflow.trainer"
_CONTEXT = "tensorflow.python.eager.context"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy"
_MW_UTIL = "tensorflow.python.distribute.multi_worker_util"
_SYSTEM = "mlflow.system_metrics.metrics"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"
_KERAS_20585 = "keras-team/keras#20585 (Keras 3 fit under MultiWorkerMirroredStrategy)"

MAKE_FUNCTION = f"{_TRAINER}:TensorFlowTrainer._make_function"
END_OF_DATA = f"{MAKE_FUNCTION}.<locals>.function"
BARRIER = (
    f"{_CONTEXT}:coordination_config_pb2.CoordinationServiceConfig.cluster_register_with_barrier"
)
GLOBAL_SEED = f"{_CONTEXT}:global_seed"
PIPELINE_BATCH_SIZE = "tensorflow.python.data.experimental.ops.distribute:compute_batch_size"
LOSS_SCALE_REDUCE = f"{_TF_OPTIMIZER}:TFOptimizer._all_reduce_sum_gradients"
COUNTED_EPOCH = "keras.src.trainers.epoch_iterator:EpochIterator._enumerate_iterator"
EPOCH_ITERATOR_RESET = "keras.src.trainers.epoch_iterator:EpochIterator.reset"
SAME_DATA_ORDER = f"{_TRAINER}:TFEpochIterator._distributed_dataset"

REGISTRY: tuple[Internal, ...] = (
    # upstream/keras_fixes.py: the two failures of keras-team/keras#20585, patched for multi-worker only.
    Internal(
        f"{_TRAINER}:reduce_per_replica",
        "multi_worker_fit",
        _KERAS_20585,
        callable_with(f"{_TRAINER}:reduce_per_replica", "values", "strategy", "reduction"),
    ),
    Internal(
        f"{_TRAINER}:TensorFlowTrainer.make_train_function",
        "multi_worker_fit",
        "reduce_per_replica is replaced as a module global, so the train function must look it up there",
        # Keras 3.10 builds the step in make_train_function, later ones in _make_function.
        looks_up(
            (
                f"{_TRAINER}:TensorFlowTrainer.make_train_function",
                f"{_TRAINER}:TensorFlowTrainer._make_function",
            ),
            "reduce_per_replica",
        ),
    ),
    Internal(
        f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
        "multi_worker_fit",
        _KERAS_20585,
        callable_with(
            f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build", "self", "iterator", "data_batch"
        ),
    ),
    Internal(
        f"{_TRAINER}:_is_tpu_strategy, _is_per_replica_instance, _is_scalar",
        "multi_worker_fit",
        "Keras's own tests for what the patched reduction may change",
        has_attrs(_TRAINER, "_is_tpu_strategy", "_is_per_replica_instance", "_is_scalar"),
        attrs=("_is_tpu_strategy", "_is_per_replica_instance", "_is_scalar"),
    ),
    # upstream/keras_fixes.py fix 3: the one-step tf.function traced inline into the multi-step loop.
    Internal(
        f"{_TRAINER}:TensorFlowTrainer._autoconvert_optionals",
        "multi_worker_steps_per_execution",
        "keras-team/keras#19246 (steps_per_execution > 1 under MultiWorkerMirroredStrategy): the hook that "
        "receives the one-step tf.function, replaced by its Python function",
        callable_with(f"{_TRAINER}:TensorFlowTrainer._autoconvert_optionals", "self", "step_func"),
        since="3.12",
    ),
    Internal(
        f"{_TRAINER}:TensorFlowTrainer._make_function",
        "multi_worker_steps_per_execution",
        "the multi-step loop must get its one-step function through _autoconvert_optionals",
        looks_up(
            f"{_TRAINER}:TensorFlowTrainer._make_function",
            "_autoconvert_optionals",
            "function",
            "steps_per_execution",
            "while_loop",
        ),
        since="3.12",
    ),
    # upstream/keras_fixes.py apply_end_of_data_fix: no extra step past the end of an unknown-cardinality dataset.
    Internal(
        END_OF_DATA,
        "end_of_data",
        "Keras ends an unknown-cardinality epoch by running a step past the end, which moves "
        "optimizer.iterations (keras-team/keras#23179); the one-step function is taken from its closure",
        _end_of_data,
        fallback=True,
    ),
    Internal(
        COUNTED_EPOCH,
        "end_of_data",
        "the step iterators Keras hands out, marked when their data has a known length (Keras stops "
        "before its end, and the end-of-data fix is skipped)",
        looks_up(COUNTED_EPOCH, "_num_batches", "_steps_seen"),
        fallback=True,
    ),
    # upstream/keras_fixes.py apply_iterator_release_fix: the iterator `reset` drops is kept until the next reset,
    # and every iterator the epoch iterator holds (these two attributes) is destroyed off the training thread.
    Internal(
        EPOCH_ITERATOR_RESET,
        "iterator_release",
        "Keras drops the distributed iterator it made to read the first batch's shapes; destroyed while its "
        "MultiDeviceIterator thread reads, the process crashes (SIGSEGV / pure virtual method called)",
        looks_up(EPOCH_ITERATOR_RESET, "_current_iterator", "_epoch_iterator"),
        attrs=("_current_iterator", "_epoch_iterator"),
        fallback=True,
    ),
    # upstream/multi_worker.py: local devices per worker and the bounded join (no constructor argument for either).
    Internal(
        f"{_CARS}:CollectiveAllReduceExtended._initialize_local_devices",
        "multi_worker_strategy",
        "TF's hook that picks local devices (TODO b/126786766); no argument gives CPUs",
        callable_with(
            f"{_CARS}:CollectiveAllReduceExtended._initialize_local_devices",
            "self",
            "cluster_resolver",
            "worker_device",
        ),
    ),
    Internal(
        f"{_CARS}:CollectiveAllReduceExtended.__init__",
        "multi_worker_strategy",
        "subclassed to pass the local devices",
        callable_with(
            f"{_CARS}:CollectiveAllReduceExtended.__init__",
            "self",
            "container_strategy",
            "cluster_resolver",
            "communication_options",
        ),
    ),
    Internal(
        f"{_CARS}:CollectiveAllReduceExtended._in_multi_worker_mode",
        "multi_worker_strategy",
        "_strategy_facts.in_multi_worker_mode: which strategies get the multi-worker fixes and collectives",
        callable_with(f"{_CARS}:CollectiveAllReduceExtended._in_multi_worker_mode", "self"),
        attrs=("_in_multi_worker_mode",),
    ),
    Internal(
        f"{_CARS}:CollectiveAllReduceStrategy",
        "multi_worker_strategy",
        "subclassed so that isinstance(tf.distribute.MultiWorkerMirroredStrategy) holds",
        _is_mwms,
    ),
    Internal(
        "tensorflow.python.eager.context:Context.configure_coordination_service",
        "multi_worker_strategy",
        "no public API configures the coordination service (join timeout, tensorflow#60706)",
        callable_with(
            "tensorflow.python.eager.context:Context.configure_coordination_service",
            "self",
            "service_type",
            "service_leader",
        ),
    ),
    Internal(
        f"{_CONTEXT}:coordination_config_pb2.CoordinationServiceConfig",
        "multi_worker_strategy",
        "the join timeout and the jobs that must join",
        _coordination_fields("coordinated_job_list", "cluster_register_timeout_in_ms"),
    ),
    Internal(
        BARRIER,
        "multi_worker_strategy",
        "every task, not only the chief, to time out at registration (without it a worker whose "
        "chief never starts waits on TensorFlow's own terms)",
        _coordination_fields("cluster_register_with_barrier"),
        fallback=True,
    ),
    Internal(
        f"{_MW_UTIL}:is_chief, worker_count, normalize_cluster_spec, coordination_leader",
        "multi_worker_strategy",
        "TF's own chief rule and cluster maths, reused rather than copied",
        has_attrs(
            _MW_UTIL, "is_chief", "worker_count", "normalize_cluster_spec", "coordination_leader"
        ),
    ),
    # upstream/epoch_iterator.py: the epoch iterator fit builds, swapped for one that starts mid-epoch.
    Internal(
        f"{_TRAINER}:TFEpochIterator",
        "exact_resume",
        "Keras's BackupAndRestore restarts an epoch at batch 0; no API starts one mid-way",
        has_attrs(f"{_TRAINER}:TFEpochIterator", "_enumerate_iterator", "catch_stop_iteration"),
        attrs=("_enumerate_iterator",),
    ),
    Internal(
        "keras.src.trainers.epoch_iterator:EpochIterator.__init__",
        "exact_resume",
        "whether the data has a known number of batches (`_num_batches`), to replay the epochs done",
        looks_up("keras.src.trainers.epoch_iterator:EpochIterator.__init__", "_num_batches"),
        attrs=("_num_batches",),
    ),
    Internal(
        f"{_TRAINER}:TensorFlowTrainer.fit",
        "exact_resume",
        "fit must build its iterator from the module global keras-sync swaps",
        looks_up(f"{_TRAINER}:TensorFlowTrainer.fit", "TFEpochIterator"),
    ),
    Internal(
        f"{_TRAINER}:TensorFlowTrainer.fit (model._initial_epoch)",
        "exact_resume",
        "the restored epoch is handed to fit as `model._initial_epoch`, which fit reads after on_train_begin "
        "(Keras's own BackupAndRestore does the same)",
        looks_up(f"{_TRAINER}:TensorFlowTrainer.fit", "_initial_epoch"),
        attrs=("_initial_epoch",),
    ),
    # session.py, saving.py, cluster/collective_calls.py: the strategy a model was built under.
    Internal(
        f"{_TRAINER}:TensorFlowTrainer.__init__ (model._distribute_strategy)",
        "model_strategy",
        "`model.distribute_strategy` falls back to the current strategy, so only `_distribute_strategy` "
        "tells a model built outside sync.scope()",
        looks_up(f"{_TRAINER}:TensorFlowTrainer.__init__", "_distribute_strategy"),
        attrs=("_distribute_strategy",),
    ),
    # saving.py: Keras's BackupAndRestore writes on the chief only.
    Internal(
        "keras.src.callbacks.backup_and_restore:BackupAndRestore._save_model, _weights_path",
        "keras_backup_guard",
        "its save is replaced on the workers that are not the chief",
        lambda: (
            has_attrs("keras.src.callbacks.backup_and_restore:BackupAndRestore", "_save_model")()
            or looks_up(
                "keras.src.callbacks.backup_and_restore:BackupAndRestore.__init__", "_weights_path"
            )()
        ),
        attrs=("_save_model", "_weights_path"),
    ),
    # upstream/tf_import.py: the per-device datasets of TF's MultiDeviceIterator (Mirrored over 2+ devices) warn
    # "Input of GeneratorDatasetOp::Dataset will not be optimized" once per run; they are made without
    # the graph rewrites that cannot apply to them.
    Internal(
        "tensorflow.python.data.ops.multi_device_iterator_ops:_create_device_dataset",
        "quiet_device_datasets",
        "the per-device datasets are built there, with default options that ask for rewrites",
        lambda: (
            callable_with(
                "tensorflow.python.data.ops.multi_device_iterator_ops:_create_device_dataset",
                "prototype_ds",
                "incarnation_id",
            )()
            or looks_up(
                (
                    "tensorflow.python.data.ops.multi_device_iterator_ops:MultiDeviceIterator.__init__",
                    "tensorflow.python.data.ops.multi_device_iterator_ops:OwnedMultiDeviceIterator.__init__",
                ),
                "_create_device_dataset",
            )()
        ),
        fallback=True,
        attrs=("_create_device_dataset",),
    ),
    # upstream/replica_seeds.py: the seed of each Keras random op, folded with the replica id while a train step traces.
    Internal(
        "keras.src.backend.tensorflow.random:_cast_seed",
        "replica_random_streams",
        "every Keras random op turns its seed into TensorFlow's there; no public hook gives each replica its own",
        looks_up(
            tuple(
                f"keras.src.backend.tensorflow.random:{name}"
                for name in (
                    "normal",
                    "uniform",
                    "dropout",
                    "randint",
                    "truncated_normal",
                    "categorical",
                )
            ),
            "_cast_seed",
        ),
    ),
    # upstream/eval_loss.py: a custom test_step's compute_loss is not divided by the replica count while it traces.
    Internal(
        "keras.src.losses.loss:scale_loss_for_distribution, unscale_loss_for_distribution",
        "evaluate_loss",
        "Keras divides every loss by the replica count for the gradient sum, in test_step too, where no "
        "gradient is taken; the two functions are made identities while a test step traces",
        lambda: (
            has_attrs(
                "keras.src.losses.loss",
                "scale_loss_for_distribution",
                "unscale_loss_for_distribution",
            )()
            or looks_up("keras.src.losses.loss:reduce_values", "scale_loss_for_distribution")()
        ),
    ),
    # upstream/keras_fixes.py: shapes from a dataset's element_spec, not from a batch of an extra iterator.
    Internal(
        SAME_DATA_ORDER,
        "same_data_order",
        "under a strategy Keras iterates the dataset once to read the first batch's shapes, which starts a pass "
        "of a reshuffling dataset; keras-sync gives it the dataset's element_spec instead",
        lambda: (
            callable_with(
                f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
                "self",
                "iterator",
                "data_batch",
            )()
            or looks_up(f"{_TRAINER}:TFEpochIterator.__init__", "_distributed_dataset")()
        ),
        fallback=True,
        attrs=("_distributed_dataset",),
    ),
    # training/instrument.py: each replica's loss and local gradients exist only inside train_step.
    Internal(
        f"{_TRAINER}:TensorFlowTrainer.train_step",
        "per_replica_metrics",
        "the values before the all-reduce exist only inside train_step",
        looks_up(f"{_TRAINER}:TensorFlowTrainer.train_step", "_compute_loss", "apply_gradients"),
    ),
    # callbacks/weight_divergence.py: each replica's copy of a weight lives in the tf.Variable a Keras
    # Variable wraps.
    Internal(
        "keras.src.backend.tensorflow.core:Variable._initialize (variable._value)",
        "per_replica_metrics",
        "a Keras variable's per-replica copies are those of the tf.Variable it holds in `_value`",
        looks_up("keras.src.backend.tensorflow.core:Variable._initialize", "_value"),
        attrs=("_value",),
    ),
    # pipeline.py: the examples of one pass of a batched dataset, to give a rebatched one its length.
    Internal(
        "tensorflow.python.data.ops.batch_op:_BatchDataset",
        "end_of_data",
        "a batch op's size, remainder rule and input, read to count the examples exactly; without them "
        "a rebatched dataset has an unknown length",
        looks_up(
            "tensorflow.python.data.ops.batch_op:_BatchDataset.__init__",
            "_batch_size",
            "_drop_remainder",
            "_input_dataset",
        ),
        fallback=True,
        attrs=("_batch_size", "_drop_remainder", "_input_dataset", "_inputs"),
    ),
    Internal(
        PIPELINE_BATCH_SIZE,
        "end_of_data",
        "TensorFlow's own reading of a pipeline's batch size (what tf.distribute splits batches by); "
        "without it the batch op is read instead",
        callable_with(PIPELINE_BATCH_SIZE, "dataset"),
        fallback=True,
    ),
    # training/dataset_graph.py: the function an interleave/flat_map applies, read for file-reader ops to count
    # the files a pipeline reads (fewer files than workers: split by example, not by file).
    Internal(
        "tensorflow.python.data.ops: _InterleaveDataset, _ParallelInterleaveDataset, _FlatMapDataset "
        "(_map_func)",
        "file_count",
        "the function of an interleave or flat_map is only kept there; without it a reader inside one is not "
        "counted and TensorFlow's own auto-shard applies",
        looks_up(
            (
                "tensorflow.python.data.ops.interleave_op:_InterleaveDataset.__init__",
                "tensorflow.python.data.ops.interleave_op:_ParallelInterleaveDataset.__init__",
                "tensorflow.python.data.ops.flat_map_op:_FlatMapDataset.__init__",
            ),
            "_map_func",
        ),
        fallback=True,
        attrs=("_map_func",),
    ),
    # upstream/tf_runtime.py: with a backup, a seeded script's arrays keep Keras's own shuffle (same weights as without).
    Internal(
        GLOBAL_SEED,
        "exact_resume",
        "no public API tells whether tf.random.set_seed was called; without it arrays with a backup get "
        "keras-sync's own seeded shuffle, whose order differs from a run without backup",
        has_attrs(_CONTEXT, "global_seed"),
        fallback=True,
    ),
    # upstream/multi_worker.py: the cluster TF already joined, to catch a TF_CONFIG changed afterwards.
    Internal(
        "tensorflow.python.eager.context:context_safe",
        "multi_worker_strategy",
        "tensorflow#60706 check; without it a late TF_CONFIG change is not caught",
        has_attrs("tensorflow.python.eager.context", "context_safe"),
        fallback=True,
    ),
    Internal(
        f"{_CONTEXT}:Context.__init__ (_server_def, _collective_ops_server_def)",
        "multi_worker_strategy",
        "the cluster TensorFlow joined, for the same check",
        looks_up(
            (f"{_CONTEXT}:Context.__init__", f"{_CONTEXT}:Context.enable_collective_ops"),
            "_server_def",
            "_collective_ops_server_def",
        ),
        fallback=True,
        attrs=("_server_def", "_collective_ops_server_def"),
    ),
    # training/loss_scale.py: the gradients keras-sync summed for LossScaleOptimizer's decision, not summed again.
    Internal(
        LOSS_SCALE_REDUCE,
        "loss_scale_reduce",
        "Keras all-reduces inside the inner optimizer, after LossScaleOptimizer judged the local gradients; "
        "keras-sync sums them first, and passes that sum through this all-reduce while its apply traces",
        lambda: (
            has_attrs(f"{_TF_OPTIMIZER}:TFOptimizer", "_all_reduce_sum_gradients")()
            or looks_up(
                f"{_TF_OPTIMIZER}:TFOptimizer._backend_update_step", "_all_reduce_sum_gradients"
            )()
        ),
        fallback=True,
        attrs=("_all_reduce_sum_gradients",),
    ),
    # callbacks/system_metrics.py: MLflow's monitors, sampled at training steps.
    Internal(
        f"{_SYSTEM}: CPUMonitor, DiskMonitor, NetworkMonitor",
        "system_metrics",
        "MLflow samples system metrics on its own clock only; keras-sync logs them at training steps",
        _monitors,
    ),
)


def check(internal: Internal) -> str | None:
    """What is missing for ``internal`` on the installed versions, or None if its shape matches."""
    try:
        return internal.probe()
    except (ImportError, AttributeError) as e:
        return f"`{internal.name}` is gone ({type(e).__name__}: {e})"


def versions(internal: Internal) -> str:
    """``"Keras 3.15.1, TensorFlow 2.21.0"`` (or ``"MLflow 3.17.2"``): the library the internal belongs to."""
    libraries = (
        (("MLflow", "mlflow"),)
        if internal.name.startswith("mlflow")
        else (("Keras", "keras"), ("TensorFlow", "tensorflow"))
    )
    return ", ".join(
        f"{label} {getattr(importlib.import_module(m), '__version__', '?')}"
        for label, m in libraries
    )


def available(name: str) -> bool:
    """Whether the internal registered as ``name`` has the expected shape here (for a fallback)."""
    return check(next(i for i in REGISTRY if i.name == name)) is None


def missing(feature: str) -> tuple[Internal, str] | None:
    """The first internal (not a fallback) that ``feature`` needs and that has moved, with what is
    missing; None when every probe of the feature passes."""
    for internal in REGISTRY:
        if internal.feature != feature or internal.fallback:
            continue
        what = check(internal)
        if what is not None:
            return internal, what
    return None


def require(feature: str) -> None:
    """Raise `CompatibilityError` (one line) if an internal that ``feature`` needs has moved."""
    found = missing(feature)
    if found is not None:
        internal, what_is_missing = found
        what, alternative = FEATURES[feature]
        library = internal.name.split(".")[0]
        if predates(internal):
            raise CompatibilityError(
                f"{what} needs {library.capitalize()} >= {internal.since} (found {versions(internal)}: {what_is_missing}; "
                f"keras-sync needs it for {internal.why}). "
                f'Fix: pip install "{_spec(library, internal.since)}", {alternative}.'
            )
        raise CompatibilityError(
            f"{what} cannot work with {versions(internal)}: {what_is_missing} (keras-sync needs it for "
            f"{internal.why}). keras-sync is tested with {TESTED}. "
            f"Fix: {PIN[internal.name.split('.')[0]]}, {alternative}."
        )
