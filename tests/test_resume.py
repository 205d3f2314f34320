"""Exact-resume bookkeeping (keras_sync.training.backup_files, no TensorFlow).

A one-process kill and resume is in tests/test_backup_faults.py, the multi-worker kills in
tests/test_multi_worker.py.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys

import pytest

from keras_sync.errors import UsageError
from keras_sync.training import backup_files
from keras_sync.training.backup_files import ResumePoint, SaveSchedule, batches_to_skip, write_dir


def test_doctests_pass() -> None:
    assert doctest.testmod(backup_files).failed == 0


def test_integer_save_freq_counts_batches_across_epochs() -> None:
    s = SaveSchedule(4)
    due = [s.after_batch() for _ in range(10)]
    assert [i for i, d in enumerate(due) if d] == [3, 7]
    assert not s.after_epoch()


def test_epoch_save_freq_saves_only_at_epoch_end() -> None:
    s = SaveSchedule("epoch")
    assert not any(s.after_batch() for _ in range(100))
    assert s.after_epoch()


@pytest.mark.parametrize("bad", [0, -3, "batch", 2.5, True, None])
def test_invalid_save_freq_names_value_and_expected(bad: object) -> None:
    with pytest.raises(UsageError) as e:  # a KerasSyncError: one line, exit 2
        SaveSchedule(bad)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"Invalid value for argument `save_freq`. Received: save_freq={bad!r}. "
        "Expected 'epoch' or an integer number of batches >= 1."
    )


def test_only_the_chief_writes_the_backup_dir() -> None:
    assert write_dir("/b", is_chief=True, task_id=0) == "/b"
    assert write_dir("/b", is_chief=True, task_id=None) == "/b"
    assert write_dir("/b", is_chief=False, task_id=3) == os.path.join("/b", ".worker_tmp_3")


def test_resume_point_mid_epoch() -> None:
    assert ResumePoint(epoch=2, step=3, iterations=19).mid_epoch
    assert not ResumePoint(epoch=2, step=0, iterations=16).mid_epoch


def test_step_not_multiple_of_steps_per_execution_is_refused_with_fix() -> None:
    assert batches_to_skip(ResumePoint(1, 4, 12), steps_per_execution=2) == 4
    with pytest.raises(
        UsageError,
        match=r"taken at step 3 of epoch 1, which is not a multiple of "
        r"steps_per_execution=2\. Resume with the steps_per_execution",
    ):
        batches_to_skip(ResumePoint(1, 3, 11), steps_per_execution=2)


def test_backup_files_module_imports_no_tensorflow() -> None:
    code = "import sys, keras_sync.training.backup_files; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]


def test_backup_callback_rejects_empty_backup_dir() -> None:
    from keras_sync.callbacks.backup import BackupAndRestore
    from keras_sync.errors import UsageError

    with pytest.raises(
        UsageError, match=r"Invalid value for argument `backup_dir`\. Received: backup_dir=''\."
    ):
        BackupAndRestore("")
