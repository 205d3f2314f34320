"""The keras-sync config: a tree of frozen dataclasses and the one loader that builds it.

The YAML file is read here and nowhere else, keeping node marks for line numbers. Precedence
(printed by ``keras-sync plan``): flag > environment (`ENV_KEYS`) > YAML file > default. Every
problem becomes a `ConfigIssue` (``file:line``, key path, value, what is allowed); all problems
of one file are raised together in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from keras_sync.cluster import CLUSTER_SOURCES
from keras_sync.config.kinds import KINDS, STRATEGY_KINDS, kinds_where
from keras_sync.config.limits import MAX_FILE_BYTES, SizeCounter, check_data, file_size_issue
from keras_sync.config.specs import (
    AutoOrBool,
    Bool,
    Choice,
    FieldValueError,
    Float,
    Int,
    Spec,
    Str,
    StrList,
    WordOrInt,
)
from keras_sync.errors import ConfigError, ConfigIssue

DEFAULT_CONFIG_FILE = "keras_sync.yaml"
CONFIG_ENV = "KERAS_SYNC_CONFIG"

#: Environment variables that set a config key (they win over the file, lose to a flag).
ENV_KEYS = {"MLFLOW_TRACKING_URI": "mlflow.tracking_uri", "KERAS_SYNC_JOB_ID": "mlflow.job_id"}
#: `keras-sync verify`: the folder `sync.fit` records its first steps to, the recording a
#: one-device reference replays, and how many optimizer steps.
VERIFY_RECORD_ENV = "KERAS_SYNC_VERIFY_RECORD"
VERIFY_REPLAY_ENV = "KERAS_SYNC_VERIFY_REPLAY"
VERIFY_STEPS_ENV = "KERAS_SYNC_VERIFY_STEPS"
#: The file of a recording that holds the reference run's config overrides (dotted keys).
VERIFY_OVERRIDES_FILE = "reference.json"


@dataclass(frozen=True)
class VerifyRequest:
    """What `keras-sync verify` asked of this process: record the first ``steps`` optimizer steps of
    `sync.fit` to ``record_dir``; with ``replay_dir``, as the one-device reference of that recording."""

    record_dir: str
    steps: int = 20
    replay_dir: str | None = None
    #: The config's own mlflow.enabled (a verify run logs nothing itself; the command logs the comparison).
    mlflow: bool = True


def _f(default: Any, spec: Spec, doc: str, key: str | None = None, kinds: Any = None) -> Any:
    """A config key. `doc` is its one description, shown by errors, schema, template and reference;
    `kinds`: the strategy kinds a `strategy.*` key applies to."""
    return field(default=default, metadata={"spec": spec, "doc": doc, "key": key, "kinds": kinds})


def _sub(
    cls: type, doc: str, note: str | None = None, kinds: Any = None, commented: bool = False
) -> Any:
    """A section. `note`: a comment the template prints above its keys; `commented`: the template
    shows the whole section as comments (its defaults change nothing)."""
    meta = {"doc": doc, "key": None, "note": note, "kinds": kinds, "commented": commented}
    return field(default_factory=cls, metadata=meta)


def _internal(repr: bool = False, **kw: Any) -> Any:
    """A field of the built config that no file sets (where it came from, the verify request)."""
    return field(compare=False, repr=repr, metadata={"internal": True}, **kw)


_MWM = kinds_where(multi_process=True)
#: `strategy.communication`: tf.distribute.experimental.CommunicationImplementation's names, lower case.
COMMUNICATIONS = ("auto", "ring", "nccl")
#: `learning_rate.scaling`: the rules `keras_sync.training.scaling.scale_learning_rate` applies.
LR_RULES = ("linear", "sqrt", "none")
_OPT_STR = Str(nullable=True)
_OPT_COUNT = Int(minimum=1, nullable=True)


@dataclass(frozen=True)
class TPUConfig:
    """Where the TPU is: a name or grpc:// address (`local` for a TPU VM), zone and project."""

    name: str | None = _f(
        "local", _OPT_STR, "'local' on a TPU VM, else the TPU's name or grpc:// address"
    )
    zone: str | None = _f(None, _OPT_STR, "GCE zone of the TPU (Cloud TPU only)")
    project: str | None = _f(None, _OPT_STR, "GCP project of the TPU (Cloud TPU only)")


