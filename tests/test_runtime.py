"""The training step on N replicas equals one device: custom train_step gradients and the `runtime` section.

Real strategies: tests/_runtime_scenarios.py runs on one device, on 2 simulated CPU replicas
(MirroredStrategy) and as 2 workers through `keras-sync launch` (MultiWorkerMirroredStrategy), all
three started at once; the tests compare what each recorded.
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

from keras_sync import _train_step_trace
from keras_sync.config import load_config
from keras_sync.errors import ConfigError

HERE = Path(__file__).parent
TOLERANCE = 1e-5


def test_train_step_trace_doctests():
    assert doctest.testmod(_train_step_trace).failed == 0


def test_averaging_message_names_the_model_the_factor_and_the_switch():
    class MyModel:
        pass

    msg = _train_step_trace.averaging_message(MyModel(), 4)
    assert "\n" not in msg
    assert msg.startswith("keras-sync: MyModel.train_step does not divide its loss by the replica count")
    assert "divides them by 4 at the optimizer" in msg
    assert msg.endswith("set runtime.train_step_gradients: sum.")


def test_train_step_gradients_bad_value_names_file_line_and_close_match(tmp_path):
    path = tmp_path / "ks.yaml"
    path.write_text("batch: {per_replica: 8}\nruntime:\n  train_step_gradients: averge\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == (f"{path}:3: runtime.train_step_gradients: received 'averge', expected one of auto, "
                              "average, sum; did you mean 'average'?")


def test_runtime_defaults():
    assert load_config({}).runtime.train_step_gradients == "auto"


# ---- real training runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    script = str(HERE / "_runtime_scenarios.py")
    cmds = {
        "one": [sys.executable, script, "replicas", "1", str(out / "one.json")],
        "two": [sys.executable, script, "replicas", "2", str(out / "two.json")],
        "workers": [sys.executable, "-m", "keras_sync.launch", "--workers", "2", script, "workers",
                    str(out / "workers.json")],
    }
    procs = {name: subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in cmds.items()}
    results, logs = {}, {}
    for name, proc in procs.items():
        logs[name], _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"{name} failed:\n{logs[name][-5000:]}"
        results[name] = json.loads((out / f"{name}.json").read_text())
    results["logs"] = logs
    return results


def _ok(result):
    assert not (isinstance(result, dict) and "unexpected" in result), result.get("tb", result)
    return result


def _diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


CUSTOM = ("guide", "compute_loss", "divided", "average_loss")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_custom_train_steps_on_two_replicas_and_two_workers_equal_one_device(runs):
    one = _ok(runs["one"]["custom_steps"])
    assert runs["two"]["num_replicas"] == 2
    assert runs["workers"]["num_replicas"] == 2 and runs["workers"]["num_workers"] == 2
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["custom_steps"])
        for name in ("keras", *CUSTOM):
            assert _diff(res[name]["weights"], one[name]["weights"]) <= TOLERANCE, (layout, name)
    # ... and the model trained: a step of the guide's model with Keras's sum is 2x, and ends elsewhere.
    two = runs["two"]["custom_steps"]
    assert _diff(two["guide_sum"]["weights"], one["guide"]["weights"]) > 100 * TOLERANCE
    assert _diff(one["guide"]["weights"], runs["one"]["custom_steps"]["guide_sum"]["weights"]) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_what_divided_the_loss_is_detected_and_only_an_undivided_loss_is_averaged(runs):
    trace = {name: v["trace"] for name, v in _ok(runs["two"]["custom_steps"]).items() if "trace" in v}
    assert trace["guide"] == {"scaled_by": None, "factor": 0.5}
    assert trace["compute_loss"] == {"scaled_by": "a Keras loss", "factor": 1.0}
    assert trace["divided"] == {"scaled_by": "num_replicas_in_sync", "factor": 1.0}
    assert trace["average_loss"] == {"scaled_by": "tf.nn.compute_average_loss", "factor": 1.0}
    # One line, on the chief only, before training, for the model keras-sync averages.
    for layout, expected in (("two", 1), ("workers", 1)):
        lines = [ln for ln in runs["logs"][layout].splitlines() if "does not divide its loss" in ln]
        assert len(lines) == expected, (layout, lines)
        assert "GuideStep.train_step" in lines[0] and "runtime.train_step_gradients: sum" in lines[0]
    assert "[w0]" in [ln for ln in runs["logs"]["workers"].splitlines() if "does not divide" in ln][0]


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_custom_train_steps_get_the_same_per_replica_loss_and_grad_norm_as_keras_step(runs):
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["custom_steps"])
        keras_step = res["keras"]
        assert keras_step["steps"] == 16 and len(keras_step["loss"]) == 16
        # Replicas see different halves of each batch: their values differ.
        assert all(abs(a - b) > 1e-6 for a, b in keras_step["loss"])
        for name in CUSTOM:
            for key in ("loss", "grad_norm"):
                assert _diff(res[name][key], keras_step[key]) <= 1e-4 * max(1.0, _diff(keras_step[key], 0)), (layout, name, key)
