"""The keras-sync config: a tree of frozen dataclasses and its one loader. Each key is declared once
with `_f` (default, value spec) and described in `DOCS`. Precedence: flag > environment
(`ENV_KEYS`) > YAML file > default. All problems are raised together in one `ConfigError`."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from keras_sync.cluster import CLUSTER_SOURCES
from keras_sync.config import specs
from keras_sync.config.kinds import KINDS, STRATEGY_KINDS, kinds_where
from keras_sync.config.reading import check_data, error, parse_yaml, read_text
from keras_sync.config.specs import Spec, choice, integer, number, text
from keras_sync.errors import ConfigError, ConfigIssue

DEFAULT_CONFIG_FILE = "keras_sync.yaml"
CONFIG_ENV = "KERAS_SYNC_CONFIG"
#: Environment variables that set a config key (they win over the file, lose to a flag).
ENV_KEYS = {"MLFLOW_TRACKING_URI": "mlflow.tracking_uri", "KERAS_SYNC_JOB_ID": "mlflow.job_id"}
#: `keras-sync verify`: where `sync.fit` records its first steps, the recording a one-device
#: reference replays, how many optimizer steps, and the file of the reference's config overrides.
VERIFY_RECORD_ENV = "KERAS_SYNC_VERIFY_RECORD"
VERIFY_REPLAY_ENV = "KERAS_SYNC_VERIFY_REPLAY"
VERIFY_STEPS_ENV = "KERAS_SYNC_VERIFY_STEPS"
VERIFY_OVERRIDES_FILE = "reference.json"
#: `strategy.communication`: tf.distribute.experimental.CommunicationImplementation's names, lower case.
COMMUNICATIONS = ("auto", "ring", "nccl")
#: `learning_rate.scaling`: the rules `keras_sync.training.scaling.scale_learning_rate` applies.
LR_RULES = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class VerifyRequest:
    """What `keras-sync verify` asks: record ``steps`` optimizer steps to ``record_dir`` (or replay)."""

    record_dir: str
    steps: int = 20
    replay_dir: str | None = None
    #: The config's own mlflow.enabled (a verify run logs nothing itself; the command logs the comparison).
    mlflow: bool = True


def _f(default: Any, spec: Spec, key: str | None = None, kinds: Any = None) -> Any:
    """A config key: default, value spec, YAML name where it differs, the kinds it applies to."""
    return field(default=default, metadata={"spec": spec, "key": key, "kinds": kinds})


def _sub(cls: type, note: str = "", kinds: Any = None, commented: bool = False) -> Any:
    """A section; ``note``: the template's comment above its keys; ``commented``: shown commented out."""
    meta = {"note": note, "kinds": kinds, "commented": commented}
    return field(default_factory=cls, metadata=meta)


def _internal(repr: bool = False, **kw: Any) -> Any:
    """A field of the built config that no source sets."""
    return field(compare=False, repr=repr, metadata={"internal": True}, **kw)


