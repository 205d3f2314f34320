"""`load()` and `Sync` on real strategies: MirroredStrategy over 2 and 4 simulated CPU replicas vs one device.

Logical CPU devices are fixed once per process, so each device split runs tests/_core_scenarios.py
in its own subprocess (both at once): 4 replicas, and 2 replicas followed by one device (CPU:0 of
the same process: one device needs no split); the tests read what each pass recorded.
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
COUNTS = (1, 2, 4)


# The cases of tests/_core_scenarios.py each test reads (tests/_scenario.py::wanted_cases); the
# reference fit and the replica facts run always. `pytest -m compat` (the CI lanes, beside the main
# suite) then trains that one fit per process instead of every case's.
NEEDS = {
    "test_replicas_and_batches": set(),
    "test_mirrored_equals_one_device": set(),
    "test_training_really_changed_the_weights": set(),
    "test_distribute_batches_by_global_batch": {"distribute"},
    "test_evaluate_and_predict": {"evaluate", "predict_shape"},
    "test_model_outside_scope_is_refused": {"outside_scope"},
    "test_batch_size_zero_is_refused": {"bad_batch_size"},
    "test_steps_per_execution_trains_on_every_replica_count": {"steps_per_execution"},
    "test_warmup_epochs_resolved_by_fit": {"warmup"},
    "test_cross_device_ops_reach_tensorflow": {"cross_device_ops", "nccl_on_cpu"},
    "test_fit_does_not_wait_for_the_iterators_it_drops": {"iterator_release"},
    "test_devices_are_checked": {"unknown_device", "explicit_devices"},
    "test_global_batch_must_divide": {"global_not_divisible"},
    "test_load_after_tensorflow_started_says_so": {"too_late"},
    "test_tpu_fails_fast_naming_the_address": {"tpu"},
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    from _scenario import WANTED_ENV, wanted_cases

    out = tmp_path_factory.mktemp("core")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.pop(WANTED_ENV, None)
    wanted = wanted_cases(request, "runs", NEEDS)
    if wanted is not None:
        env[WANTED_ENV] = wanted
    procs = {
        n: subprocess.Popen(
            [sys.executable, str(HERE / "_core_scenarios.py"), str(n), str(out)],
            cwd=out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (2, 4)
    }  # the 2-replica process runs the one-device pass after its own
    for n, proc in procs.items():
        log, _ = proc.communicate(timeout=480)
        assert proc.returncode == 0, f"scenario process {n} failed:\n{log[-4000:]}"
    results = {}
    for n in COUNTS:
        results[n] = json.loads((out / f"{n}.json").read_text())
        results[n]["weights"] = np.load(out / f"{n}.json.weights.npy")
    return results


def no_unexpected(result):
    bad = {k: v for k, v in result.items() if isinstance(v, dict) and "unexpected" in v}
    assert not bad, json.dumps(bad, indent=1)


@pytest.mark.parametrize("n", COUNTS)
def test_replicas_and_batches(runs, n):
    r = runs[n]
    no_unexpected(r)
    assert r["num_replicas"] == n and r["global"] == 64 and r["per_replica"] == 64 // n
    assert r["kind"] == ("mirrored" if n > 1 else "one_device")
    assert len(r["devices"]) == n and r["is_chief"] and r["num_workers"] == 1
    assert r["history_type"] == "History"


@pytest.mark.compat
@pytest.mark.parametrize("n", (2, 4))
def test_mirrored_equals_one_device(runs, n):
    diff = float(np.abs(runs[n]["weights"] - runs[1]["weights"]).max())
    assert diff <= 1e-5, f"{n} replicas drifted from one device by {diff}"
    assert runs[n]["loss"] == pytest.approx(runs[1]["loss"], rel=1e-5)


def test_training_really_changed_the_weights(runs):
    # Guard against an equality that holds because nothing trained.
    assert runs[1]["loss"][-1] < 0.5 * runs[1]["loss"][0]


@pytest.mark.parametrize("n", COUNTS)
def test_distribute_batches_by_global_batch(runs, n):
    d = runs[n]["distribute"]
    assert d["batch_shape"] == [64, 8] and d["cardinality"] == 10
    assert d["max_diff_vs_arrays"] <= 1e-6


def test_evaluate_and_predict(runs):
    assert runs[2]["evaluate"] == pytest.approx(runs[1]["evaluate"], rel=1e-5)
    assert runs[2]["predict_shape"] == [640, 1]


@pytest.mark.parametrize("n", (2, 4))
def test_model_outside_scope_is_refused(runs, n):
    assert runs[n]["outside_scope"] == {
        "error": "UsageError",
        "message": f"The model was built outside sync.scope(), so sync.fit cannot distribute it over {n} replicas. "
        "Fix: create and compile the model inside `with sync.scope():`.",
    }


def test_batch_size_zero_is_refused(runs):
    # A valid batch_size (the global batch, as Keras reads it under a tf.distribute strategy, with its
    # warning) is tests/test_epoch.py::test_batch_size_argument_is_the_global_batch, which also
    # compares the weights with one device's.
    assert runs[2]["bad_batch_size"]["message"].startswith(
        "Invalid value for argument `batch_size` of sync.fit. Received: batch_size=0."
    )


@pytest.mark.parametrize("n", COUNTS)
def test_steps_per_execution_trains_on_every_replica_count(runs, n):
    # Once refused with replicas (keras-team/keras#19246); measured equal to spe=1 under
    # MirroredStrategy (tests/test_runtime.py compares the weights), so any count trains.
    assert runs[n]["steps_per_execution"] == "trained"


@pytest.mark.parametrize("n", COUNTS)
def test_warmup_epochs_resolved_by_fit(runs, n):
    w = runs[n]["warmup"]
    # base 0.1 tuned at batch 32; global 64 -> linear peak 0.2; one epoch = 640 / 64 = 10 steps.
    assert w["peak"] == pytest.approx(0.2) and w["warmup_steps"] == 10 and w["iterations"] == 10
    assert w["values"] == pytest.approx([0.1 + 0.01 * i for i in range(11)] + [0.2], abs=1e-6)
    assert w["roundtrip"] == pytest.approx([0.1, 0.15, 0.2, 0.2], abs=1e-6)


def test_cross_device_ops_reach_tensorflow(runs):
    ops = runs[2]["cross_device_ops"]
    assert ops["hierarchical_copy"]["ops"] == "HierarchicalCopyAllReduce"
    assert ops["reduction_to_one"]["ops"] == "ReductionToOneDevice"
    assert (
        ops["auto"]["ops"] == "ReductionToOneDevice"
    )  # CPU-only host: see strategy._cross_device_ops
    assert all(v["max_diff"] <= 1e-5 for v in ops.values())
    assert runs[2]["nccl_on_cpu"]["message"].startswith(
        "strategy.cross_device_ops='nccl' needs GPUs"
    )


def test_fit_does_not_wait_for_the_iterators_it_drops(runs):
    # The generator behind the fit's iterator is closed when that iterator is destroyed, and waits
    # there until fit has returned: True only when the destruction is off the training thread
    # (keras_fixes.RELEASER). Before: fit blocked there for the wait's 30 s, and each wait was False.
    r = runs[2]["iterator_release"]
    assert "waited" in r, r
    assert (
        r["waited"] and all(r["waited"]) and r["released"] and r["iterations"] == 8 + 2 * 640 // 64
    ), r
    # Every distributed iterator fit made is destroyed, none on the training thread (the one
    # fit's loop kept in a local was, before: destroyed_on ended with "MainThread").
    assert len(r["destroyed_on"]) >= 2 and "MainThread" not in r["destroyed_on"], r


def test_devices_are_checked(runs):
    assert runs[4]["unknown_device"]["message"] == (
        "Invalid value for strategy.devices. Received: '/gpu:7'. Expected devices TensorFlow sees here: "
        "CPU:0, CPU:1, CPU:2, CPU:3."
    )
    assert runs[4]["explicit_devices"] == 2


def test_global_batch_must_divide(runs):
    assert runs[4]["global_not_divisible"]["message"].startswith(
        "Invalid value for batch.global. Received: global=63 with 4 replicas."
    )


def test_load_after_tensorflow_started_says_so(runs):
    r = runs[1]["too_late"]
    assert r["error"] == "StrategyError"
    assert (
        "TensorFlow has already initialised its devices in this process. Call keras_sync.load() first"
        in r["message"]
    )


def test_tpu_fails_fast_naming_the_address(runs):
    r = runs[1]["tpu"]
    assert r["error"] == "StrategyError" and "\n" not in r["message"]
    assert r["message"].startswith("Cannot reach a TPU at strategy.tpu.name='local'")
