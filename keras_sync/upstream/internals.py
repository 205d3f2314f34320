"""Every private Keras, TensorFlow and MLflow internal keras-sync relies on, each with a probe.

One `Internal` per feature (or fallback): the specs of the shape it relies on and the refusal when a
probe fails (None: a public fallback is taken); its user and upstream issue in the comment above it.
`require(feature)` raises the one-line `CompatibilityError`; probes run once per process.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from types import CodeType
from typing import Any

from keras_sync.errors import CompatibilityError

#: Each library: (floor, newest tested, first excluded), as pyproject.toml's ranges (a test checks).
RANGES = {
    "keras": ("3.10", "3.15", "4"),
    "tensorflow": ("2.17", "2.21", "3"),
    "mlflow": ("2.22", "3.17", "4"),
}
_NAMES = {"keras": "Keras", "tensorflow": "TensorFlow", "mlflow": "MLflow"}


def _pin(library: str, floor: str | None = None) -> str:
    """The fix that installs a tested release (from ``floor`` if given), up to the newest tested."""
    lo, newest, _ = RANGES[library]
    major, minor = newest.split(".")
    dist = "tensorflow-cpu" if library == "tensorflow" else library
    pip = f'pip install "{dist}>={floor or lo},<{major}.{int(minor) + 1}"'
    if library != "tensorflow":
        return pip
    # "tensorflow" would add a second distribution beside tensorflow-cpu.
    return f"install TensorFlow {floor or lo}-{newest} of the distribution you use (e.g. {pip})"


Probe = Callable[[], "str | None"]  # None when the shape matches, else what is missing


class Internal:
    """One feature's internals: the ``specs`` their shape must meet, what is ``refused`` without
    them (None: a fallback is taken) and the ``alternative``; ``since``: the first release that
    has them, when newer than the floor."""

    def __init__(
        self,
        name: str,
        *specs: str | Probe,
        refused: str | None = None,
        alternative: str = "",
        since: str | None = None,
    ):
        self.name, self.specs, self.since = name, specs, since
        self.refused, self.alternative = refused, alternative
        self.library = next((s for s in specs if isinstance(s, str)), name).split(".")[0]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(re.sub(r"\D.*", "", p) or 0) for p in version.split(".")[:2])


def predates(internal: Internal) -> bool:
    """Whether the installed library is older than ``internal.since`` (its absence is expected)."""
    installed = importlib.import_module(internal.library).__version__
    return internal.since is not None and _release(installed) < _release(internal.since)


def _get(path: str) -> Any:
    """``"pkg.module:Class.attr"`` -> the object; ImportError/AttributeError when it moved."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for a in attrs.split(".") if attrs else ():
        obj = getattr(obj, a)
    return obj


def _names(code: CodeType) -> set[str]:
    """Global and attribute names a function's code (and its nested functions) looks up."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, CodeType)))


def _code(path: str) -> CodeType | None:
    try:
        return inspect.unwrap(_get(path)).__code__
    except (ImportError, AttributeError):
        return None


def _spec_fails(spec: str) -> str | None:
    """What does not match a spec: ``"path(a, b)"`` (its first parameters), ``"path | path uses a,
    b"`` (the functions' code, together, looks a and b up), ``"path has a, b"`` (attributes)."""
    if spec.endswith(")"):
        path, _, params = spec[:-1].partition("(")
        want, got = params.split(", "), list(inspect.signature(_get(path)).parameters)
        got = got[: len(want)]
        return None if got == want else f"`{path}` takes {got}, not {want}"
    if " uses " in spec:
        paths, _, names = spec.partition(" uses ")
        codes = {path: _code(path) for path in paths.split(" | ")}
        existing = [path for path, code in codes.items() if code is not None]
        if not existing:
            _get(paths.split(" | ")[0])  # raises: reported as gone
        found = set().union(*(_names(code) for code in codes.values() if code is not None))
        missing = [n for n in names.split(", ") if n not in found]
        return f"`{' / '.join(existing)}` no longer uses {missing}" if missing else None
    path, _, attrs = spec.partition(" has ")
    missing = [a for a in attrs.split(", ") if not hasattr(_get(path), a)]
    return f"`{path}` has no {missing}" if missing else None


TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_TRAINER = f"{TRAINER}:TensorFlowTrainer"
_EPOCH = "keras.src.trainers.epoch_iterator:EpochIterator"
CONTEXT = "tensorflow.python.eager.context"
_COORDINATION = f"{CONTEXT}:coordination_config_pb2.CoordinationServiceConfig"
CARS = "tensorflow.python.distribute.collective_all_reduce_strategy"
_DATA_OPS = "tensorflow.python.data.ops"
_SYSTEM = "mlflow.system_metrics.metrics"
_SYMBOLIC_BUILD = f"{_TF_TRAINER}._maybe_symbolic_build(self, iterator, data_batch)"
LOSS = "keras.src.losses.loss"
_MAKE_FUNCTION = f"{_TF_TRAINER}._make_function"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"
# Fallback entries, by name: a public path (or nothing) is taken when their probe fails.
END_OF_DATA, BARRIER, GLOBAL_SEED = "end_of_data", "coordination_barrier", "global_seed"
EPOCH_ITERATOR_RESET, SAME_DATA_ORDER = "iterator_reset", "same_data_order"
DATASET_GRAPH, SUMS_PASS_THROUGH = "dataset_graph", "sums_pass_through"
MASKED_LOSS = "masked_loss"


def _end_of_data() -> str | None:
    consts = inspect.unwrap(_get(_MAKE_FUNCTION)).__code__.co_consts
    codes = [c for c in consts if isinstance(c, CodeType) and c.co_name == "function"]
    if not codes or "one_step_on_data" not in codes[0].co_freevars:
        return f"`{_MAKE_FUNCTION}` no longer returns a `function` closing over `one_step_on_data`"
    return None


def _is_mwms() -> str | None:
    import tensorflow as tf

    if _get(f"{CARS}:CollectiveAllReduceStrategy") is tf.distribute.MultiWorkerMirroredStrategy:
        return None
    return "`CollectiveAllReduceStrategy` is no longer `tf.distribute.MultiWorkerMirroredStrategy`"


def _coordination_fields(*names: str) -> Probe:
    """Probe: the config TF builds in `configure_coordination_service` has ``names``."""

    def probe() -> str | None:
        missing = [f for f in names if f not in _get(_COORDINATION).DESCRIPTOR.fields_by_name]
        return f"TensorFlow's coordination service config has no {missing}" if missing else None

    return probe