#: Every key's description: the one text the template, the reference and the JSON Schema show
#: (a section's: the first line of its class's docstring).
DOCS = {
    "strategy.kind": "which strategy; auto picks by the hardware and TF_CONFIG",
    "strategy.devices": "e.g. ['/gpu:0', '/gpu:1']; empty = all GPUs (one_device: the first), else the CPU",
    "strategy.simulated_cpu_replicas": "> 0: split the CPU into N logical devices, one replica each (per worker)",
    "strategy.cross_device_ops": "how local gradients are all-reduced: auto, nccl, hierarchical_copy or reduction_to_one (no NCCL on CPU)",
    "strategy.communication": "collective implementation: auto, ring or nccl",
    "strategy.cluster": "where the workers are: tf_config ($TF_CONFIG), slurm (srun's environment) or indexed_job (a Kubernetes Indexed Job or JobSet: $JOB_COMPLETION_INDEX and strategy.indexed_job)",
    "strategy.connect_timeout_s": "seconds to wait for all workers to join, then fail naming the missing ones",
    "strategy.tpu.name": "'local' on a TPU VM, else the TPU's name or grpc:// address",
    "strategy.tpu.zone": "GCE zone of the TPU (Cloud TPU only)",
    "strategy.tpu.project": "GCP project of the TPU (Cloud TPU only)",
    "strategy.indexed_job.hosts": "worker i's host (or host:port) with {index} = i, e.g. train-{index}.train (<Job>-{index}.<headless Service>)",
    "strategy.indexed_job.port": "the port every worker listens on (when `hosts` names none)",
    "strategy.indexed_job.workers": "number of workers (the Job's completions)",
    "strategy.slurm.port_base": "task i on a node listens on port_base + i; auto: a block of 16 ports in 10000-31775 chosen by $SLURM_JOB_ID and $SLURM_STEP_ID, so jobs and steps that share a node do not collide",
    "batch.per_replica": "examples per replica per step",
    "batch.global": "examples per step over all replicas",
    "batch.drop_remainder": "drop the last partial batch; auto = true on TPU (static shapes), false elsewhere",
    "batch.shard_policy": "tf.data auto-shard of datasets without their own policy: auto, data, file or off (arrays: always by example)",
    "learning_rate.base": "the learning rate tuned for base_batch_size",
    "learning_rate.base_batch_size": "the batch `base` was tuned for; null = the per-replica batch",
    "learning_rate.scaling": "linear (Goyal et al. 2017), sqrt or none: how the rate follows the global batch",
    "learning_rate.warmup_epochs": "ramp from base to the scaled rate over N epochs (or warmup_steps, not both)",
    "learning_rate.warmup_steps": "ramp from base to the scaled rate over N optimizer steps (or warmup_epochs)",
    "mlflow.enabled": "log sync metrics to MLflow (only the chief writes)",
    "mlflow.tracking_uri": "MLflow tracking URI; $MLFLOW_TRACKING_URI wins over it; null = sqlite:///<cwd>/mlflow.db",
    "mlflow.experiment": "MLflow experiment name",
    "mlflow.run_name": "MLflow run name; null = generated",
    "mlflow.job_id": "runs with the same job id share one MLflow run; $KERAS_SYNC_JOB_ID wins over it; null = a new run per job (a relaunch that restores a backup continues its run)",
    "mlflow.spool_dir": "where metrics wait for delivery to MLflow (relative to the cwd)",
    "mlflow.log_every_n_steps": "log step metrics every N optimizer steps; auto: at most 10 points a second, and each epoch's last step; a point for several steps adds their peaks (sync/window_max/*)",
    "mlflow.allreduce_probe": "time one all-reduce of the gradients' size at train start",
    "mlflow.system_metrics": "MLflow's system metrics (CPU, memory, disk, network) as system/*, every 10 s",
    "mlflow.log_model": "log the trained model (MLflow Keras flavour, chief only) at the end of each fit",
    "mlflow.sync_report": "sync_report.png, replicas overlaid: at the end of each fit, also after every epoch, or off",
    "fault_tolerance.backup_dir": "a directory turns on BackupAndRestore (exact resume after a kill); null = off",
    "fault_tolerance.save_freq": "epoch, or back up every N batches",
    "fault_tolerance.grace_period_s": "after SIGTERM (preemption): seconds to save a backup on every worker and exit 143; keep it under the scheduler's grace",
    "runtime.mixed_precision": "dtype policy set by load(): none, mixed_float16 (loss scaling), mixed_bfloat16",
    "runtime.jit_compile": "XLA for the train step: true, false, or auto (keep compile's)",
    "runtime.steps_per_execution": "train steps per tf.function call",
    "runtime.gradient_accumulation_steps": "one optimizer update every N micro-batches (effective batch = global x N)",
    "runtime.sync_batch_norm": "BatchNormalization statistics over all replicas (synchronized)",
    "runtime.train_step_gradients": "custom train_step: average replicas' gradients (auto: if its loss is not divided) or sum",
    "checks.on_violation": "a failed check: warn (one line on the chief + an MLflow tag) or error (stop the fit with that line)",
}


_MWM = kinds_where(multi_process=True)
_NAME = text(nullable=True)
_COUNT = integer(1, nullable=True)
_DEVICE_KINDS = tuple(k for k in kinds_where(accepts_devices=True) if k != "auto")
# Comments the template prints above a section's keys.
_BATCH_NOTE = "Give exactly one of per_replica / global (the other null); keras-sync derives the other from the replica count: global = per_replica x replicas."
_RUNTIME_NOTE = "Applied by sync.fit to your compiled model; a key left at its default keeps what your model.compile(...) set."
_PORT_BASE = specs.word_or_int("auto", "the first of 16 ports", 65520)
_HOSTS = "a host pattern with {index} (one host per worker), e.g. train-{index}.train"
_PRECISION_HINTS = {"fp16": "mixed_float16", "float16": "mixed_float16", "half": "mixed_float16"}
_PRECISION_HINTS |= {"bf16": "mixed_bfloat16", "bfloat16": "mixed_bfloat16"}


