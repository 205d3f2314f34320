"""The strategy kinds keras-sync knows: one entry each, and every question about a kind asks it
(config validation, the builders and device layouts of `keras_sync.strategy`, the templates)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Where a kind's replicas live on one worker (`keras_sync.strategy.device_layout`).
LAYOUT_TENSORFLOW = "tensorflow"  # no device list: TensorFlow's default device, no simulated CPUs
LAYOUT_LOCAL = "local"  # one replica per local device: simulated CPUs, devices, GPUs or the CPU
LAYOUT_ONE = "one"  # the first of the local devices
LAYOUT_TPU = "tpu"  # the TPU system names its cores when it starts
LAYOUTS = (LAYOUT_TENSORFLOW, LAYOUT_LOCAL, LAYOUT_ONE, LAYOUT_TPU)


@dataclass(frozen=True)
class KindSpec:
    """One strategy kind: name, template comment, builder, device layout (`LAYOUTS`) and its facts."""

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


# The comment of each kind's template section.
_SUMMARIES = {
    "auto": "auto: a TPU if one is attached; multi_worker_mirrored when TF_CONFIG (or Slurm) names several workers; mirrored with several GPUs or simulated CPU replicas; else default.",
    "default": "default: no distribution, TensorFlow's default device; plain Keras behaviour.",
    "one_device": "one_device: everything on one device (a good baseline to compare replicas against).",
    "mirrored": "mirrored: one replica per local device, gradients all-reduced every step.",
    "multi_worker_mirrored": "multi_worker_mirrored: several processes (machines), each with its local devices. Try it on one machine: keras-sync launch --workers 2 train.py",
    "tpu": "tpu: a Cloud TPU or a TPU VM.",
}


def _kind(name: str, layout: str, **facts: Any) -> KindSpec:
    """A table entry: its summary from `_SUMMARIES`, its builder ``_build_<name>`` (none for auto)."""
    builder = None if name == "auto" else f"_build_{name}"
    return KindSpec(name, _SUMMARIES[name], builder, layout, **facts)


KINDS: dict[str, KindSpec] = {
    spec.name: spec
    for spec in (
        _kind("auto", LAYOUT_LOCAL, accepts_devices=True),
        _kind("default", LAYOUT_TENSORFLOW, one_process=True, simulated_cpus=False, scoped=False),
        _kind("one_device", LAYOUT_ONE, one_process=True, accepts_devices=True, max_devices=1),
        _kind("mirrored", LAYOUT_LOCAL, one_process=True, accepts_devices=True),
        _kind("multi_worker_mirrored", LAYOUT_LOCAL, multi_process=True),
        _kind("tpu", LAYOUT_TPU, simulated_cpus=False, drop_remainder=True),
    )
}
STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)


def kinds_where(**facts: object) -> tuple[str, ...]:
    """The kinds whose entry has all the given facts, in table order.

    >>> kinds_where(accepts_devices=True)
    ('auto', 'one_device', 'mirrored')
    """
    return tuple(n for n, s in KINDS.items() if all(getattr(s, k) == v for k, v in facts.items()))
