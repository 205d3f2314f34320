"""An epoch trained as on one device: an uneven last batch, `batch_size` given to fit, run-time checks.

Logical CPU devices are fixed once per process, so 2 mirrored replicas (then one device, on CPU:0
of the same process) and 2 workers (`keras-sync launch --workers 2`) each run
tests/_epoch_scenarios.py (both at once); the tests compare what they recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = (
    pytest.mark.slow
)  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`

HERE = Path(__file__).parent
COUNTS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("epoch")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    procs = {
        "devices": subprocess.Popen(
            [sys.executable, str(HERE / "_epoch_scenarios.py"), "devices", str(out)],
            cwd=out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    }
    # 2 workers (one replica each) through the CLI a user runs.
    keras_sync = Path(sys.executable).with_name("keras-sync")
    procs["mw"] = subprocess.Popen(
        [
            str(keras_sync),
            "launch",
            "--workers",
            "2",
            str(HERE / "_epoch_scenarios.py"),
            "mw",
            str(out),
        ],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        logs = {name: proc.communicate(timeout=480)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():  # one timed out: no stray process
            if proc.poll() is None:
                proc.kill()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"scenario process {name} failed:\n{logs[name][-4000:]}"
    results = {n: json.loads((out / f"{n}.json").read_text()) for n in (*COUNTS, "mw")}
    for n, r in results.items():
        bad = {k: v for k, v in r.items() if isinstance(v, dict) and "unexpected" in v}
        assert not bad, f"{n}: " + json.dumps(bad, indent=1)
    return results


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float((np.abs(a - b) / np.maximum(np.abs(a), 1e-12)).max())


@pytest.mark.parametrize("n", (2, "mw"))
def test_uneven_last_batch_equals_one_device(runs, n):
    """331 examples at global batch 32: the last batch of 11 splits 6/5 over 2 replicas or 2 workers
    (Keras alone, 2 replicas: weights 1.8e-2 off one device, val_loss 0.28%, evaluate 0.067%)."""
    one, two = runs[1]["uneven_last_batch"], runs[n]["uneven_last_batch"]
    assert float(np.abs(np.array(one["weights"]) - np.array(two["weights"])).max()) <= 1e-5
    for key in ("loss", "val_loss", "mae"):
        assert rel(one[key], two[key]) <= 1e-5, (key, one[key], two[key])
    for key in ("loss", "mae"):
        assert rel(one["evaluate"][key], two["evaluate"][key]) <= 1e-5, (
            key,
            one["evaluate"],
            two["evaluate"],
        )


@pytest.mark.parametrize("n", (2, "mw"))
def test_a_masked_loss_equals_one_device_in_fit_and_evaluate(runs, n):
    """Each replica's loss is a mean over its own unpadded tokens; weighed by its examples alone,
    the weights ended 7e-3 off one device's."""
    one, two = runs[1]["masked_sequences"], runs[n]["masked_sequences"]
    assert float(np.abs(np.array(one["weights"]) - np.array(two["weights"])).max()) <= 1e-5
    for key in ("loss", "val_loss", "evaluate"):
        assert rel(one[key], two[key]) <= 1e-5, (key, one[key], two[key])


def test_no_check_fires_on_a_correct_fit(runs):
    assert runs["mw"]["uneven_last_batch"]["checks"] == []
    for n in COUNTS:
        assert runs[n]["uneven_last_batch"]["checks"] == []
        assert runs[n]["resume_clean"] == {"checks": [], "resumed": True}


def test_batch_size_argument_is_the_global_batch(runs):
    """batch_size=64 from a plain Keras script: 64 per step on one device and on 2 replicas (32 each)."""
    one, two = runs[1]["batch_size_global"], runs[2]["batch_size_global"]
    assert float(np.abs(np.array(one["weights"]) - np.array(two["weights"])).max()) <= 1e-5
    assert rel(one["loss"], two["loss"]) <= 1e-5
    assert two["checks"] == [] and two["warnings"] == []


def test_batch_size_with_a_scaled_rate_is_refused_with_the_fix(runs):
    assert runs[2]["batch_size_refused"] == {
        "error": "UsageError",
        "message": (
            "sync.fit(batch_size=64): the learning rate 0.05 was scaled for the configured global batch 32. "
            "Fix: set batch.global: 64 in the config, or leave batch_size out."
        ),
    }


