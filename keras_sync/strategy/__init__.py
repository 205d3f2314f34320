"""The strategy factory: one small builder per `strategy.kind`, and what `auto` picks and why.
`detect` and `device_layout` import no TensorFlow (`keras-sync plan` uses them)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from keras_sync.config import Config, StrategyConfig
from keras_sync.config.kinds import KINDS, LAYOUT_ONE, LAYOUT_TENSORFLOW, LAYOUT_TPU, kinds_where
from keras_sync.errors import KerasSyncError, StrategyError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

# Set by Cloud TPU VMs, Colab and GKE when a TPU is attached.
_TPU_ENV = ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS")
#: Kinds whose job is one process, which is then its chief.
ONE_PROCESS_KINDS = kinds_where(one_process=True)


@dataclass(frozen=True)
class Detection:
    """The strategy kind that will be built, and the reason, in words for `keras-sync plan`."""

    kind: str
    reason: str


def count_gpus_cheaply() -> int:
    """NVIDIA GPUs visible to the driver, without importing TensorFlow (0 when unknown)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    gpus = Path("/proc/driver/nvidia/gpus")
    try:
        n = sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0
    except OSError:
        return 0
    return min(n, len([v for v in visible.split(",") if v.strip()])) if visible else n


def refuse_one_process_kind(config: Config, workers: int, started_by: str, alone: str) -> None:
    """Refuse a one-process kind (`mirrored`, ...) run as ``workers`` > 1 processes."""
    kind = config.strategy.kind
    if workers > 1 and KINDS[kind].one_process:
        joined = " or ".join(kinds_where(builder=None) + kinds_where(multi_process=True))
        msg = f"{started_by}, but strategy.kind is {kind!r} in {config.origin()}, a kind that runs in one process: each worker would train on its own. Fix: set strategy.kind: {joined}, or {alone}."
        raise UsageError(msg)


def check_one_process(config: Config, environ: Mapping[str, str] | None = None) -> None:
    """`refuse_one_process_kind` for the cluster this process was started in (TF_CONFIG, Slurm, ...)."""
    from keras_sync.cluster import read_cluster

    try:
        info, where = read_cluster(config.strategy, os.environ if environ is None else environ)
    except KerasSyncError:  # said by what reads it for real (one-process kinds never do)
        return
    n = info.num_workers
    refuse_one_process_kind(config, n, f"{where} names {n} workers", "start one process only")


def detect(
    config: Config, environ: Mapping[str, str] | None = None, *, gpus: int | None = None
) -> Detection:
    """Resolve `strategy.kind: auto` (a TPU, workers, GPUs, simulated replicas, else default), why."""
    env = os.environ if environ is None else environ
    kind, sim = config.strategy.kind, config.strategy.simulated_cpu_replicas
    if kind != "auto":
        return Detection(kind, f"strategy.kind is {kind!r} ({config.source_of('strategy.kind')})")
    if var := next((v for v in _TPU_ENV if env.get(v)), None):
        return Detection("tpu", f"auto: ${var} is set")
    if Path("/dev/accel0").exists() or Path("/dev/vfio/0").exists():
        return Detection("tpu", "auto: a TPU device (/dev/accel0) is present")
    from keras_sync.cluster import read_cluster

    info, where = read_cluster(config.strategy, env)
    if info.num_workers > 1:
        return Detection("multi_worker_mirrored", f"auto: {where} names {info.num_workers} workers")
    n_gpus = count_gpus_cheaply() if gpus is None else gpus
    if n_gpus > 1:
        return Detection("mirrored", f"auto: {n_gpus} GPUs")
    if sim > 1:
        return Detection("mirrored", f"auto: strategy.simulated_cpu_replicas={sim}")
    why = "one GPU" if n_gpus == 1 else "no GPU"
    return Detection("default", f"auto: one worker, {why}, no simulated replicas")


@dataclass(frozen=True)
class DeviceLayout:
    """One worker's devices (one replica each) and who names them: simulated, config or tensorflow."""

    devices: tuple[str, ...]
    source: str

    @property
    def explicit_devices(self) -> list[str] | None:
        """The device list a builder hands to TensorFlow; None leaves the choice to TensorFlow."""
        return None if self.source == "tensorflow" else list(self.devices)


def device_layout(kind: str, cfg: StrategyConfig, *, gpus: int) -> DeviceLayout:
    """The per-worker devices of a ``kind`` (not tpu), without TensorFlow; ``gpus``: the GPUs visible."""
    spec = KINDS[kind]
    if spec.builder is None or spec.layout == LAYOUT_TPU:
        raise ValueError(f"device_layout: no local device layout for kind={kind!r}")
    local = spec.layout != LAYOUT_TENSORFLOW  # the default strategy: no list, no simulated CPUs
    if local and cfg.simulated_cpu_replicas:
        devices = tuple(f"/cpu:{i}" for i in range(cfg.simulated_cpu_replicas))
        source = "simulated"
    elif local and cfg.devices and spec.accepts_devices:
        devices, source = cfg.devices, "strategy.devices"
    else:
        gpu_names = tuple(f"/gpu:{i}" for i in range(gpus if local else min(gpus, 1)))
        devices, source = gpu_names or ("/cpu:0",), "tensorflow"
    return DeviceLayout(devices[:1] if spec.layout == LAYOUT_ONE else devices, source)


