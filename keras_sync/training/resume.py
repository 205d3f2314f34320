"""Pure bookkeeping for exact resume: where training stands, when to save, where each worker writes.

A position is ``(epoch, step)``: the epoch in progress and the number of its batches already
trained. ``(2, 0)``: epoch 2 not started; ``(1, steps)``: every batch of epoch 1 trained but not
its end (validation, ``on_epoch_end``), so a resume runs only that end. No TensorFlow here; the
Keras glue is `keras_sync.callbacks.backup`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from keras_sync.errors import UsageError

# Under MultiWorkerMirroredStrategy every worker takes part in a save: the others write their share
# here, deleted after it; only the chief's copy is read back.
WORKER_TMP_PREFIX = ".worker_tmp_"


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored job continues: the epoch, its batches already trained, and the
    optimizer step count (``model.optimizer.iterations``) at that point."""

    epoch: int
    step: int
    iterations: int

    @property
    def mid_epoch(self) -> bool:
        return self.step > 0


class SaveSchedule:
    """When to save: after every epoch, or after every ``save_freq`` batches (counted across epochs).

    >>> s = SaveSchedule(3)
    >>> [s.after_batch() for _ in range(5)]
    [False, False, True, False, False]
    >>> SaveSchedule("epoch").after_batch(0), SaveSchedule("epoch").after_epoch()
    (False, True)
    """

    def __init__(self, save_freq: str | int):
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise UsageError(
                f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. "
                "Expected 'epoch' or an integer number of batches >= 1."
            )
        self.save_freq = save_freq
        self._since_save = 0

    def after_batch(self, batches: int = 1) -> bool:
        """Count ``batches`` trained; True when a save is due now."""
        if not isinstance(self.save_freq, int):
            return False
        self._since_save += batches
        if self._since_save < self.save_freq:
            return False
        self._since_save = 0
        return True

    def after_epoch(self) -> bool:
        return self.save_freq == "epoch"


def write_dir(backup_dir: str, *, is_chief: bool, task_id: int | None) -> str:
    """Where this worker writes checkpoints: the chief ``backup_dir``, worker N ``.worker_tmp_N`` in it.

    >>> write_dir("/b", is_chief=True, task_id=0), write_dir("/b", is_chief=False, task_id=1)
    ('/b', '/b/.worker_tmp_1')
    """
    if is_chief:
        return backup_dir
    return os.path.join(backup_dir, f"{WORKER_TMP_PREFIX}{task_id or 0}")


def batches_to_skip(point: ResumePoint, steps_per_execution: int = 1) -> int:
    """Batches of the resumed epoch trained before the interruption (saves end an execution).

    >>> batches_to_skip(ResumePoint(epoch=1, step=6, iterations=14))
    6
    """
    if point.step % steps_per_execution:
        raise UsageError(
            f"The backup was taken at step {point.step} of epoch {point.epoch}, which is not a multiple of "
            f"steps_per_execution={steps_per_execution}. Resume with the steps_per_execution it was saved "
            "with, or delete the backup directory to start over."
        )
    return point.step
