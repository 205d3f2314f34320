"""Exact-resume bookkeeping (keras_sync.training.backup_files, no TensorFlow) and a one-process kill and resume.

The multi-worker kill tests are in tests/test_multi_worker.py.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _mwr import TRAIN, kill_and_resume, max_diff, result

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


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_one_process_default_strategy_sigkill_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    """kind=default with arrays in a seeded script: Keras's own shuffle draws the same order again, so a
    resume replays it, and the weights equal those of the same script without a backup.

    The model has a Dropout layer: its seed state is in the backup too, so the resumed run draws
    the masks the uninterrupted one drew (without it: weights far apart, seen in a user trial).
    """
    cfg = {
        "strategy": {"kind": "default"},
        "batch": {"global": 32},
        "mlflow": {"enabled": False},
        "learning_rate": {"base": 0.01},
        "fault_tolerance": {"save_freq": 3},
    }
    a, b, second = kill_and_resume(
        tmp_path, cfg, kill_at=22, timeout=120, args=("--dropout", "0.25")
    )
    assert b["start"] == {"iterations": 21, "epoch": 2}  # step 21 = epoch 2 after 5 of 8 batches
    assert second.stdout.splitlines()[0] == "step 22 epoch 2 batch 5"
    assert max_diff(a["weights"], b["weights"]) <= 1e-6
    assert np.allclose(b["loss"], a["loss"][2:], rtol=1e-6, atol=0)
    # The backup changes nothing but the ability to resume: the same seeded script without
    # backup_dir trains the same weights (0.13 apart when a backup reshuffled the arrays itself).
    plain = {k: v for k, v in cfg.items() if k != "fault_tolerance"}
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    r = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            json.dumps(plain),
            str(tmp_path / "plain"),
            "--dropout",
            "0.25",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert max_diff(a["weights"], result(tmp_path / "plain")["weights"]) == 0.0