@dataclass(frozen=True)
class TPUConfig:
    """Where the TPU is: a name or grpc:// address (`local` for a TPU VM), zone and project."""

    name: str | None = _f("local", _NAME)
    zone: str | None = _f(None, _NAME)
    project: str | None = _f(None, _NAME)


@dataclass(frozen=True)
class IndexedJobConfig:
    """Workers of a Kubernetes Indexed Job or JobSet: worker i is `hosts` with {index} = i."""

    hosts: str | None = _f(None, text(True, r".*\{index\}.*", _HOSTS), kinds=_MWM)
    port: int = _f(
        2222, integer(1, maximum=65535, expected="a TCP port from 1 to 65535"), kinds=_MWM
    )
    workers: int | None = _f(None, _COUNT, kinds=_MWM)


@dataclass(frozen=True)
class SlurmConfig:
    """Ports of a Slurm job step's workers: task i on a node listens on `port_base` + i."""

    port_base: int | str = _f("auto", _PORT_BASE, kinds=_MWM)


@dataclass(frozen=True)
class StrategyConfig:
    """Which `tf.distribute` strategy to build, and its options."""

    kind: str = _f("auto", choice(*STRATEGY_KINDS))
    devices: tuple[str, ...] = _f((), specs.DEVICES, kinds=_DEVICE_KINDS)
    simulated_cpu_replicas: int = _f(0, integer(0), kinds=kinds_where(simulated_cpus=True))
    cross_device_ops: str = _f(
        "auto", choice("auto", "nccl", "hierarchical_copy", "reduction_to_one"), kinds=("mirrored",)
    )
    communication: str = _f("auto", choice(*COMMUNICATIONS), kinds=_MWM)
    cluster: str = _f("tf_config", choice(*CLUSTER_SOURCES), kinds=_MWM)
    connect_timeout_s: float = _f(300.0, number(0, exclusive=True), kinds=("auto", *_MWM))
    tpu: TPUConfig = _sub(TPUConfig, kinds=("tpu",))
    indexed_job: IndexedJobConfig = _sub(IndexedJobConfig, kinds=_MWM)
    slurm: SlurmConfig = _sub(SlurmConfig, kinds=_MWM)


@dataclass(frozen=True)
class BatchConfig:
    """Batch size, given per replica or globally (exactly one), and how data is split."""

    per_replica: int | None = _f(32, _COUNT)
    global_: int | None = _f(None, _COUNT, key="global")
    drop_remainder: str | bool = _f("auto", specs.AUTO_OR_BOOL)
    shard_policy: str = _f("auto", choice("auto", "data", "file", "off", false="off"))


@dataclass(frozen=True)
class LearningRateConfig:
    """The base learning rate and how it scales with the global batch."""

    base: float = _f(0.1, number(0, exclusive=True))
    base_batch_size: int | None = _f(None, _COUNT)
    scaling: str = _f("linear", choice(*LR_RULES))
    warmup_epochs: float = _f(0.0, number(0))
    warmup_steps: int = _f(0, integer(0))


@dataclass(frozen=True)
class MlflowConfig:
    """Where sync metrics go."""

    enabled: bool = _f(True, specs.BOOL)
    tracking_uri: str | None = _f(None, _NAME)
    experiment: str = _f("keras-sync", text())
    run_name: str | None = _f(None, _NAME)
    job_id: str | None = _f(
        None, text(True, r"[\w.:/@+\-]{1,250}", "1-250 letters, digits or _.:/@+-")
    )
    spool_dir: str = _f(".keras_sync_spool", text())
    log_every_n_steps: int | str = _f("auto", specs.word_or_int("auto", "steps"))
    allreduce_probe: bool = _f(False, specs.BOOL)
    system_metrics: bool = _f(False, specs.BOOL)
    log_model: bool = _f(False, specs.BOOL)
    sync_report: str = _f("end", choice("end", "epoch", "off", false="off"))


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Backup and exact resume after a worker is killed."""

    backup_dir: str | None = _f(None, _NAME)
    save_freq: str | int = _f("epoch", specs.word_or_int("epoch", "batches"))
    grace_period_s: float = _f(25.0, number(0, exclusive=True))


@dataclass(frozen=True)
class RuntimeConfig:
    """How the training step runs, applied to the user's compiled model by `Sync.fit`."""

    mixed_precision: str = _f(
        "none",
        choice("none", "mixed_float16", "mixed_bfloat16", false="none", hints=_PRECISION_HINTS),
    )
    jit_compile: str | bool = _f("auto", specs.AUTO_OR_BOOL)
    steps_per_execution: int = _f(1, integer(1))
    gradient_accumulation_steps: int = _f(1, integer(1))
    sync_batch_norm: bool = _f(False, specs.BOOL)
    train_step_gradients: str = _f("auto", choice("auto", "average", "sum"))


