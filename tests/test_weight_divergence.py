"""`WeightDivergence`: 0 for equal copies, and which variables differ (and by at least how much) when not."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_sync.measures import fingerprints as _fingerprints
from keras_sync.measures.fingerprints import summarize

HERE = Path(__file__).parent
SCENARIOS = HERE / "_weight_divergence_scenarios.py"
KERAS_SYNC = Path(sys.executable).with_name("keras-sync")


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def test_doctests_hold() -> None:
    assert doctest.testmod(_fingerprints).failed == 0


def test_equal_checksums_are_zero_even_when_the_statistics_are_not() -> None:
    # the checksum decides: float statistics of equal copies cannot differ, so this only guards the rule
    found = summarize([[[3, 4, 0.1, 0.2]], [[3, 4, 0.3, 0.2]]])
    assert (found.value, found.diverged_variables) == (0.0, 0)


def test_a_checksum_difference_counts_even_with_equal_statistics() -> None:
    found = summarize(
        [
            [[3, 4, 0.1, 0.2], [1, 1, 1, 1]],
            [[3, 5, 0.1, 0.2], [1, 1, 1, 1]],
            [[3, 4, 0.1, 0.2], [1, 1, 1, 1]],
        ]
    )
    assert (found.value, found.diverged_variables, found.variables) == (0.0, 1, 2)


def test_no_replicas_is_no_divergence() -> None:
    assert summarize([]) == _fingerprints.Divergence(0.0, 0, 0)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("wd") / "mirrored.json"
    r = subprocess.run(
        [sys.executable, str(SCENARIOS), "mirrored", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_mirrored_copies_after_fit_are_equal(mirrored: dict) -> None:
    assert mirrored["replicas"] == 2
    # 2 kernels, 2 biases, their 4 momentum slots, the iteration counter (+ the learning rate)
    assert mirrored["healthy"]["variables"] >= 9
    assert (mirrored["healthy"]["value"], mirrored["healthy"]["diverged"]) == (0.0, 0)


@pytest.mark.slow
def test_one_changed_element_is_found_and_bounded_by_the_exact_difference(mirrored: dict) -> None:
    found, exact = mirrored["one_element"], mirrored["one_element_exact"]
    assert exact == pytest.approx(0.5)
    assert found["diverged"] == 1
    # 0.5 in one of 8 x 16 elements: the mean moves by 0.5 / 128; the RMS by about as much or more
    assert 0.5 / 128 * 0.99 <= found["value"] <= exact


@pytest.mark.slow
def test_one_ulp_and_an_integer_counter_are_found_by_the_checksum(mirrored: dict) -> None:
    assert mirrored["one_ulp"]["diverged"] == 2
    assert mirrored["one_ulp"]["value"] <= mirrored["one_ulp_exact"]
    assert mirrored["iterations_is_mirrored"]
    assert mirrored["iterations"]["diverged"] == 3
    assert (mirrored["restored"]["value"], mirrored["restored"]["diverged"]) == (0.0, 0)


@pytest.mark.slow
def test_many_models_in_one_process_compare_without_a_retracing_warning(mirrored: dict) -> None:
    # One traced function per model is expected; TensorFlow warned after 5 of them (a sweep, a benchmark).
    assert mirrored["sweep"]["values"] == [0.0] * 7
    assert mirrored["sweep"]["retracing_warnings"] == []


@pytest.mark.slow
def test_each_fit_of_one_model_calls_one_traced_comparison(mirrored: dict) -> None:
    # Traced and placed again at every sync.fit, it cost more than all the sync metrics of a fit.
    assert mirrored["two_fits"] == {"points": 2, "traces": 1}


@pytest.mark.slow
def test_the_comparison_adds_few_ops_per_variable(mirrored: dict) -> None:
    # TensorFlow traces, places and optimizes every op of the comparison at the first epoch end: 64 ops
    # per variable (2 replicas) took 15.7 s of CPU for a model of 248 variables; 14 take 2.4 s.
    found = mirrored["ops_per_variable"]
    assert found["variables"] == [10, 50], found
    assert 0 < found["per_variable"] <= 16, found


@pytest.mark.slow
def test_callback_logs_both_metrics_at_each_epoch_end(mirrored: dict) -> None:
    steps = [step for _, step in mirrored["callback"]]
    assert steps == [
        8,
        12,
    ]  # 128 examples / global batch 32 = 4 steps per epoch, after the first fit's 4
    for metrics, _ in mirrored["callback"]:
        assert metrics == {"sync/weight_divergence": 0.0, "sync/diverged_variables": 0.0}


@pytest.mark.slow
def test_multi_worker_sees_a_copy_that_differs_on_the_other_worker(tmp_path: Path) -> None:
    out = tmp_path / "mw"
    r = subprocess.run(
        [str(KERAS_SYNC), "launch", "--workers", "2", str(SCENARIOS), "multi_worker", str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    workers = [json.loads((out / f"w{i}.json").read_text()) for i in (0, 1)]
    for w in workers:
        assert w["replicas"] == 2
        assert (w["healthy"]["value"], w["healthy"]["diverged"]) == (0.0, 0)
        assert w["one_element"]["diverged"] == 1 and 0 < w["one_element"]["value"] <= 0.5
    assert workers[0]["one_element"] == workers[1]["one_element"]  # every worker sees every copy
    chief = workers[0]["callback"]
    assert [m["sync/diverged_variables"] for m, _ in chief] == [
        1.0,
        1.0,
    ]  # fit keeps the copies apart
    assert workers[1]["callback"] is None