@dataclass(frozen=True)
class IndexedJobConfig:
    """Workers of a Kubernetes Indexed Job or JobSet: worker i is `hosts` with {index} = i."""

    hosts: str | None = _f(
        None,
        _OPT_STR,
        "worker i's host (or host:port) with {index} = i, e.g. "
        "train-{index}.train (<Job>-{index}.<headless Service>)",
        kinds=_MWM,
    )
    port: int = _f(
        2222,
        Int(minimum=1),
        "the port every worker listens on (when `hosts` names none)",
        kinds=_MWM,
    )
    workers: int | None = _f(
        None, _OPT_COUNT, "number of workers (the Job's completions)", kinds=_MWM
    )


@dataclass(frozen=True)
class SlurmConfig:
    """Ports of a Slurm job step's workers: task i on a node listens on `port_base` + i."""

    port_base: int | str = _f(
        "auto",
        WordOrInt(word="auto", unit="the first port"),
        "task i on a node listens on "
        "port_base + i; auto: a block of 16 ports in 10000-31775 chosen by $SLURM_JOB_ID and "
        "$SLURM_STEP_ID, so jobs and steps that share a node do not collide",
        kinds=_MWM,
    )


@dataclass(frozen=True)
class StrategyConfig:
    """Which `tf.distribute` strategy to build, and its options."""

    kind: str = _f(
        "auto",
        Choice(values=STRATEGY_KINDS),
        "which strategy; auto picks by the hardware and TF_CONFIG",
        kinds=STRATEGY_KINDS,
    )
    devices: tuple[str, ...] = _f(
        (),
        StrList(),
        "e.g. ['/gpu:0', '/gpu:1']; empty = all GPUs (one_device: the first), else the CPU",
        kinds=tuple(k for k in kinds_where(accepts_devices=True) if k != "auto"),
    )
    simulated_cpu_replicas: int = _f(
        0,
        Int(minimum=0),
        "> 0: split the CPU into N logical devices, one replica each (per worker)",
        kinds=kinds_where(simulated_cpus=True),
    )
    cross_device_ops: str = _f(
        "auto",
        Choice(values=("auto", "nccl", "hierarchical_copy", "reduction_to_one")),
        "how local gradients are all-reduced: auto, nccl, hierarchical_copy or "
        "reduction_to_one (no NCCL on CPU)",
        kinds=("mirrored",),
    )
    communication: str = _f(
        "auto",
        Choice(values=COMMUNICATIONS),
        "collective implementation: auto, ring or nccl",
        kinds=_MWM,
    )
    cluster: str = _f(
        "tf_config",
        Choice(values=tuple(CLUSTER_SOURCES)),
        "where the workers are: "
        "tf_config ($TF_CONFIG), slurm (srun's environment) or indexed_job (a Kubernetes "
        "Indexed Job or JobSet: $JOB_COMPLETION_INDEX and strategy.indexed_job)",
        kinds=_MWM,
    )
    connect_timeout_s: float = _f(
        300.0,
        Float(minimum=0, exclusive=True),
        "seconds to wait for all workers to join, then fail naming the missing ones",
        kinds=("auto", *_MWM),
    )
    tpu: TPUConfig = _sub(TPUConfig, "TPU address", kinds=("tpu",))
    indexed_job: IndexedJobConfig = _sub(
        IndexedJobConfig, "worker addresses when cluster is indexed_job", kinds=_MWM
    )
    slurm: SlurmConfig = _sub(SlurmConfig, "worker ports when cluster is slurm", kinds=_MWM)