@dataclass(frozen=True)
class ChecksConfig:
    """What keras-sync checks of every fit at run time (examples per step and epoch, resume, learning rate)."""

    on_violation: str = _f("warn", choice("warn", "error"))


@dataclass(frozen=True)
class Config:
    """The whole keras-sync config. Build it with `load_config`."""

    strategy: StrategyConfig = _sub(StrategyConfig)
    batch: BatchConfig = _sub(BatchConfig, note=_BATCH_NOTE)
    learning_rate: LearningRateConfig = _sub(LearningRateConfig)
    mlflow: MlflowConfig = _sub(MlflowConfig)
    fault_tolerance: FaultToleranceConfig = _sub(FaultToleranceConfig)
    checks: ChecksConfig = _sub(ChecksConfig)
    runtime: RuntimeConfig = _sub(RuntimeConfig, note=_RUNTIME_NOTE, commented=True)
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
        """Which config this is, in words: the file's absolute path, or why the defaults are used."""
        if self.source == "<defaults>":
            return f"no {DEFAULT_CONFIG_FILE} found in {Path.cwd()} and ${CONFIG_ENV} is unset: built-in defaults (pass a path to keras_sync.load(), or run from the directory of the file)"
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
        value = _to_dict(value) if dataclasses.is_dataclass(value) else value
        out[_yaml_key(f)] = list(value) if isinstance(value, tuple) else value
    return out


