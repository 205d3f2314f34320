"""The strategy kinds keras-sync knows: one entry each, and every question about a kind asks it
(config validation, the builders and device layouts of `keras_sync.strategy`, the templates)."""

from __future__ import annotations

from dataclasses import dataclass

# Where a kind's replicas live on one worker (`keras_sync.strategy.device_layout`).
LAYOUT_TENSORFLOW = "tensorflow"  # no device list: TensorFlow's default device, no simulated CPUs
LAYOUT_LOCAL = "local"  # one replica per local device: simulated CPUs, devices, GPUs or the CPU
LAYOUT_ONE = "one"  # the first of the local devices
LAYOUT_TPU = "tpu"  # the TPU system names its cores when it starts
LAYOUTS = (LAYOUT_TENSORFLOW, LAYOUT_LOCAL, LAYOUT_ONE, LAYOUT_TPU)


@dataclass(frozen=True)
class KindSpec:
    """One strategy kind: its `strategy.kind` name, its template's comment, its builder in
    `keras_sync.strategy` (None for ``auto``), its device layout (one of `LAYOUTS`), one process per
    worker (``multi_process``) or one for the job (``one_process``), whether `strategy.devices`
    (at most ``max_devices``) and simulated CPUs apply, what ``batch.drop_remainder: auto`` means,
    and whether a model must be built in `Sync.scope()`."""

    name: str
    summary: str
    builder: str | None
    layout: str
    multi_process: bool = False
    one_process: bool = False
    accepts_devices: bool = False
    max_devices: int | None = None
    simulated_cpus: bool = True
    drop_remainder: bool = False
    scoped: bool = True


KINDS: dict[str, KindSpec] = {
    spec.name: spec
    for spec in (
        KindSpec(
            "auto",
            "auto: a TPU if one is attached; multi_worker_mirrored when TF_CONFIG (or Slurm) names several workers; mirrored with several GPUs or simulated CPU replicas; else default.",
            None,
            LAYOUT_LOCAL,
            accepts_devices=True,
        ),
        KindSpec(
            "default",
            "default: no distribution, TensorFlow's default device; plain Keras behaviour.",
            "_build_default",
            LAYOUT_TENSORFLOW,
            one_process=True,
            simulated_cpus=False,
            scoped=False,
        ),
        KindSpec(
            "one_device",
            "one_device: everything on one device (a good baseline to compare replicas against).",
            "_build_one_device",
            LAYOUT_ONE,
            one_process=True,
            accepts_devices=True,
            max_devices=1,
        ),
        KindSpec(
            "mirrored",
            "mirrored: one replica per local device, gradients all-reduced every step.",
            "_build_mirrored",
            LAYOUT_LOCAL,
            one_process=True,
            accepts_devices=True,
        ),
        KindSpec(
            "multi_worker_mirrored",
            "multi_worker_mirrored: several processes (machines), each with its local devices. Try it on one machine: keras-sync launch --workers 2 train.py",
            "_build_multi_worker",
            LAYOUT_LOCAL,
            multi_process=True,
        ),
        KindSpec(
            "tpu",
            "tpu: a Cloud TPU or a TPU VM.",
            "_build_tpu",
            LAYOUT_TPU,
            simulated_cpus=False,
            drop_remainder=True,
        ),
    )
}
STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)


def kinds_where(**facts: object) -> tuple[str, ...]:
    """The kinds whose entry has all the given facts, in table order.

    >>> kinds_where(accepts_devices=True)
    ('auto', 'one_device', 'mirrored')
    """
    return tuple(n for n, s in KINDS.items() if all(getattr(s, k) == v for k, v in facts.items()))
