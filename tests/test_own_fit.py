"""A user who calls `model.fit` themselves: `Sync.callbacks()`, the run handle (`sync.run_id`,
`sync.close()`), and the public `Writer` protocol with a writer of the user's own.

One subprocess on 2 simulated replicas (tests/_own_fit_scenario.py), a real sqlite MLflow store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a TensorFlow process

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("own_fit")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG")
    }
    r = subprocess.run(
        [sys.executable, str(HERE / "_own_fit_scenario.py"), str(out / "r.json"), uri],
        cwd=out,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads((out / "r.json").read_text()), "uri": uri}


def test_own_fit_with_sync_callbacks_logs_one_finished_run(result):
    from mlflow import MlflowClient

    assert result["run_id_before"] is None
    assert result["callbacks"][0] == "RuntimeSetup" and "SyncMetrics" in result["callbacks"]
    assert (
        result["callbacks"][-1] == "RunChecks"
    )  # last: it checks what the others set up and restored
    c = MlflowClient(result["uri"])
    (run,) = c.search_runs([c.get_experiment_by_name("own").experiment_id])
    assert run.info.run_id == result["run_id"] == result["run_id_after_close"]
    assert run.info.status == "FINISHED"  # sync.close() ended it
    for key in (
        "sync/loss/replica_0",
        "sync/loss/replica_1",
        "sync/loss_spread",
        "sync/learning_rate",
    ):
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, key)) == list(
            range(1, 17)
        ), key
    assert run.data.params["sync.num_replicas"] == "2"


def test_a_writer_of_the_users_own_gets_the_sync_metrics(result):
    assert result["is_writer"] is True
    assert result["own_steps"] == [2, 4, 6, 8]
    assert {"sync/loss/replica_0", "sync/grad_norm/replica_1", "sync/grad_norm_spread"} <= set(
        result["own_keys"]
    )
    assert result["own_params"]  # RunParams wrote the run's parameters through it


def test_callbacks_refuse_a_backup_dir_in_one_line(result):
    assert result["backup_refusal"].startswith(
        "Sync.callbacks cannot resume mid-epoch: fault_tolerance.backup_dir is set ('bk')"
    )
    assert "Fix: call sync.fit(model, ...)" in result["backup_refusal"]


def test_the_public_callbacks_give_the_same_points_in_any_order(result):
    forward, backward = result["forward"], result["reversed"]
    assert forward["points"] == backward["points"]
    steps = sorted({s for s, _ in forward["points"]})
    assert steps == list(
        range(1, 17)
    )  # 8 steps per epoch, 2 epochs, every step logged once per key
    for run in (forward, backward):
        assert run["divergence_steps"] == [
            8,
            16,
        ]  # at the sync metrics' step, not the optimizer's own count
        assert run["drawn"] == [
            8,
            16,
            16,
        ]  # each epoch's drawing has its last step (the report flushed first)
        assert (
            run["params"]["sync.global_batch_size"] == 32
            and run["params"]["sync.strategy"] == "mirrored"
        )


def test_auto_logging_thins_fast_steps_and_keeps_every_slow_one(result):
    fast, slow = result["auto_fast"], result["auto_slow"]
    # 3 epochs of 8 steps. Steps of a few ms: a round stride > 1, each epoch's last step kept.
    assert {8, 16, 24} <= set(fast["steps"]) and len(fast["steps"]) < 24, fast
    assert fast["stride"] in (2, 5, 10, 20, 50, 100, 200, 500, 1000), fast
    # Steps of >= 0.12 s: every one logged, and each point's step time covers its own step only.
    assert slow["steps"] == list(range(1, 25)) and slow["stride"] == 1, slow
    assert min(slow["step_time_ms"]) >= 120


def test_a_model_without_call_is_refused_before_training_in_one_line(result):
    from mlflow import MlflowClient

    assert result["no_call"].startswith(
        "Gan has no call() method, and under a distribution strategy Keras builds"
    )
    assert (
        "Fix: define call(self, inputs) in Gan" in result["no_call"]
        and "\n" not in result["no_call"]
    )
    c = MlflowClient(result["uri"])
    runs = c.search_runs([c.get_experiment_by_name("gan").experiment_id])
    assert [r.info.status for r in runs] == [
        "FINISHED"
    ]  # the GAN with call(); no FAILED run of the refused one


def test_the_optimizers_a_gan_step_applies_are_logged_not_compiles_rmsprop(result):
    from mlflow import MlflowClient

    c = MlflowClient(result["uri"])
    run = c.get_run(result["gan_run_id"])
    params = run.data.params
    assert params["d_optimizer_name"].startswith("sgd") and params["g_optimizer_name"].startswith(
        "sgd"
    )
    assert float(params["d_optimizer_learning_rate"]) == pytest.approx(0.02)
    assert float(params["g_optimizer_momentum"]) == pytest.approx(0.8)
    assert not any("rms" in v.lower() for v in params.values() if isinstance(v, str))
    assert "optimizer_name" not in params
    lr = [m.value for m in c.get_metric_history(run.info.run_id, "sync/learning_rate")]
    assert lr and all(v == pytest.approx(0.02) for v in lr)  # d_optimizer's: the first that applies
