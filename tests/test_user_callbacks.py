"""The user's own callbacks and models that cannot work beside keras-sync's, refused before training.

tests/_env_scenarios.py runs on 2 simulated CPU replicas (MirroredStrategy) and as 2 workers through
`keras-sync launch` (MultiWorkerMirroredStrategy). Refused there, each in one line and before the
first batch: ReduceLROnPlateau/LearningRateScheduler with the warmup schedule (Keras stopped with a
TypeError after an epoch); Keras's BackupAndRestore beside fault_tolerance.backup_dir (after a
relaunch it overwrote keras-sync's restore: 0.546 off and a false "resumed" line); a Keras 2
(tf_keras) model (a false "built outside sync.scope()" line, or a TypeError from the warmup).
tf_keras is not a dependency (it requires the full `tensorflow` distribution): the fixture
downloads the release matching the installed TensorFlow, without its dependencies, for the child only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))
BEFORE_TRAINING = 0


def _tf_keras(where: Path) -> Path:
    """The tf_keras release of the installed TensorFlow, unpacked into ``where/site`` (not installed)."""
    from keras_sync.upstream import stack

    tf_version = next(v for _, v in stack.tensorflow_distributions())
    major_minor = ".".join(tf_version.split(".")[:2])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(where),
            f"tf_keras=={major_minor}.*",
        ],
        check=True,
        timeout=300,
    )
    zipfile.ZipFile(next(where.glob("tf_keras-*.whl"))).extractall(where / "site")
    return where / "site"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    out = tmp_path_factory.mktemp("user_callbacks")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KS_TF_KERAS=str(_tf_keras(out / "tf_keras")))
    for k in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    script = str(HERE / "_env_scenarios.py")
    cmds = {
        "replicas": [sys.executable, script, "replicas", str(out / "replicas.json")],
        "workers": [
            KERAS_SYNC,
            "launch",
            "--workers",
            "2",
            script,
            "workers",
            str(out / "workers"),
        ],
    }
    procs = {
        name: subprocess.Popen(
            cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in cmds.items()
    }
    results = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} failed:\n{log[-5000:]}"
    results["replicas"] = json.loads((out / "replicas.json").read_text())
    for task in (0, 1):
        results[f"w{task}"] = json.loads((out / f"workers.w{task}.json").read_text())
    return results


def _refused(result: dict, starts: str) -> str:
    assert "unexpected" not in result, result.get("tb")
    assert result.get("error") == "UsageError", result
    assert result.get("batches", BEFORE_TRAINING) == BEFORE_TRAINING, result
    assert "\n" not in result["message"] and result["message"].startswith(starts), result["message"]
    return result["message"]


LAYOUTS = ("replicas", "w0", "w1")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lr_changing_callbacks_with_the_warmup_schedule_are_refused_before_training(
    scenarios, layout
):
    r = scenarios[layout]
    message = _refused(
        r["rlrop_warmup"],
        "callbacks of sync.fit: ReduceLROnPlateau sets the optimizer's learning rate",
    )
    assert "(GradualWarmup from sync.lr_schedule(), the learning_rate warmup)" in message
    assert "Fix: keep ReduceLROnPlateau and give the optimizer a float" in message
    _refused(
        r["scheduler_warmup"],
        "callbacks of sync.fit: LearningRateScheduler sets the optimizer's learning rate",
    )
    # Without a warmup the rate is a float and Keras sets it: 0.05 halved at each of 2 epochs.
    assert r["rlrop_no_warmup"]["trained"] and abs(r["rlrop_no_warmup"]["lr"] - 0.0125) < 1e-7
    # The composable way: a decay that takes over after the warmup (peak 0.1 at step 4).
    decay = r["warmup_then_decay"]
    assert decay["trained"] and decay["steps"] == 16
    assert {int(k): round(v, 6) for k, v in decay["lr_at"].items()} == {
        0: 0.05,
        2: 0.075,
        4: 0.1,
        12: 0.05,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_keras_backup_and_restore_beside_ours_is_refused_before_training(scenarios, layout):
    message = _refused(
        scenarios[layout]["keras_backup_pair"],
        "callbacks of sync.fit: keras.callbacks.BackupAndRestore(",
    )
    assert "cannot run beside keras-sync's own backup (fault_tolerance.backup_dir: " in message
    assert message.endswith("or remove fault_tolerance.backup_dir to keep Keras's.")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restore_overwritten_by_another_callback_stops_without_a_resume_line(scenarios):
    # The run-time check behind the refusal: any callback that moves the restored step is caught.
    r = scenarios["replicas"]["restored_state_overwritten"]
    message = _refused(r, "keras-sync's backup in ")
    assert (
        "restored optimizer step 4, but another callback changed it to 0 before training resumed"
        in message
    )
    assert "resumed from the backup" not in r["stderr"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_keras_2_model_is_refused_in_one_line_without_an_mlflow_run(scenarios):
    r = scenarios["replicas"]
    fit = _refused(
        r["keras2_fit"], "sync.fit got a Keras 2 model (tf_keras.src.engine.sequential.Sequential: "
    )
    assert "keras-sync supports Keras 3 only" in fit and "built outside sync.scope()" not in fit
    warm = r["keras2_warmup"]
    assert warm["at"] == "compile" and warm["message"].startswith(
        "sync.lr_schedule()'s warmup was called without a step, as a Keras 2 optimizer"
    )
    assert (
        not r["keras2_fit"]["mlflow_store"] and not warm["mlflow_store"]
    )  # no MLflow run, not even a store
