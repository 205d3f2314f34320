"""`mlflow.system_metrics: true` logs MLflow's system metrics (CPU, memory) into the job's run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = (
    pytest.mark.slow
)  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`


def test_system_metrics_reach_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = textwrap.dedent(f"""
        import time, numpy as np, keras_sync
        sync = keras_sync.load({{"strategy": {{"kind": "default"}}, "batch": {{"per_replica": 16}},
                                 "mlflow": {{"tracking_uri": {uri!r}, "experiment": "sys", "system_metrics": True}}}})
        import keras
        class Slow(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                time.sleep(0.05)

        with sync.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(1024, 4)).astype("float32")
        sync.fit(model, x, x[:, :1], epochs=1, verbose=0, callbacks=[Slow()])  # ~3 s
        sync.close()
    """)
    env = dict(
        os.environ,
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="0.5",
        MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sys").experiment_id])
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
    } <= system, system
    assert "sync/step_time_ms" in run.data.metrics


def test_interval_that_is_not_positive_is_a_usage_error():
    from keras_sync.callbacks.system_metrics import SystemMetrics
    from keras_sync.errors import UsageError

    with pytest.raises(
        UsageError,
        match=r"Invalid value for argument `interval_s`\. Received: interval_s=0\. "
        r"Expected a number of seconds > 0\.",
    ):
        SystemMetrics(interval_s=0)