_ONE_WORKER = "or train on one worker (strategy.kind: mirrored)"
REGISTRY: tuple[Internal, ...] = (
    # keras_fixes.multi_worker_patches 1, 2: keras-team/keras#20585 (fit under MWMS).
    Internal(
        "multi_worker_fit",
        f"{TRAINER}:reduce_per_replica(values, strategy, reduction)",
        f"{TRAINER} has _is_tpu_strategy, _is_per_replica_instance, _is_scalar",
        f"{_TF_TRAINER}.make_train_function | {_MAKE_FUNCTION} uses reduce_per_replica",
        _SYMBOLIC_BUILD,
        refused="`fit` on several workers",
        alternative=_ONE_WORKER,
    ),
    # keras_fixes fix 3: keras-team/keras#19246 (steps_per_execution > 1 under MWMS), inlined step.
    Internal(
        "multi_worker_steps_per_execution",
        f"{_TF_TRAINER}._autoconvert_optionals(self, step_func)",
        f"{_MAKE_FUNCTION} uses _autoconvert_optionals, function, steps_per_execution, while_loop",
        refused="steps_per_execution > 1 on several workers",
        alternative="or set runtime.steps_per_execution: 1",
        since="3.12",
    ),
    # keras_fixes.end_of_data_patches: keras-team/keras#23179, no step past the end of data.
    Internal(END_OF_DATA, f"{_MAKE_FUNCTION}(self, step_function)", _end_of_data),
    # keras_fixes.iterator_release_patches: the iterator `reset` drops, destroyed mid-read, crashes.
    Internal(EPOCH_ITERATOR_RESET, f"{_EPOCH}.reset uses _current_iterator, _epoch_iterator"),
    # multi_worker.py: local devices (TF's TODO b/126786766), a bounded join (tensorflow#60706).
    Internal(
        "multi_worker_strategy",
        f"{CARS}:CollectiveAllReduceExtended._initialize_local_devices(self, cluster_resolver, "
        "worker_device)",
        f"{CARS}:CollectiveAllReduceExtended.__init__(self, container_strategy, cluster_resolver, "
        "communication_options)",
        f"{CARS}:CollectiveAllReduceExtended._in_multi_worker_mode(self)",
        _is_mwms,
        f"{CONTEXT}:Context.configure_coordination_service(self, service_type, service_leader)",
        "tensorflow.python.distribute.multi_worker_util has is_chief, worker_count, "
        "normalize_cluster_spec, coordination_leader",
        _coordination_fields("coordinated_job_list", "cluster_register_timeout_in_ms"),
        refused="multi_worker_mirrored with local devices and strategy.connect_timeout_s",
        alternative=_ONE_WORKER,
    ),
    Internal(
        BARRIER, f"{CONTEXT} has context", _coordination_fields("cluster_register_with_barrier")
    ),
    Internal(
        "joined_cluster",
        f"{CONTEXT} has context_safe",
        f"{CONTEXT}:Context.__init__ | {CONTEXT}:Context.enable_collective_ops uses "
        "_server_def, _collective_ops_server_def",
    ),
    # epoch_iterator.py: no API starts an epoch mid-way; `model._initial_epoch` as Keras's backup.
    Internal(
        "exact_resume",
        f"{TRAINER}:TFEpochIterator has _enumerate_iterator, catch_stop_iteration",
        f"{_EPOCH}.__init__ uses _num_batches",
        f"{_TF_TRAINER}.fit uses TFEpochIterator, _initial_epoch",
        refused="exact mid-epoch resume",
        alternative="or remove fault_tolerance.backup_dir",
    ),
    # tf_runtime.py: whether tf.random.set_seed was called (no public API tells).
    Internal(GLOBAL_SEED, f"{CONTEXT} has global_seed"),
    # strategy_facts.built_under: `model.distribute_strategy` falls back to the current strategy.
    Internal(
        "model_strategy",
        f"{_TF_TRAINER}.__init__ uses _distribute_strategy",
        refused="telling which strategy built a model",
        alternative="or set strategy.kind: default",
    ),
    # backup_and_restore.py: Keras's BackupAndRestore writes on the chief only.
    Internal(
        "keras_backup_guard",
        "keras.src.callbacks.backup_and_restore:BackupAndRestore has _save_model",
        "keras.src.callbacks.backup_and_restore:BackupAndRestore.__init__ uses _weights_path",
        refused="Keras's BackupAndRestore on several workers",
        alternative="or use keras-sync's backup (fault_tolerance.backup_dir)",
    ),
    # replica_seeds.py: each Keras random op's seed folded with the replica id (no public hook).
    Internal(
        "replica_random_streams",
        " | ".join(
            f"keras.src.backend.tensorflow.random:{op}"
            for op in ("normal", "uniform", "dropout", "randint", "truncated_normal", "categorical")
        )
        + " uses _cast_seed",
        refused="independent random draws on each replica",
        alternative="or train on one replica (strategy.kind: default)",
    ),
    # keras_losses.py: Keras divides every loss by the replica count (keras-team/keras#14104).
    Internal(
        "evaluate_loss",
        f"{LOSS} has scale_loss_for_distribution, unscale_loss_for_distribution, reduce_values",
        f"{LOSS}:reduce_values uses scale_loss_for_distribution",
        refused="the loss a custom test_step reports on several replicas",
        alternative="or multiply the loss your test_step tracks by the replica count",
    ),
    # train_step_trace: a masked loss's mean over the tokens of the whole step, not of one replica.
    Internal(
        MASKED_LOSS,
        f"{LOSS}:reduce_weighted_values(values, sample_weight, mask, reduction, dtype)",
        f"{LOSS}:Loss.__call__ uses reduce_weighted_values",
    ),
    # keras_fixes.same_data_order_patches: shapes from the element_spec, not an extra iterator.
    Internal(
        SAME_DATA_ORDER,
        _SYMBOLIC_BUILD,
        f"{TRAINER}:TFEpochIterator.__init__ uses _distributed_dataset",
    ),
    # training/instrument.py, strategy_facts: each replica's loss and gradients, before the reduce.
    Internal(
        "per_replica_metrics",
        f"{_TF_TRAINER}.train_step uses _compute_loss, apply_gradients",
        "keras.src.backend.tensorflow.core:Variable._initialize uses _value",
        refused="per-replica loss and gradient norm",
        alternative="or set mlflow.enabled: false",
    ),
    # tf_runtime.py: batch ops, TF's batch size and file readers, to count a pass's examples.
    Internal(
        DATASET_GRAPH,
        f"{_DATA_OPS}.batch_op:_BatchDataset.__init__ uses _batch_size, _drop_remainder, "
        "_input_dataset",
        f"{_DATA_OPS}.dataset_ops:DatasetV2 has _inputs",
        "tensorflow.python.data.experimental.ops.distribute:compute_batch_size(dataset)",
        f"{_DATA_OPS}.interleave_op:_InterleaveDataset.__init__ | "
        f"{_DATA_OPS}.interleave_op:_ParallelInterleaveDataset.__init__ | "
        f"{_DATA_OPS}.flat_map_op:_FlatMapDataset.__init__ uses _map_func",
    ),
    # keras_fixes.sums_pass_through: gradients summed once, before the optimizer clips or skips.
    Internal(
        SUMS_PASS_THROUGH,
        f"{_TF_OPTIMIZER}._backend_update_step uses _all_reduce_sum_gradients",
        f"{_TF_OPTIMIZER} has _all_reduce_sum_gradients",
    ),
    # callbacks/system_metrics.py: MLflow samples system metrics on its own clock only.
    Internal(
        "system_metrics",
        *(
            f"{_SYSTEM}.{m.lower()}_monitor:{m}Monitor has collect_metrics, clear_metrics"
            for m in ("CPU", "Disk", "Network")
        ),
        f"{_SYSTEM}.cpu_monitor:CPUMonitor has aggregate_metrics",
        refused="MLflow system metrics",
        alternative="or set mlflow.system_metrics: false",
    ),
    # mlflow_internals.autologging: whether mlflow.keras.autolog() is on (no documented getter).
    Internal(
        "autolog_state",
        "mlflow.utils.autologging_utils has autologging_is_disabled, get_autologging_config, "
        "disable_autologging",
        refused="telling whether mlflow.keras.autolog() is on",
        alternative="or leave autolog off",
    ),
)


