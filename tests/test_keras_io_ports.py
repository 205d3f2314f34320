"""keras-io examples ported with keras-sync's three lines (issue 38): what the user sees on 2 replicas.

One process (tests/_keras_io_scenarios.py) runs every case on MirroredStrategy over 2 simulated
CPU replicas, writes what each saw, and ends as the user's script would: the distributed guide's
model with its layers built outside the scope, uncaught. The tests read its JSON, its output and
its exit code.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = (
    pytest.mark.slow
)  # starts a TensorFlow process; the fast lane is `pytest -m "not slow"`

HERE = Path(__file__).parent
GUIDE_FOLLOWS = "keras-io scenarios: the guide's model follows"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_io")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for var in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_TRACEBACK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "_keras_io_scenarios.py"), str(out / "out.json")],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return collect(out / "out.json", proc.returncode, proc.stdout, proc.stderr)


def collect(path, returncode, stdout, stderr):
    """What the tests read: the cases' JSON, and what the script printed after them."""
    assert path.exists(), f"the scenarios wrote no results (exit {returncode}):\n{stderr[-4000:]}"
    cases = json.loads(path.read_text())
    assert GUIDE_FOLLOWS in stderr, stderr[-4000:]
    return {
        "cases": cases,
        "returncode": returncode,
        "stdout": stdout,
        "guide": stderr.split(GUIDE_FOLLOWS, 1)[1].strip(),
    }


def case(run, name):
    result = run["cases"][name]
    assert not (isinstance(result, dict) and "unexpected" in result), result.get("tb", result)
    return result


def checks(said):
    return [line for line in said if line.startswith("keras-sync: check ")]


def test_gan_optimizers_at_the_scaled_rate_raise_no_learning_rate_alarm(run):
    """keras-io "Customizing what happens in fit()", the GAN: d_optimizer and g_optimizer set in compile().

    super().compile() makes a default RMSprop (0.001) that no step uses; the check must read the two
    optimizers the step applies (both at the scaled 0.0003): no line, no MLflow tag.
    """
    r = case(run, "gan")
    assert r["unused_default"] == pytest.approx(0.001) and r["scaled"] == pytest.approx(0.0003)
    assert r["steps"] == [4, 4]  # both optimizers trained every step (256 images / 64)
    assert checks(r["said"]) == []
    assert r["check_tags"] == {}


def test_gan_optimizer_at_its_own_rate_is_named(run):
    """keras-io "Customizing what happens in fit()", the GAN, with g_optimizer left at a rate of its own."""
    r = case(run, "gan_misscaled")
    assert checks(r["said"]) == [
        "keras-sync: check learning_rate failed: g_optimizer's learning rate is 0.002, but keras-sync scaled 0.0003 "
        "for the global batch 64 (learning_rate.scaling: linear): the rate your script gives it is used as it is. "
        "Fix: create g_optimizer with learning_rate=sync.lr_schedule() (or sync.learning_rate). "
        "(checks.on_violation: warn)"
    ]


def test_compile_jit_compile_true_on_cpu_replicas_trains_without_xla(run):
    """keras-io "Image classification from scratch": its compile line has jit_compile=True.

    On 2 CPU replicas XLA fails ("Trying to access resource ... CPU:1 from device CPU:0"); the model
    trains without XLA.
    """
    r = case(run, "image_jit")
    assert r["said"] == []
    assert not r["traceback"] and r["jit_compile"] is False
    assert math.isfinite(r["loss"][0]) and r["moved"] > 0


def test_compile_default_jit_compile_says_nothing(run):
    """keras-io "Image classification from scratch" with Keras's default jit_compile="auto": nothing to say."""
    r = case(run, "image_jit_auto")
    assert r["said"] == [] and r["jit_compile"] is False and r["moved"] > 0


def test_layers_built_outside_the_scope_end_the_script_in_one_line(run):
    """keras-io "Multi-GPU distributed training with TensorFlow": the Input/Dense lines of get_compiled_model()
    left above `with sync.scope():`, only keras.Model(...) and compile inside. The script ends with one line
    naming the fix (exit 2), not Keras's 45-line "colocate_vars_with" traceback."""
    assert run["returncode"] == 2, run["guide"][-4000:]
    assert "Traceback" not in run["guide"] and "the guide's model trained" not in run["stdout"]
    assert re.fullmatch(
        r"keras-sync: sync\.fit: layers of Functional were built outside sync\.scope\(\) \(dense_\d+, dense_\d+, "
        r"dense_\d+\), only the model was assembled inside: their variables are not the mirrored strategy's, and "
        r"Keras cannot train them under it\. Fix: build the whole model \(every layer, from keras\.Input on\) inside "
        r"`with sync\.scope\(\):`\.",
        run["guide"],
    ), run["guide"][-4000:]