@dataclass(frozen=True)
class BatchConfig:
    """Batch size, given per replica or globally (exactly one), and how data is split."""

    per_replica: int | None = _f(32, _OPT_COUNT, "examples per replica per step")
    global_: int | None = _f(None, _OPT_COUNT, "examples per step over all replicas", key="global")
    drop_remainder: str | bool = _f(
        "auto",
        AutoOrBool(),
        "drop the last partial batch; auto = true on TPU (static shapes), false elsewhere",
    )
    shard_policy: str = _f(
        "auto",
        Choice(values=("auto", "data", "file", "off"), bool_aliases=((False, "off"),)),
        "tf.data auto-shard of datasets without their own policy: auto, data, file or off (arrays: always by example)",
    )


@dataclass(frozen=True)
class LearningRateConfig:
    """The base learning rate and how it scales with the global batch."""

    base: float = _f(
        0.1, Float(minimum=0, exclusive=True), "the learning rate tuned for base_batch_size"
    )
    base_batch_size: int | None = _f(
        None,
        _OPT_COUNT,
        "the batch `base` was tuned for; null = the per-replica batch",
    )
    scaling: str = _f(
        "linear",
        Choice(values=LR_RULES),
        "linear (Goyal et al. 2017), sqrt or none: how the rate follows the global batch",
    )
    warmup_epochs: float = _f(
        0.0,
        Float(minimum=0),
        "ramp from base to the scaled rate over N epochs (or warmup_steps, not both)",
    )
    warmup_steps: int = _f(
        0,
        Int(minimum=0),
        "ramp from base to the scaled rate over N optimizer steps (or warmup_epochs)",
    )


@dataclass(frozen=True)
class MlflowConfig:
    """Where sync metrics go."""

    enabled: bool = _f(True, Bool(), "log sync metrics to MLflow (only the chief writes)")
    tracking_uri: str | None = _f(
        None,
        _OPT_STR,
        "MLflow tracking URI; $MLFLOW_TRACKING_URI wins over it; null = sqlite:///<cwd>/mlflow.db",
    )
    experiment: str = _f("keras-sync", Str(), "MLflow experiment name")
    run_name: str | None = _f(None, _OPT_STR, "MLflow run name; null = generated")
    job_id: str | None = _f(
        None,
        Str(
            nullable=True,
            pattern=r"[\w.:/@+\-]{1,250}",
            pattern_doc="1-250 letters, digits or _.:/@+-",
        ),
        "runs with the same job id share one MLflow run; $KERAS_SYNC_JOB_ID wins over it; "
        "null = a new run per job (a relaunch that restores a backup continues its run)",
    )
    spool_dir: str = _f(
        ".keras_sync_spool",
        Str(),
        "where metrics wait for delivery to MLflow (relative to the cwd)",
    )
    log_every_n_steps: int | str = _f(
        "auto",
        WordOrInt(word="auto", unit="steps"),
        "log step metrics every N optimizer "
        "steps; auto: at most 10 points a second, and each epoch's last step; a point "
        "for several steps adds their peaks (sync/window_max/*)",
    )
    allreduce_probe: bool = _f(
        False, Bool(), "time one all-reduce of the gradients' size at train start"
    )
    system_metrics: bool = _f(
        False,
        Bool(),
        "MLflow's system metrics (CPU, memory, disk, network, GPU) as system/*, every 10 s",
    )
    log_model: bool = _f(
        False,
        Bool(),
        "log the trained model (MLflow Keras flavour, chief only) at the end of each fit",
    )
    sync_report: str = _f(
        "end",
        Choice(values=("end", "epoch", "off"), bool_aliases=((False, "off"),)),
        "sync_report.png, replicas overlaid: at the end of each fit, also after every epoch, "
        "or off",
    )


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Backup and exact resume after a worker is killed."""

    backup_dir: str | None = _f(
        None,
        _OPT_STR,
        "a directory turns on BackupAndRestore (exact resume after a kill); null = off",
    )
    save_freq: str | int = _f(
        "epoch", WordOrInt(word="epoch", unit="batches"), "epoch, or back up every N batches"
    )
    grace_period_s: float = _f(
        25.0,
        Float(minimum=0, exclusive=True),
        "after SIGTERM (preemption): seconds to save a backup on every worker and exit 143; keep it under "
        "the scheduler's grace",
    )


@dataclass(frozen=True)
class RuntimeConfig:
    """How the training step runs, applied to the user's compiled model by `Sync.fit`."""

    mixed_precision: str = _f(
        "none",
        Choice(
            values=("none", "mixed_float16", "mixed_bfloat16"),
            bool_aliases=((False, "none"),),
            hints=(
                ("fp16", "mixed_float16"),
                ("float16", "mixed_float16"),
                ("half", "mixed_float16"),
                ("bf16", "mixed_bfloat16"),
                ("bfloat16", "mixed_bfloat16"),
            ),
        ),
        "dtype policy set by load(): none, mixed_float16 (loss scaling), mixed_bfloat16",
    )
    jit_compile: str | bool = _f(
        "auto", AutoOrBool(), "XLA for the train step: true, false, or auto (keep compile's)"
    )
    steps_per_execution: int = _f(1, Int(minimum=1), "train steps per tf.function call")
    gradient_accumulation_steps: int = _f(
        1,
        Int(minimum=1),
        "one optimizer update every N micro-batches (effective batch = global x N)",
    )
    sync_batch_norm: bool = _f(
        False, Bool(), "BatchNormalization statistics over all replicas (synchronized)"
    )
    train_step_gradients: str = _f(
        "auto",
        Choice(values=("auto", "average", "sum")),
        "custom train_step: average replicas' gradients (auto: if its loss is not divided) or sum",
    )