def configure_simulated_cpus(n: int) -> None:
    """Split the CPU into ``n`` logical devices (0: leave it); must run before TensorFlow initialises."""
    if not n:
        return
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is None or len(current) != n:
        try:
            config = [tf.config.LogicalDeviceConfiguration()] * n
            tf.config.set_logical_device_configuration(cpus[0], config)
        except RuntimeError as exc:
            msg = f"Cannot split the CPU into strategy.simulated_cpu_replicas={n} logical devices: TensorFlow has already initialised its devices in this process. Call keras_sync.load() first, before creating any tensor, model or dataset. ({exc})"
            raise StrategyError(msg) from None


def _local_devices(kind: str, cfg: StrategyConfig) -> tuple[DeviceLayout, int]:
    """`device_layout` made real (simulated CPUs split, listed devices checked), and the GPU count."""
    import tensorflow as tf

    from keras_sync.strategy.multi_worker import canonical

    configure_simulated_cpus(cfg.simulated_cpu_replicas)
    n_gpus = 0 if cfg.simulated_cpu_replicas else len(tf.config.list_physical_devices("GPU"))
    layout = device_layout(kind, cfg, gpus=n_gpus)
    if layout.source == "strategy.devices":
        seen = tf.config.list_logical_devices()
        known = {canonical(d.name, where="TensorFlow's devices") for d in seen}
        for dev in layout.devices:
            if canonical(dev, where="strategy.devices") not in known:
                msg = f"Invalid value for strategy.devices. Received: {dev!r}. Expected devices TensorFlow sees here: {', '.join(sorted(known))}."
                raise StrategyError(msg)
    return layout, n_gpus


def _build_default(config: Config) -> tf.distribute.Strategy:
    import tensorflow as tf

    return tf.distribute.get_strategy()


def _build_one_device(config: Config) -> tf.distribute.Strategy:
    import tensorflow as tf

    layout, _ = _local_devices("one_device", config.strategy)
    return tf.distribute.OneDeviceStrategy(layout.devices[0])


def _build_mirrored(config: Config) -> tf.distribute.Strategy:
    import tensorflow as tf

    layout, n_gpus = _local_devices("mirrored", config.strategy)
    name = config.strategy.cross_device_ops
    if name == "nccl" and not n_gpus:
        msg = "strategy.cross_device_ops='nccl' needs GPUs, and TensorFlow sees none here. Use 'hierarchical_copy', 'reduction_to_one' or 'auto'."
        raise StrategyError(msg)
    # auto on CPU: TensorFlow's collective all-reduce collides between two strategies in a process.
    name = "reduction_to_one" if name == "auto" and not n_gpus else name
    ops = {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduction_to_one": tf.distribute.ReductionToOneDevice,
    }.get(name, lambda: None)()
    return tf.distribute.MirroredStrategy(devices=layout.explicit_devices, cross_device_ops=ops)


def _build_multi_worker_mirrored(config: Config) -> tf.distribute.Strategy:
    from keras_sync import cluster
    from keras_sync.strategy.multi_worker import build_multi_worker_strategy
    from keras_sync.upstream import internals
    from keras_sync.upstream.strategy_facts import in_multi_worker_mode

    cfg = config.strategy
    internals.require("multi_worker_strategy")  # the private TF internals the builder uses
    cluster.check_tf_config_order()  # tensorflow#60706: TF_CONFIG must be set before TF joins
    configure_simulated_cpus(cfg.simulated_cpu_replicas)
    # No GPU count: counting before the cluster forms would start TensorFlow's runtime.
    strategy = build_multi_worker_strategy(
        communication=cfg.communication,
        cluster_resolver=cluster.cluster_resolver(cfg),
        local_devices=device_layout("multi_worker_mirrored", cfg, gpus=0).explicit_devices,
        connect_timeout_s=cfg.connect_timeout_s,
    )
    cluster.record_strategy_tf_config(os.environ.get("TF_CONFIG"))
    if in_multi_worker_mode(strategy):  # keras_fixes' multi-worker fixes: refused now if missing
        internals.require("multi_worker_fit")
    return strategy


def _build_tpu(config: Config) -> tf.distribute.Strategy:
    import tensorflow as tf

    tpu = config.strategy.tpu
    address = tpu.name or ""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(address, tpu.zone, tpu.project)
        if address not in ("", "local"):
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    except Exception as exc:  # ValueError, NotFoundError, RuntimeError...: all mean "no TPU here"
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]
        msg = f"Cannot reach a TPU at strategy.tpu.name={address!r} (zone={tpu.zone}, project={tpu.project}): {type(exc).__name__}: {detail}. Set strategy.tpu.name to your TPU's name or grpc:// address, or choose another strategy.kind."
        raise StrategyError(msg) from None


# kind -> builder, from the kinds table: a new kind is an entry there and its builder here.
BUILDERS: dict[str, Callable[[Config], tf.distribute.Strategy]] = {
    name: globals()[spec.builder] for name, spec in KINDS.items() if spec.builder is not None
}


def build_strategy(
    config: Config, environ: Mapping[str, str] | None = None
) -> tuple[tf.distribute.Strategy, Detection]:
    """Build the configured `tf.distribute.Strategy` (call before any other TensorFlow work)."""
    try:
        import tensorflow  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "tensorflow":
            raise  # a broken TensorFlow: its own error says more than ours could
        msg = f'TensorFlow is not installed in this environment ({sys.executable}); keras-sync uses the TensorFlow of your project and installs none itself. Fix: pip install "keras-sync[cpu]" (tensorflow-cpu), "keras-sync[tensorflow]" (the standard build; GPU with a system CUDA) or "keras-sync[and-cuda]" (GPU with CUDA from pip).'
        raise StrategyError(msg) from None
    detection = detect(config, environ)
    return BUILDERS[detection.kind](config), detection
