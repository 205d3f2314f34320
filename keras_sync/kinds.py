"""The strategy kinds keras-sync knows, one entry each: what a kind is, in words for a user.

Pure Python (no TensorFlow): `config.py` validates `strategy.kind` against this table and the
config reference (`keras_sync.config_reference`) writes each kind's commented ``strategy:``
section of the ``keras-sync init`` template from it. Which `strategy.*` keys apply to a kind is
declared on the keys themselves (the ``kinds`` metadata of the fields in `config.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindSpec:
    """One strategy kind.

    Args:
        name: the value of `strategy.kind`.
        summary: what the kind does, one or two sentences (the template's comment above it).
    """

    name: str
    summary: str


KINDS: dict[str, KindSpec] = {spec.name: spec for spec in (
    KindSpec("auto", "auto: a TPU if one is attached; multi_worker_mirrored when TF_CONFIG (or Slurm) names "
                     "several workers; mirrored with several GPUs or simulated CPU replicas; else default."),
    KindSpec("default", "default: no distribution, TensorFlow's default device; plain Keras behaviour."),
    KindSpec("one_device", "one_device: everything on one device (a good baseline to compare replicas against)."),
    KindSpec("mirrored", "mirrored: one replica per local device, gradients all-reduced every step."),
    KindSpec("multi_worker_mirrored", "multi_worker_mirrored: several processes (machines), each with its local "
                                      "devices. Try it on one machine: keras-sync launch --workers 2 train.py"),
    KindSpec("tpu", "tpu: a Cloud TPU or a TPU VM."),
)}

STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)
