"""`keras-sync verify`: a distributed run against its one-device reference, through the real console script.

The slow tests run the user's script (tests/_verify_train.py, one case each) through `keras-sync
verify` on 2 simulated CPU replicas (`mirrored`) and as 2 local workers (`-n 2`), two at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))
SCRIPT = Path(__file__).with_name("_verify_train.py")
STEPS = "6"
_SETTINGS_ENV = ("KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI", "TF_CONFIG", "KERAS_SYNC_VERIFY_RECORD",
                 "KERAS_SYNC_VERIFY_REPLAY", "KERAS_SYNC_VERIFY_STEPS")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SETTINGS_ENV}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def run(*args: str, cwd: Path | str | None = None, timeout: float = 1200, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KERAS_SYNC, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


# -- usage errors (no TensorFlow) ---------------------------------------------------------------


def test_a_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    result = run("verify", "nope.py", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "verify: no such script: nope.py. Expected the training script to check (a Python file).\n"


def test_compare_with_workers_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    result = run("verify", "--compare", "rec", "-n", "2", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("verify: --compare FOLDER takes the recording as it is; -n/--workers applies only to a "
                             "run verify starts. Remove one of them.\n")


def test_compare_of_a_folder_without_a_recording_names_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "rec").mkdir()
    result = run("verify", "--compare", "rec", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("verify: the distributed run (rec) wrote no recording (rec/record.json: "
                                    "No such file or directory). Expected a script that calls sync.fit")
    assert "Traceback" not in result.stderr


def test_a_script_that_fails_is_a_usage_error_with_its_last_lines(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit('no data here')\n")
    result = run("verify", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[1:] == ["verify: the distributed run failed (exit 1); its last lines:",
                                              "no data here"]


def test_a_bad_steps_variable_names_it() -> None:
    from keras_sync.config import load_config
    from keras_sync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\$KERAS_SYNC_VERIFY_STEPS: received 'x', expected a number of optimizer "
                                          r"steps >= 1"):
        load_config({}, environ={"KERAS_SYNC_VERIFY_RECORD": "/tmp/r", "KERAS_SYNC_VERIFY_STEPS": "x"})


def test_a_reference_run_takes_the_recordings_one_device_settings(tmp_path: Path) -> None:
    from keras_sync.config import load_config

    (tmp_path / "reference.json").write_text(json.dumps({"strategy.kind": "default", "strategy.simulated_cpu_replicas": 0, "batch.per_replica": None,
                                                         "batch.global": 4, "runtime.gradient_accumulation_steps": 2}))
    cfg = load_config({"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "batch": {"per_replica": 4}},
                      environ={"KERAS_SYNC_VERIFY_RECORD": "/tmp/r", "KERAS_SYNC_VERIFY_REPLAY": str(tmp_path)})
    assert (cfg.strategy.kind, cfg.batch.global_, cfg.runtime.gradient_accumulation_steps) == ("default", 4, 2)
    assert (cfg.verify.steps, cfg.verify.mlflow, cfg.mlflow.enabled) == (20, True, False)
    assert cfg.source_of("strategy.kind") == "env"