def test_learning_rate_check_says_the_compile_line_wins(runs):
    r = runs[2]["learning_rate_warn"]
    assert r["scaled"] == pytest.approx(0.002)
    assert r["checks"] == [
        "keras-sync: check learning_rate failed: the optimizer's learning rate is 0.001, but keras-sync scaled 0.002 "
        "for the global batch 32 (learning_rate.scaling: linear): the rate of your compile line is used as it is. "
        "Fix: compile with the optimizer's learning_rate=sync.lr_schedule() (or sync.learning_rate). "
        "(checks.on_violation: warn)"
    ]


def test_on_violation_error_stops_the_fit_with_the_line(runs):
    r = runs[2]["learning_rate_error"]
    assert r["error"] == "CheckFailed"
    assert r["message"].startswith(
        "check learning_rate failed: the optimizer's learning rate is 0.001, but "
    )
    assert r["message"].endswith("(checks.on_violation: error)")


def test_direct_model_fit_is_said_in_one_line(runs):
    lines = runs[2]["direct_fit"]["checks"]
    assert len(lines) == 1 and lines[0].startswith(
        "keras-sync: check direct_fit failed: model.fit called on Sequential, built in sync.scope(), without "
        "keras-sync: Keras batches arrays by its own batch_size (32 unless given)"
    )


@pytest.mark.parametrize("n", COUNTS)
def test_examples_per_step_check_fires_on_a_smaller_batch(runs, n):
    assert runs[n]["examples_per_step"]["checks"] == [
        "keras-sync: check examples_per_step failed: epoch 1: 21 train steps took 331 examples (15.8 per step), but "
        "the learning rate was scaled for a global batch of 32. (checks.on_violation: warn)"
    ]


def test_a_restore_over_the_backup_stops_the_fit_without_a_resume_line(runs):
    # Something restored over keras-sync's backup (a callback resets the optimizer step, as Keras's
    # BackupAndRestore next to it did): the backup's own check stops the fit in one line before the
    # resume line is printed (so checks.on_violation does not apply: a false resume is never trained).
    r = runs[2]["resume_tampered"]
    assert r["error"] == "UsageError", r
    assert (
        r["message"].startswith("keras-sync's backup in ")
        and (
            "restored optimizer step 11, but another callback changed it to 0 before training resumed"
        )
        in r["message"]
    )


def test_a_violation_is_an_mlflow_tag(runs):
    r = runs[2][
        "learning_rate_warn"
    ]  # the fit of test_learning_rate_check_says_the_compile_line_wins
    assert len(r["checks"]) == 1
    assert r["tags"] == {
        "keras_sync.check.learning_rate": r["checks"][0]
        .removeprefix("keras-sync: check learning_rate failed: ")
        .removesuffix(". (checks.on_violation: warn)")
    }


@pytest.mark.parametrize("n", COUNTS)
def test_examples_per_epoch_check_fires_on_an_epoch_stopped_early(runs, n):
    # A deliberately broken epoch (a callback stops it after 3 of 11 steps): the check, not a rule about
    # the input, must notice that examples of the data were not trained.
    r = runs[n]["stopped_mid_epoch"]
    assert r["trained"] == 96
    assert r["checks"] == [
        "keras-sync: check examples_per_epoch failed: epoch 1: the epoch trained 96 examples (all replicas and "
        "workers), but the data has 331: 235 were not trained. (checks.on_violation: warn)"
    ]


def test_examples_per_epoch_check_fires_when_examples_are_not_trained(runs):
    """2 workers each pass their own part (shard policy OFF) batched by the global batch: Keras counts
    the steps from the part's cardinality while each step takes half a global batch per worker
    (measured: 192 of 331 trained). Either every example trains or the check says how many did not."""
    r = runs["mw"]["own_parts"]
    if r["trained"] == r["data"]:
        assert r["checks"] == []
    else:
        assert r["checks"] == [
            f"keras-sync: check examples_per_epoch failed: epoch 1: the epoch trained {r['trained']} examples (all "
            f"replicas and workers), but the data has {r['data']}: {r['data'] - r['trained']} were not trained. "
            "(checks.on_violation: warn)"
        ]