@dataclass(frozen=True)
class ChecksConfig:
    """What keras-sync checks of every fit at run time (examples per step and epoch, resume, learning rate)."""

    on_violation: str = _f(
        "warn",
        Choice(values=("warn", "error")),
        "a failed check: warn (one line on the chief + an MLflow tag) or error (stop the fit with that line)",
    )


@dataclass(frozen=True)
class Config:
    """The whole keras-sync config. Build it with `load_config`."""

    strategy: StrategyConfig = _sub(StrategyConfig, "distribution strategy")
    batch: BatchConfig = _sub(
        BatchConfig,
        "batch sizes",
        note=(
            "Give exactly one of per_replica / global (the other null); keras-sync derives the other from the "
            "replica count: global = per_replica x replicas."
        ),
    )
    learning_rate: LearningRateConfig = _sub(LearningRateConfig, "learning-rate scaling and warmup")
    mlflow: MlflowConfig = _sub(MlflowConfig, "MLflow tracking")
    fault_tolerance: FaultToleranceConfig = _sub(FaultToleranceConfig, "backup and resume")
    checks: ChecksConfig = _sub(ChecksConfig, "run-time checks of every fit")
    runtime: RuntimeConfig = _sub(
        RuntimeConfig,
        "how the train step runs",
        commented=True,
        note=(
            "Applied by sync.fit to your compiled model; a key left at its default keeps what your "
            "model.compile(...) set."
        ),
    )
    source: str = _internal(default="<defaults>", repr=True)
    text: str | None = _internal(default=None)
    provenance: Mapping[str, str] = _internal(default_factory=dict)
    #: Set by ``$KERAS_SYNC_VERIFY_RECORD`` (`keras-sync verify`); None for a normal run.
    verify: VerifyRequest | None = _internal(default=None)

    def source_of(self, key_path: str) -> str:
        """Where a value came from: ``flag``, ``env``, ``file``, ``dict`` or ``default``."""
        return self.provenance.get(key_path, "default")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able data, with the public key names."""
        return _to_dict(self)

    def origin(self) -> str:
        """Which config this is, in words: the file's absolute path, or why the defaults are used
        (`keras_sync.load` prints it, so a script run from elsewhere does not use them silently)."""
        if self.source == "<defaults>":
            return (
                f"no {DEFAULT_CONFIG_FILE} found in {Path.cwd()} and ${CONFIG_ENV} is unset: built-in "
                "defaults (pass a path to keras_sync.load(), or run from the directory of the file)"
            )
        if self.source == "<dict>":
            return "a dict passed to keras_sync.load() (no file)"
        return str(Path(self.source).resolve())


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _public_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in fields(cls) if not f.metadata.get("internal")]


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in _public_fields(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _to_dict(value)
        out[_yaml_key(f)] = list(value) if isinstance(value, tuple) else value
    return out


def _error(file: str, line: int | None, message: str, key_path: str = "") -> ConfigError:
    return ConfigError(ConfigIssue(file, line, key_path, message))


# Reading: YAML text -> (data, line of every key path)


def _parse_yaml(text: str, file: str) -> tuple[Any, dict[str, int]]:
    """safe_load the text and map every key path to its 1-based line."""
    import yaml

    lines: dict[str, int] = {}
    sizes = SizeCounter(file)
    paths: list[str] = []  # the key path of each node being composed: the ancestors of the next one

    class _Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            # Aliases are refused: nested ones (a "billion laughs" file) expand exponentially.
            if isinstance(event, yaml.AliasEvent):
                a = event.anchor
                raise _error(
                    file,
                    event.start_mark.line + 1,  # type: ignore[union-attr]
                    f"YAML alias *{a} not allowed; keras-sync reads plain YAML only: write the value "
                    f"out instead of *{a} (and drop the anchor &{a})",
                )
            # Sizes are checked before a node is composed: the composer recurses once per level.
            path, key = paths[-1] if paths else "", None
            if isinstance(parent, yaml.MappingNode):
                name = index.value if isinstance(index, yaml.ScalarNode) else "?"
                if index is None:  # this node is a key
                    name = key = event.value if isinstance(event, yaml.ScalarEvent) else "?"
                path = f"{path}.{name}" if path else name
            elif isinstance(parent, yaml.SequenceNode):
                path = f"{path}[{index}]"
            is_collection = isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
            sizes.node(
                path,
                len(paths) + is_collection,
                event.start_mark.line + 1,
                collection=is_collection,
                entry=key is not None or isinstance(parent, yaml.SequenceNode),
                key=key,
                string=event.value if isinstance(event, yaml.ScalarEvent) and key is None else None,
            )
            paths.append(path)
            try:
                return super().compose_node(parent, index)
            finally:
                paths.pop()

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
        items = [
            (loader.construct_object(k, deep=True), loader.construct_object(v, deep=True), k)
            for k, v in node.value
        ]
        return {"__line__": node.start_mark.line + 1, "__items__": items}

    def construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
        try:
            return yaml.SafeLoader.construct_yaml_int(loader, node)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits())
            raise _error(
                file,
                node.start_mark.line + 1,
                f"a number of {len(node.value):,} digits, more than Python reads; the config's "
                "numbers are small: shorten it",
            ) from None

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    _Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        if isinstance(exc, yaml.constructor.ConstructorError):
            msg = f"YAML tag not allowed ({exc.problem}); keras-sync reads plain YAML only: remove the '!!' tag"
            raise _error(file, line, msg) from None
        problem = getattr(exc, "problem", None) or str(exc)
        raise _error(file, line, f"YAML syntax error: {problem}") from None

    dups: list[ConfigIssue] = []

    def unwrap(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [unwrap(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not (isinstance(node, dict) and "__items__" in node):
            return node
        lines.setdefault(path, node["__line__"])
        out: dict[Any, Any] = {}
        for k, v, key_node in node["__items__"]:
            key_path, line = f"{path}.{k}" if path else str(k), key_node.start_mark.line + 1
            if k in out:
                msg = f"duplicate key {k!r} (first at line {lines[key_path]}); keep one of them"
                dups.append(ConfigIssue(file, line, key_path, msg))
            lines.setdefault(key_path, line)
            out[k] = unwrap(v, key_path)
        return out

    data = unwrap(raw, "")
    if dups:
        raise ConfigError(dups)
    return data, lines


# Validation: data -> dataclasses, collecting every issue


class _Builder:
    def __init__(self, file: str, lines: Mapping[str, int]):
        self.file, self.lines = file, lines
        self.issues: list[ConfigIssue] = []

    def issue(self, key_path: str, message: str) -> None:
        """Record an issue at the line of ``key_path``, else of its nearest parent in the file."""
        parent = key_path
        while parent not in self.lines and "." in parent:
            parent = parent.rsplit(".", 1)[0]
        line = self.lines.get(parent, self.lines.get(""))
        self.issues.append(ConfigIssue(self.file, line, key_path, message))

    def build(self, cls: type, data: Any, path: str) -> Any:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            where = path or "top level"
            msg = f"received {type(data).__name__} {data!r} at the {where}, expected a mapping of keys"
            self.issue(path, msg)
            return cls()
        by_key = {_yaml_key(f): f for f in _public_fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            key_path = f"{path}.{key}" if path else str(key)
            f = by_key.get(key) if isinstance(key, str) else None
            if f is None:
                close = difflib.get_close_matches(str(key), list(by_key), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.issue(key_path, f"unknown key {key!r}{hint} (allowed: {', '.join(by_key)})")
            elif (spec := f.metadata.get("spec")) is None:  # a section: its class is the factory
                kwargs[f.name] = self.build(f.default_factory, value, key_path)  # type: ignore[arg-type]
            else:
                try:
                    kwargs[f.name] = spec.check(value)
                except FieldValueError as exc:
                    self.issue(key_path, str(exc))
        return cls(**kwargs)


def _check_consistency(cfg: Config, b: _Builder, given: Mapping[str, Any]) -> Config:
    """The rules between keys; returns the config with per_replica cleared when global is given."""
    batch = cfg.batch
    per_given = given.get("batch.per_replica") is not None
    global_given = given.get("batch.global") is not None
    if per_given and global_given:
        b.issue(
            "batch.global",
            f"received batch.per_replica={batch.per_replica} and batch.global={batch.global_}; "
            "give exactly one of them (set the other to null or remove it)",
        )
    elif global_given:
        batch = dataclasses.replace(batch, per_replica=None)
    elif batch.per_replica is None:
        b.issue(
            "batch.per_replica",
            "received null for both batch.per_replica and batch.global; give exactly one",
        )
    lr = cfg.learning_rate
    if lr.warmup_epochs and lr.warmup_steps:
        b.issue(
            "learning_rate.warmup_steps",
            f"received warmup_epochs={lr.warmup_epochs:g} and warmup_steps={lr.warmup_steps}; "
            "give one of them (set the other to 0)",
        )
    s = cfg.strategy
    spec = KINDS[s.kind]
    if s.devices and not spec.accepts_devices:
        named = " and ".join(k for k in kinds_where(accepts_devices=True) if k != "auto")
        b.issue(
            "strategy.devices",
            f"received devices={list(s.devices)} with kind={s.kind}; devices applies to "
            f"{named} only (remove it, or use simulated_cpu_replicas)",
        )
    if spec.max_devices is not None and len(s.devices) > spec.max_devices:
        b.issue(
            "strategy.devices",
            f"received {len(s.devices)} devices for kind={s.kind}; give at most {spec.max_devices}",
        )
    if s.devices and s.simulated_cpu_replicas:
        b.issue(
            "strategy.simulated_cpu_replicas",
            "received both devices and simulated_cpu_replicas; give one "
            "(simulated replicas make their own logical CPU devices)",
        )
    if s.simulated_cpu_replicas and not spec.simulated_cpus:
        b.issue(
            "strategy.simulated_cpu_replicas",
            f"simulated_cpu_replicas does not apply to kind={s.kind}; "
            f"remove it (it applies to {', '.join(kinds_where(simulated_cpus=True))})",
        )
    acc, save_freq = cfg.runtime.gradient_accumulation_steps, cfg.fault_tolerance.save_freq
    if acc > 1 and isinstance(save_freq, int) and save_freq % acc:
        # A backup between two optimizer updates would lose the gradients accumulated so far.
        b.issue(
            "fault_tolerance.save_freq",
            f"received save_freq={save_freq} with runtime.gradient_accumulation_steps={acc}; "
            f"back up at optimizer updates: use a multiple of {acc} "
            f"(e.g. {save_freq - save_freq % acc or acc}) or 'epoch'",
        )
    job = s.indexed_job
    if s.cluster == "indexed_job":
        for key, value in (("hosts", job.hosts), ("workers", job.workers)):
            if value is None:
                b.issue(
                    f"strategy.indexed_job.{key}",
                    "received null with strategy.cluster=indexed_job; set it "
                    "(hosts: a pattern such as train-{index}.train; workers: the Job's completions)",
                )
        if job.hosts is not None and "{index}" not in job.hosts:
            b.issue(
                "strategy.indexed_job.hosts",
                f"received {job.hosts!r}, which has no {{index}}; expected a pattern "
                "that gives each worker its own host, such as train-{index}.train",
            )
        if job.port > 65535:
            msg = f"received {job.port}, expected a TCP port from 1 to 65535"
            b.issue("strategy.indexed_job.port", msg)
    if isinstance(s.slurm.port_base, int) and s.slurm.port_base > 65535 - 15:
        b.issue(
            "strategy.slurm.port_base",
            f"received {s.slurm.port_base}, expected a TCP port from 1 to 65520 (task i "
            "on a node takes port_base + i) or 'auto'",
        )
    return dataclasses.replace(cfg, batch=batch)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items() if isinstance(data, dict) else ():
        path = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, path))
        out[path] = v
    return out


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Set a dotted key path in nested dicts (made where missing); returns ``data``."""
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value
    return data


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build and validate the config.

    Args:
        source: a YAML file path, a dict in the same shape, or None: then ``$KERAS_SYNC_CONFIG``,
            else ``./keras_sync.yaml`` if it exists, else the defaults.
        overrides: dotted key paths (``{"batch.per_replica": 64}``), e.g. from command-line flags;
            they win over everything else.
        environ: the environment to read (default ``os.environ``), for `ENV_KEYS`.

    Raises:
        ConfigError: with every issue found, each naming file, line, key path, value and fix.
    """
    env = os.environ if environ is None else environ
    text: str | None = None
    lines: dict[str, int]
    if source is None:
        source = env.get(CONFIG_ENV) or (
            DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).is_file() else None
        )
    if source is None:
        file, data, lines, origin = "<defaults>", {}, {}, "default"
    elif isinstance(source, Mapping):
        check_data(source, "<dict>")
        file, data, lines, origin = "<dict>", _plain(source), {}, "dict"
    else:
        file, origin = str(source), "file"
        text = _read_text(Path(source))
        data, lines = _parse_yaml(text, file)
        if data is None:
            raise _error(
                file,
                1,
                "the file is empty; write at least one key, e.g. "
                "'strategy: {kind: mirrored}', or delete the file to use the defaults",
            )
    if not isinstance(data, dict):
        raise _error(
            file,
            lines.get("", 1),
            f"received a {type(data).__name__} at the top level, expected a mapping with keys "
            "such as strategy, batch, learning_rate",
        )
    given = _flatten(data)
    provenance = {k: origin for k in given}
    for name, dotted in ENV_KEYS.items():
        if value := env.get(name, "").strip():
            check_data(_set({}, dotted, value), f"${name}")
            _set(data, dotted, value)
            provenance[dotted] = "env"
    verify = _verify_request(env)
    if verify is not None:
        verify = dataclasses.replace(verify, mlflow=given.get("mlflow.enabled", True) is not False)
        for dotted, value in _verify_overrides(verify).items():
            _set(data, dotted, value)
            provenance[dotted] = "env"
    for dotted, value in (overrides or {}).items():
        check_data(_set({}, dotted, value), "<overrides>")
        _set(data, dotted, value)
        provenance[dotted] = "flag"
    b = _Builder(file, lines)
    cfg = _check_consistency(b.build(Config, data, ""), b, _flatten(data))
    if b.issues:
        from_env = {d: n for n, d in ENV_KEYS.items() if provenance.get(d) == "env"}
        issues = [
            ConfigIssue(f"${var}", None, i.key_path, f"{i.message}; fix or unset ${var}")
            if (var := from_env.get(i.key_path))
            else i
            for i in b.issues
        ]
        raise ConfigError(sorted(issues, key=lambda i: i.line or 0))  # stable: file order in a line
    return dataclasses.replace(cfg, source=file, text=text, provenance=provenance, verify=verify)


def _verify_request(env: Mapping[str, str]) -> VerifyRequest | None:
    """`keras-sync verify`'s request from the environment (its variables are read here only)."""
    record = env.get(VERIFY_RECORD_ENV, "").strip()
    if not record:
        return None
    raw = env.get(VERIFY_STEPS_ENV, "").strip() or "20"
    if not raw.isdigit() or int(raw) < 1:
        raise _error(
            f"${VERIFY_STEPS_ENV}",
            None,
            f"received {raw!r}, expected a number of optimizer steps >= 1 (e.g. 20); "
            f"fix or unset ${VERIFY_STEPS_ENV}",
        )
    return VerifyRequest(record, int(raw), env.get(VERIFY_REPLAY_ENV, "").strip() or None)


