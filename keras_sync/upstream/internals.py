"""Every private Keras, TensorFlow and MLflow internal keras-sync relies on, each with a probe.

Each entry names the internal, the feature that needs it, why (the upstream issue) and the shape
relied on. `require(feature)` raises a one-line `CompatibilityError` when a probe fails; an entry
with ``fallback`` has a public path instead. Probes run once per process, on first use.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

from keras_sync.errors import CompatibilityError

#: feature -> (what is refused, in the refusal's words; what else the user can do).
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
    "quiet_device_datasets": ("per-device datasets without a 'will not be optimized' line", ""),
    "per_replica_metrics": (
        "per-replica loss and gradient norm (sync/loss/replica_*, sync/grad_norm/replica_*)",
        "or set mlflow.enabled: false",
    ),
    "end_of_data": ("one optimizer step per batch on data of unknown length", ""),
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
    "loss_scale_reduce": ("one gradient all-reduce per step with mixed_float16", ""),
    "iterator_release": ("keeping the iterator Keras drops after reading the shapes", ""),
    "replica_random_streams": (
        "independent random draws on each replica (Dropout, keras.random in a train step)",
        "or train on one replica (strategy.kind: default)",
    ),
    "evaluate_loss": (
        "the loss a custom test_step reports under several replicas (one device's, not a share)",
        "or multiply the loss your test_step tracks by the replica count",
    ),
    "same_data_order": ("the data order of one device (no extra pass for the shapes)", ""),
    "file_count": ("counting the files a pipeline reads before training", ""),
}
#: Each library: (floor, newest tested, first excluded), as pyproject.toml's ranges (a test checks
#: they agree). A refusal's fix pins the newest tested release.
RANGES = {
    "keras": ("3.10", "3.15", "4"),
    "tensorflow": ("2.17", "2.21", "3"),
    "mlflow": ("2.22", "3.17", "4"),
}
_NAMES = {"keras": "Keras", "tensorflow": "TensorFlow", "mlflow": "MLflow"}
TESTED = ", ".join(f"{_NAMES[name]} {lo}-{hi}" for name, (lo, hi, _) in RANGES.items())


def _spec(library: str, floor: str | None = None, distribution: str | None = None) -> str:
    """``keras>=3.10,<3.16``: the tested releases (from ``floor`` if given)."""
    lo, newest, _ = RANGES[library]
    major, minor = newest.split(".")
    return f"{distribution or library}>={floor or lo},<{major}.{int(minor) + 1}"


# TensorFlow is not named by distribution: "tensorflow" would add a second one beside tensorflow-cpu.
_TF_RANGE = f"{RANGES['tensorflow'][0]}-{RANGES['tensorflow'][1]}"
PIN = {
    "keras": f'pip install "{_spec("keras")}"',
    "tensorflow": f"install TensorFlow {_TF_RANGE} of the distribution you use "
    f'(e.g. pip install "{_spec("tensorflow", distribution="tensorflow-cpu")}")',
    "mlflow": f'pip install "{_spec("mlflow")}"',
}

Probe = Callable[[], "str | None"]  # None when the shape matches, else what is missing


@dataclass(frozen=True)
class Internal:
    """One private internal: where it lives, who needs it, why, and the `shape` specs it must meet.

    ``since``: the first release of its library that has it, when newer than the floor.
    """

    name: str
    feature: str
    why: str
    specs: tuple[str | Probe, ...]
    fallback: bool = False
    since: str | None = None

    @property
    def attrs(self) -> set[str]:
        """The private attributes its specs name (a test checks each use in the package is one)."""
        return {a for s in self.specs if isinstance(s, str) for a in re.findall(r"\b_[a-z]\w*", s)}


def _release(version: str) -> tuple[int, ...]:
    """``"3.10.0rc1"`` -> (3, 10)."""
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2])


def predates(internal: Internal) -> bool:
    """Whether the installed library is older than ``internal.since`` (its absence is expected)."""
    if internal.since is None:
        return False
    module = "mlflow" if internal.name.startswith("mlflow") else "keras"
    installed = getattr(importlib.import_module(module), "__version__", "0")
    return _release(installed) < _release(internal.since)


def _get(path: str) -> Any:
    """``"pkg.module:Class.attr"`` -> the object; ImportError/AttributeError when it moved."""
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


def _spec_fails(spec: str) -> str | None:
    """What does not match one `shape` spec (None when it holds)."""
    if spec.endswith(")"):
        path, _, params = spec[:-1].partition("(")
        obj, want = _get(path), params.split(", ")
        if not callable(obj):
            return f"`{path}` is not callable"
        got = list(inspect.signature(obj).parameters)[: len(want)]
        return None if got == want else f"`{path}` takes {got}, not {want}"
    if " uses " in spec:
        paths, _, names = spec.partition(" uses ")
        found: set[str] = set()
        existing = []
        for path in paths.split(" | "):
            try:
                found |= _names(inspect.unwrap(_get(path)).__code__)
            except (ImportError, AttributeError):
                continue
            existing.append(path)
        if not existing:
            _get(paths.split(" | ")[0])  # raises: reported as gone
        missing = [n for n in names.split(", ") if n not in found]
        return None if not missing else f"`{' / '.join(existing)}` no longer uses {missing}"
    path, _, attrs = spec.partition(" has ")
    obj = _get(path)
    missing = [a for a in attrs.split(", ") if not hasattr(obj, a)]
    return None if not missing else f"`{path}` has no {missing}"


def shape(*specs: str | Probe) -> Probe:
    """Probe: every spec holds (the first failure is reported). A spec is a probe or one of
    ``"path(a, b)"`` (callable, its first parameters a and b), ``"path | path uses a, b"`` (the
    functions' code, together, looks a and b up), ``"path has a, b"`` (attributes)."""

    def probe() -> str | None:
        for spec in specs:
            failed = spec() if callable(spec) else _spec_fails(spec)
            if failed:
                return failed
        return None

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


def _is_mwms() -> str | None:
    import tensorflow as tf

    if _get(f"{_CARS}:CollectiveAllReduceStrategy") is tf.distribute.MultiWorkerMirroredStrategy:
        return None
    return "`CollectiveAllReduceStrategy` is no longer `tf.distribute.MultiWorkerMirroredStrategy`"


def _coordination_fields(*names: str) -> Probe:
    """Probe: the config TF builds in `configure_coordination_service` has ``names``."""

    def probe() -> str | None:
        fields = _get(_COORDINATION).DESCRIPTOR.fields_by_name
        missing = [f for f in names if f not in fields]
        return None if not missing else f"TensorFlow's coordination service config has no {missing}"

    return probe


_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_TRAINER = f"{_TRAINER}:TensorFlowTrainer"
_EPOCH = "keras.src.trainers.epoch_iterator:EpochIterator"
_CONTEXT = "tensorflow.python.eager.context"
_COORDINATION = f"{_CONTEXT}:coordination_config_pb2.CoordinationServiceConfig"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy"
_CARS_EXT = f"{_CARS}:CollectiveAllReduceExtended"
_DATA_OPS = "tensorflow.python.data.ops"
_SYSTEM = "mlflow.system_metrics.metrics"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"
_KERAS_20585 = "keras-team/keras#20585 (Keras 3 fit under MultiWorkerMirroredStrategy)"
_MULTI_DEVICE = f"{_DATA_OPS}.multi_device_iterator_ops"
_RANDOM = "keras.src.backend.tensorflow.random"
_RANDOM_OPS = ("normal", "uniform", "dropout", "randint", "truncated_normal", "categorical")
_BACKUP = "keras.src.callbacks.backup_and_restore:BackupAndRestore"
LOSS = "keras.src.losses.loss"

MAKE_FUNCTION = f"{_TF_TRAINER}._make_function"
END_OF_DATA = f"{MAKE_FUNCTION}.<locals>.function"
BARRIER = f"{_COORDINATION}.cluster_register_with_barrier"
GLOBAL_SEED = f"{_CONTEXT}:global_seed"
PIPELINE_BATCH_SIZE = "tensorflow.python.data.experimental.ops.distribute:compute_batch_size"
LOSS_SCALE_REDUCE = f"{_TF_OPTIMIZER}._all_reduce_sum_gradients"
EPOCH_ITERATOR_RESET = f"{_EPOCH}.reset"
SAME_DATA_ORDER = f"{_TRAINER}:TFEpochIterator._distributed_dataset"
DEVICE_DATASET = f"{_MULTI_DEVICE}:_create_device_dataset"
_SYMBOLIC_BUILD = f"{_TF_TRAINER}._maybe_symbolic_build"
_REDUCE = f"{_TRAINER}:reduce_per_replica"
_AUTOCONVERT = f"{_TF_TRAINER}._autoconvert_optionals"
BATCH_OP = f"{_DATA_OPS}.batch_op:_BatchDataset"

# Each entry: the module that uses it, in the comment above it.
REGISTRY: tuple[Internal, ...] = (
    # keras_fixes.multi_worker_patches: keras-team/keras#20585, fixes 1 and 2 (multi-worker only).
    Internal(
        _REDUCE,
        "multi_worker_fit",
        _KERAS_20585,
        (
            f"{_REDUCE}(values, strategy, reduction)",
            f"{_TRAINER} has _is_tpu_strategy, _is_per_replica_instance, _is_scalar",
        ),
    ),
    Internal(
        f"{_TF_TRAINER}.make_train_function",
        "multi_worker_fit",
        "the train function must look reduce_per_replica up as a module global",
        # Keras 3.10 builds the step in make_train_function, later ones in _make_function.
        (f"{_TF_TRAINER}.make_train_function | {MAKE_FUNCTION} uses reduce_per_replica",),
    ),
    Internal(
        _SYMBOLIC_BUILD,
        "multi_worker_fit",
        _KERAS_20585,
        (f"{_SYMBOLIC_BUILD}(self, iterator, data_batch)",),
    ),
    # keras_fixes fix 3: the one-step function traced inline into the multi-step loop.
    Internal(
        _AUTOCONVERT,
        "multi_worker_steps_per_execution",
        "keras-team/keras#19246 (steps_per_execution > 1 under MultiWorkerMirroredStrategy): the "
        "hook that receives the one-step tf.function, replaced by its Python function",
        (
            f"{_AUTOCONVERT}(self, step_func)",
            f"{MAKE_FUNCTION} uses _autoconvert_optionals, function, steps_per_execution, while_loop",
        ),
        since="3.12",
    ),
    # keras_fixes.end_of_data_patches: no step past the end of data of unknown length.
    Internal(
        END_OF_DATA,
        "end_of_data",
        "Keras ends an unknown-cardinality epoch by running a step past the end, which moves "
        "optimizer.iterations (keras-team/keras#23179); the one-step function is taken from its closure",
        (_end_of_data,),
        fallback=True,
    ),
    # keras_fixes.iterator_release_patches: the iterator `reset` drops is kept until the next one.
    Internal(
        EPOCH_ITERATOR_RESET,
        "iterator_release",
        "Keras drops the iterator it made to read the first batch's shapes; destroyed while its "
        "thread reads, the process crashes",
        (f"{EPOCH_ITERATOR_RESET} uses _current_iterator, _epoch_iterator",),
        fallback=True,
    ),
    # multi_worker.py: local devices per worker, the bounded join, the cluster already joined.
    Internal(
        f"{_CARS}: CollectiveAllReduceStrategy, CollectiveAllReduceExtended",
        "multi_worker_strategy",
        "subclassed to pass each worker's local devices (TF's TODO b/126786766)",
        (
            f"{_CARS_EXT}._initialize_local_devices(self, cluster_resolver, worker_device)",
            f"{_CARS_EXT}.__init__(self, container_strategy, cluster_resolver, communication_options)",
            f"{_CARS_EXT}._in_multi_worker_mode(self)",
            _is_mwms,
        ),
    ),
    Internal(
        f"{_CONTEXT}:Context.configure_coordination_service",
        "multi_worker_strategy",
        "no public API bounds the join (tensorflow#60706)",
        (
            f"{_CONTEXT}:Context.configure_coordination_service(self, service_type, service_leader)",
            "tensorflow.python.distribute.multi_worker_util has is_chief, worker_count, "
            "normalize_cluster_spec, coordination_leader",
            _coordination_fields("coordinated_job_list", "cluster_register_timeout_in_ms"),
        ),
    ),
    Internal(
        BARRIER,
        "multi_worker_strategy",
        "every task, not only the chief, to time out at registration",
        (_coordination_fields("cluster_register_with_barrier"),),
        fallback=True,
    ),
    Internal(
        f"{_CONTEXT}:context_safe, Context._server_def, Context._collective_ops_server_def",
        "multi_worker_strategy",
        "the cluster TensorFlow joined: without it a late TF_CONFIG change is not caught",
        (
            f"{_CONTEXT} has context_safe",
            f"{_CONTEXT}:Context.__init__ | {_CONTEXT}:Context.enable_collective_ops uses "
            "_server_def, _collective_ops_server_def",
        ),
        fallback=True,
    ),
    # epoch_iterator.py: the epoch iterator fit builds, swapped for one that starts mid-epoch.
    Internal(
        f"{_TRAINER}:TFEpochIterator",
        "exact_resume",
        "Keras's BackupAndRestore restarts an epoch at batch 0; no API starts one mid-way",
        (
            f"{_TRAINER}:TFEpochIterator has _enumerate_iterator, catch_stop_iteration",
            f"{_EPOCH}.__init__ uses _num_batches",
        ),
    ),
    Internal(
        f"{_TF_TRAINER}.fit",
        "exact_resume",
        "fit must build its iterator from the module global keras-sync swaps, and read the "
        "restored epoch from `model._initial_epoch` as for Keras's BackupAndRestore",
        (f"{_TF_TRAINER}.fit uses TFEpochIterator, _initial_epoch",),
    ),
    # tf_runtime.py: with a backup, a seeded script's arrays keep Keras's own shuffle.
    Internal(
        GLOBAL_SEED,
        "exact_resume",
        "no public API tells whether tf.random.set_seed was called",
        (f"{_CONTEXT} has global_seed",),
        fallback=True,
    ),
    # strategy_facts.built_under: the strategy a model was built under.
    Internal(
        f"{_TF_TRAINER}.__init__ (model._distribute_strategy)",
        "model_strategy",
        "`model.distribute_strategy` falls back to the current strategy",
        (f"{_TF_TRAINER}.__init__ uses _distribute_strategy",),
    ),
    # backup_and_restore.py: Keras's BackupAndRestore writes on the chief only.
    Internal(
        f"{_BACKUP}._save_model, _weights_path",
        "keras_backup_guard",
        "its save is replaced on the workers that are not the chief",
        (f"{_BACKUP} has _save_model", f"{_BACKUP}.__init__ uses _weights_path"),
    ),
    # keras_fixes.device_dataset_patches: per-device datasets without rewrites that cannot apply.
    Internal(
        DEVICE_DATASET,
        "quiet_device_datasets",
        "the per-device datasets are built there, with default options that ask for rewrites",
        (
            f"{DEVICE_DATASET}(prototype_ds, incarnation_id)",
            f"{_MULTI_DEVICE}:MultiDeviceIterator.__init__ | "
            f"{_MULTI_DEVICE}:OwnedMultiDeviceIterator.__init__ uses _create_device_dataset",
        ),
        fallback=True,
    ),
    # replica_seeds.py: each Keras random op's seed folded with the replica id while a step traces.
    Internal(
        f"{_RANDOM}:_cast_seed",
        "replica_random_streams",
        "every Keras random op turns its seed into TensorFlow's there; no public hook exists",
        (" | ".join(f"{_RANDOM}:{op}" for op in _RANDOM_OPS) + " uses _cast_seed",),
    ),
    # keras_losses.py (evaluate, train_step_trace.py): the loss scaling of a test or train step.
    Internal(
        f"{LOSS}:scale_loss_for_distribution, unscale_loss_for_distribution",
        "evaluate_loss",
        "Keras divides every loss by the replica count, in test_step too; the two functions are "
        "identities while a test step traces",
        (
            f"{LOSS} has scale_loss_for_distribution, unscale_loss_for_distribution, reduce_values",
            f"{LOSS}:reduce_values uses scale_loss_for_distribution",
        ),
    ),
    # keras_fixes.same_data_order_patches: shapes from the element_spec, not an extra iterator.
    Internal(
        SAME_DATA_ORDER,
        "same_data_order",
        "Keras reads a batch for the shapes, which starts a pass of a reshuffling dataset",
        (
            f"{_SYMBOLIC_BUILD}(self, iterator, data_batch)",
            f"{_TRAINER}:TFEpochIterator.__init__ uses _distributed_dataset",
        ),
        fallback=True,
    ),
    # training/instrument.py, strategy_facts.distributed_variable: values before the all-reduce.
    Internal(
        f"{_TF_TRAINER}.train_step, Variable._value",
        "per_replica_metrics",
        "each replica's loss and gradients exist only inside train_step; a Keras variable's "
        "per-replica copies are those of its `_value`",
        (
            f"{_TF_TRAINER}.train_step uses _compute_loss, apply_gradients",
            "keras.src.backend.tensorflow.core:Variable._initialize uses _value",
        ),
    ),
    # tf_runtime.batch_fields: a batch op's fields, to count the examples of one pass exactly.
    Internal(
        BATCH_OP,
        "end_of_data",
        "a batch op's size, remainder rule and input, to count the examples exactly",
        (
            f"{_DATA_OPS}.batch_op:_BatchDataset.__init__ uses _batch_size, _drop_remainder, "
            "_input_dataset",
            f"{_DATA_OPS}.dataset_ops:DatasetV2 has _inputs",
        ),
        fallback=True,
    ),
    Internal(
        PIPELINE_BATCH_SIZE,
        "end_of_data",
        "TensorFlow's own reading of a pipeline's batch size",
        (f"{PIPELINE_BATCH_SIZE}(dataset)",),
        fallback=True,
    ),
    # tf_runtime.map_function: the function of an interleave/flat_map, read for file readers.
    Internal(
        f"{_DATA_OPS}: _InterleaveDataset, _ParallelInterleaveDataset, _FlatMapDataset (_map_func)",
        "file_count",
        "an interleave's function is kept only there; without it TensorFlow's auto-shard applies",
        (
            f"{_DATA_OPS}.interleave_op:_InterleaveDataset.__init__ | "
            f"{_DATA_OPS}.interleave_op:_ParallelInterleaveDataset.__init__ | "
            f"{_DATA_OPS}.flat_map_op:_FlatMapDataset.__init__ uses _map_func",
        ),
        fallback=True,
    ),
    # training/loss_scale.py: the gradients summed for LossScaleOptimizer's decision, not again.
    Internal(
        LOSS_SCALE_REDUCE,
        "loss_scale_reduce",
        "keras-sync sums the gradients before LossScaleOptimizer judges them, then passes that sum "
        "through this all-reduce",
        (
            f"{_TF_OPTIMIZER} has _all_reduce_sum_gradients",
            f"{_TF_OPTIMIZER}._backend_update_step uses _all_reduce_sum_gradients",
        ),
        fallback=True,
    ),
    # callbacks/system_metrics.py: MLflow's monitors, sampled at training steps.
    Internal(
        f"{_SYSTEM}: CPUMonitor, DiskMonitor, NetworkMonitor",
        "system_metrics",
        "MLflow samples system metrics on its own clock only",
        (
            *(
                f"{_SYSTEM}.{m.lower()}_monitor:{m}Monitor has collect_metrics, clear_metrics"
                for m in ("CPU", "Disk", "Network")
            ),
            f"{_SYSTEM}.cpu_monitor:CPUMonitor has aggregate_metrics",
        ),
    ),
)


@functools.cache
def check(internal: Internal) -> str | None:
    """What is missing for ``internal`` here, or None if its shape matches (probed once)."""
    try:
        return shape(*internal.specs)()
    except (ImportError, AttributeError) as e:
        return f"`{internal.name}` is gone ({type(e).__name__}: {e})"


def versions(internal: Internal) -> str:
    """``"Keras 3.15.1, TensorFlow 2.21.0"`` (or ``"MLflow 3.17.2"``): the internal's libraries."""
    names = ("mlflow",) if internal.name.startswith("mlflow") else ("keras", "tensorflow")
    return ", ".join(
        f"{_NAMES[m]} {getattr(importlib.import_module(m), '__version__', '?')}" for m in names
    )


def available(name: str) -> bool:
    """Whether the internal registered as ``name`` has the expected shape here (for a fallback)."""
    return check(next(i for i in REGISTRY if i.name == name)) is None


def missing(feature: str) -> tuple[Internal, str] | None:
    """The first internal (not a fallback) of ``feature`` that moved, with what is missing."""
    for internal in REGISTRY:
        if internal.feature == feature and not internal.fallback:
            what = check(internal)
            if what is not None:
                return internal, what
    return None


def require(feature: str) -> None:
    """Raise `CompatibilityError` (one line) if an internal that ``feature`` needs has moved."""
    found = missing(feature)
    if found is None:
        return
    internal, gone = found
    what, alternative = FEATURES[feature]
    library = internal.name.split(".")[0]
    why = f"keras-sync needs it for {internal.why}"
    if predates(internal):
        raise CompatibilityError(
            f"{what} needs {_NAMES[library]} >= {internal.since} (found {versions(internal)}: "
            f'{gone}; {why}). Fix: pip install "{_spec(library, internal.since)}", {alternative}.'
        )
    raise CompatibilityError(
        f"{what} cannot work with {versions(internal)}: {gone} ({why}). keras-sync is tested "
        f"with {TESTED}. Fix: {PIN[library]}, {alternative}."
    )
