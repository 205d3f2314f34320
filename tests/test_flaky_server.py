"""Delivery to a tracking server that fails a share of its requests: a real `mlflow server` behind
`tests/_flaky_proxy.py` (HTTP 500/503 at once for a seeded share of requests, the rest delayed).

Every point arrives once and the run ends FINISHED, at the end of the job and with one run of
``keras-sync sync-spool``; the courier's own retries are per request (`keras_sync.tracking.deliver`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from _flaky_proxy import FlakyProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
#: Delays of the requests the proxy lets through (seconds); the issue's setup used 0.5-2 s.
DELAY_S = (0.5, 2.0)


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID")
    }


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _runs(uri: str, experiment: str) -> list:
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id])


@pytest.fixture
def flaky(mlflow_server_control):
    mlflow_server_control.start()
    proxies: list[FlakyProxy] = []

    def make(fail: float, seed: int = 0) -> FlakyProxy:
        proxies.append(FlakyProxy(mlflow_server_control.port, fail, DELAY_S, seed=seed))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def test_a_run_behind_a_server_failing_30_percent_has_every_step_and_is_finished(
    flaky, mlflow_server, tmp_path
):
    proxy = flaky(0.3, seed=42)
    exp = f"flaky-{uuid.uuid4().hex[:6]}"
    script = textwrap.dedent(f"""
        import numpy as np, keras_sync, keras
        sync = keras_sync.load({{"strategy": {{"kind": "default"}}, "batch": {{"per_replica": 8}},
                                 "mlflow": {{"tracking_uri": {proxy.uri!r}, "experiment": {exp!r},
                                            "log_every_n_steps": 1}}}})
        with sync.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(300 * 8, 4)).astype("float32")
        sync.fit(model, x, x[:, :1], epochs=1, verbose=0)
    """)
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=dict(_env(), TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    exited = time.monotonic()
    assert r.returncode == 0, r.stderr[-3000:]
    done = None
    while time.monotonic() - exited < 120:
        runs = _runs(mlflow_server, exp)
        if len(runs) == 1 and runs[0].info.status == "FINISHED":
            done = runs[0]
            break
        time.sleep(1)
    runs = _runs(mlflow_server, exp)
    print(f"proxy answered {dict(proxy.outcomes)}; stderr:\n{r.stderr[-3000:]}")
    assert done is not None, ([(x.info.run_id, x.info.status) for x in runs], r.stderr[-3000:])
    assert proxy.failed() > 0
    assert _steps(mlflow_server, done.info.run_id, "sync/loss/replica_0") == list(range(1, 301))
    assert "unreachable" not in r.stderr


def test_sync_spool_run_once_delivers_everything_through_40_percent_failures(
    flaky, mlflow_server, tmp_path
):
    from keras_sync.tracking import MlflowWriter

    exp = f"flaky-spool-{uuid.uuid4().hex[:6]}"
    w = MlflowWriter(
        tracking_uri="http://127.0.0.1:1", experiment=exp, job_id="flaky-j", spool_dir=tmp_path
    )
    w.start()
    w.log_params({"lr": 0.1, "epochs": 3})
    w.log_text_artifact("a: 1\n", "config.yaml")
    w.log_text_artifact("b: 2\n", "notes.txt")
    for s in range(600):
        w.log_metrics({"loss": 1.0 / (s + 1), "acc": s / 600}, step=s)
    with pytest.warns(RuntimeWarning, match="keras-sync sync-spool"):
        w.close(timeout_s=30)
    proxy = flaky(0.4, seed=7)
    keras_sync_cli = str(Path(sys.executable).with_name("keras-sync"))
    r = subprocess.run(
        [keras_sync_cli, "sync-spool", str(w.spool_path), "--tracking-uri", proxy.uri],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=600,
    )
    print(f"proxy answered {dict(proxy.outcomes)}; stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    assert r.returncode == 0, r.stderr
    assert "sent 1200 metric point(s)" in r.stdout
    assert proxy.failed() > 0
    (run,) = _runs(mlflow_server, exp)
    assert run.info.status == "FINISHED"
    assert _steps(mlflow_server, run.info.run_id, "loss") == list(range(600))
    assert _steps(mlflow_server, run.info.run_id, "acc") == list(range(600))
    assert run.data.params == {"lr": "0.1", "epochs": "3"}
    assert not w.spool_path.exists()