@functools.cache
def check(internal: Internal) -> str | None:
    """What is missing for ``internal`` here (the first spec that fails), None if nothing."""
    for spec in internal.specs:
        try:
            failed = spec() if callable(spec) else _spec_fails(spec)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            where = internal.name if callable(spec) else re.split(r"\(| has | uses | \| ", spec)[0]
            failed = f"`{where}` is gone ({type(e).__name__}: {e})"
        if failed:
            return failed
    return None


def _entry(name: str) -> Internal:
    return next(i for i in REGISTRY if i.name == name)


def missing(name: str) -> str | None:
    """What the internals registered as ``name`` lack here, None if nothing."""
    return check(_entry(name))


def available(name: str) -> bool:
    """Whether the internals registered as ``name`` have the expected shape here."""
    return missing(name) is None


def require(feature: str) -> None:
    """Raise `CompatibilityError` (one line) if an internal that ``feature`` needs has moved."""
    internal, gone = _entry(feature), missing(feature)
    if gone is None:
        return
    libraries = ("mlflow",) if internal.library == "mlflow" else ("keras", "tensorflow")
    versions = ", ".join(f"{_NAMES[m]} {importlib.import_module(m).__version__}" for m in libraries)
    fix = _pin(internal.library, internal.since if predates(internal) else None)
    raise CompatibilityError(
        f"{internal.refused} cannot work with {versions}: {gone}. Fix: {fix}, {internal.alternative}."
    )