def _verify_overrides(verify: VerifyRequest) -> dict[str, Any]:
    """The keys a verify run sets: no MLflow run of its own (verify logs the comparison), and for the
    reference the one-device settings its recording chose (`keras_sync.training.verify_record`)."""
    import json

    out: dict[str, Any] = {"mlflow.enabled": False}
    if verify.replay_dir is None:
        return out
    path = Path(verify.replay_dir) / VERIFY_OVERRIDES_FILE
    try:
        out.update(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise _error(
            f"${VERIFY_REPLAY_ENV}",
            None,
            f"cannot read the recording's {path} ({exc}); expected a folder written by a run "
            f"with ${VERIFY_RECORD_ENV}",
        ) from None
    return out


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def _read_text(path: Path) -> str:
    file = str(path)
    if not path.exists():
        msg = "no such file; create one with 'keras-sync init' or pass the right path"
        raise _error(file, None, msg)
    if path.is_dir():
        msg = f"is a directory, expected a YAML file (e.g. {path / DEFAULT_CONFIG_FILE})"
        raise _error(file, None, msg)
    try:
        if (size_issue := file_size_issue(file, path.stat().st_size)) is not None:
            raise ConfigError(size_issue)
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # a pipe or /proc file says size 0
    except OSError as exc:
        raise _error(file, None, f"cannot read the file: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _error(
            file,
            None,
            f"the file is over the limit of {MAX_FILE_BYTES:,} bytes (1 MiB) for a config file; "
            "check that this is the file you meant",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(
            file,
            raw[: exc.start].count(b"\n") + 1,
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8 YAML",
        ) from None