def _build(cls: type, data: Any, path: str, issue: Callable[[str, str], None]) -> Any:
    """A section from its data; each problem is passed to ``issue`` (key path, message)."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        msg = f"received {type(data).__name__} {data!r} at the {path}, expected a mapping of keys"
        issue(path, msg)
        return cls()
    by_key = {_yaml_key(f): f for f in _public_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        f = by_key.get(key) if isinstance(key, str) else None
        if f is None:
            close = difflib.get_close_matches(str(key), list(by_key), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            issue(key_path, f"unknown key {key!r}{hint} (allowed: {', '.join(by_key)})")
        elif "spec" not in f.metadata:  # a section: its class is the factory
            kwargs[f.name] = _build(f.default_factory, value, key_path, issue)  # type: ignore[arg-type]
        else:
            try:
                kwargs[f.name] = f.metadata["spec"].check(value)
            except specs.FieldValueError as exc:
                issue(key_path, str(exc))
    return cls(**kwargs)


def _check_consistency(
    cfg: Config, issue: Callable[[str, str], None], given: Mapping[str, Any]
) -> Config:
    """The rules between keys; per_replica is cleared when global is given."""
    batch, lr, s, job = cfg.batch, cfg.learning_rate, cfg.strategy, cfg.strategy.indexed_job
    kind = KINDS[s.kind]
    if given.get("batch.per_replica") is not None and given.get("batch.global") is not None:
        msg = f"received batch.per_replica={batch.per_replica} and batch.global={batch.global_}; give exactly one of them (set the other to null or remove it)"
        issue("batch.global", msg)
    elif given.get("batch.global") is not None:
        batch = dataclasses.replace(batch, per_replica=None)
    elif batch.per_replica is None:
        msg = "received null for both batch.per_replica and batch.global; give exactly one (e.g. per_replica: 32)"
        issue("batch.per_replica", msg)
    if lr.warmup_epochs and lr.warmup_steps:
        msg = f"received warmup_epochs={lr.warmup_epochs:g} and warmup_steps={lr.warmup_steps}; give one of them (set the other to 0)"
        issue("learning_rate.warmup_steps", msg)
    if s.devices and not kind.accepts_devices:
        msg = f"received devices={list(s.devices)} with kind={s.kind}; devices applies to {' and '.join(_DEVICE_KINDS)} only (remove it, or use simulated_cpu_replicas)"
        issue("strategy.devices", msg)
    if kind.max_devices is not None and len(s.devices) > kind.max_devices:
        msg = f"received {len(s.devices)} devices for kind={s.kind}; give at most {kind.max_devices} (remove the others)"
        issue("strategy.devices", msg)
    if s.devices and s.simulated_cpu_replicas:
        msg = "received both devices and simulated_cpu_replicas; give one (simulated replicas make their own logical CPU devices)"
        issue("strategy.simulated_cpu_replicas", msg)
    if s.simulated_cpu_replicas and not kind.simulated_cpus:
        msg = f"simulated_cpu_replicas does not apply to kind={s.kind}; remove it (it applies to {', '.join(kinds_where(simulated_cpus=True))})"
        issue("strategy.simulated_cpu_replicas", msg)
    acc, save_freq = cfg.runtime.gradient_accumulation_steps, cfg.fault_tolerance.save_freq
    if acc > 1 and isinstance(save_freq, int) and save_freq % acc:
        # A backup between two optimizer updates would lose the gradients accumulated so far.
        msg = f"received save_freq={save_freq} with runtime.gradient_accumulation_steps={acc}; back up at optimizer updates: use a multiple of {acc} (e.g. {save_freq - save_freq % acc or acc}) or 'epoch'"
        issue("fault_tolerance.save_freq", msg)
    if s.cluster == "indexed_job":
        for key in ("hosts", "workers"):
            if getattr(job, key) is None:
                msg = "received null with strategy.cluster=indexed_job; set it (hosts: a pattern such as train-{index}.train; workers: the Job's completions)"
                issue(f"strategy.indexed_job.{key}", msg)
    return dataclasses.replace(cfg, batch=batch)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Every key path of nested dicts (sections too) with its value."""
    out: dict[str, Any] = {}
    for k, v in data.items() if isinstance(data, dict) else ():
        path = f"{prefix}.{k}" if prefix else str(k)
        out |= {path: v, **_flatten(v, path)}
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


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


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
    if source is None:
        found = DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).is_file() else None
        source = env.get(CONFIG_ENV) or found
    text: str | None = None
    lines: dict[str, int] = {}
    if source is None:
        file, data, origin = "<defaults>", {}, "default"
    elif isinstance(source, Mapping):
        check_data(source, "<dict>")
        file, data, origin = "<dict>", _plain(source), "dict"
    else:
        file, origin, text = str(source), "file", read_text(Path(source))
        data, lines = parse_yaml(text, file)
    given = _flatten(data)
    provenance = dict.fromkeys(given, origin)
    sets = [(d, v, "env", f"${n}") for n, d in ENV_KEYS.items() if (v := env.get(n, "").strip())]
    verify, verify_keys = _verify(env, mlflow=given.get("mlflow.enabled", True) is not False)
    sets += [(d, v, "env", f"${VERIFY_RECORD_ENV}") for d, v in verify_keys.items()]
    sets += [(dotted, v, "flag", "<overrides>") for dotted, v in (overrides or {}).items()]
    for dotted, value, how, name in sets:
        check_data(_set({}, dotted, value), name)
        _set(data, dotted, value)
        provenance[dotted] = how
    issues: list[ConfigIssue] = []

    def issue(key_path: str, message: str) -> None:
        """An issue at the line of ``key_path`` or its nearest parent, or at its variable."""
        var = {d: n for n, d in ENV_KEYS.items()}.get(key_path)
        if var and provenance.get(key_path) == "env":
            issues.append(ConfigIssue(f"${var}", None, key_path, f"{message}; fix or unset ${var}"))
            return
        parent = key_path
        while parent not in lines and "." in parent:
            parent = parent.rsplit(".", 1)[0]
        issues.append(ConfigIssue(file, lines.get(parent, lines.get("")), key_path, message))

    cfg = _check_consistency(_build(Config, data, "", issue), issue, _flatten(data))
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: i.line or 0))  # stable: file order in a line
    return dataclasses.replace(cfg, source=file, text=text, provenance=provenance, verify=verify)


def _verify(env: Mapping[str, str], mlflow: bool) -> tuple[VerifyRequest | None, dict[str, Any]]:
    """`keras-sync verify`'s request from the environment, and the config keys a verify run sets."""
    record = env.get(VERIFY_RECORD_ENV, "").strip()
    if not record:
        return None, {}
    raw = env.get(VERIFY_STEPS_ENV, "").strip() or "20"
    if not raw.isdigit() or int(raw) < 1:
        msg = f"received {raw!r}, expected a number of optimizer steps >= 1 (e.g. 20); fix or unset ${VERIFY_STEPS_ENV}"
        raise error(f"${VERIFY_STEPS_ENV}", None, msg)
    replay = env.get(VERIFY_REPLAY_ENV, "").strip() or None
    keys: dict[str, Any] = {"mlflow.enabled": False}
    if replay is not None:
        path = Path(replay) / VERIFY_OVERRIDES_FILE
        try:
            keys |= json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            msg = f"cannot read the recording's {path} ({exc}); expected a folder written by a run with ${VERIFY_RECORD_ENV}"
            raise error(f"${VERIFY_REPLAY_ENV}", None, msg) from None
    return VerifyRequest(record, int(raw), replay, mlflow), keys
