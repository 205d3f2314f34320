"""`sync.fit` ends its MLflow run when it returns, and the next `fit` of the same `Sync` continues
that run through the same courier process: one run, FINISHED, steps once.

Where the process is killed as soon as training returns (Ray Train V2 kills its workers without
atexit; `RAY_RAYLET_PID` marks a Ray worker) fit waits until MLflow has everything, and the
orphaned courier removes the spool. Elsewhere fit returns when training is done; the exit waits
for what is left, with one line, and MLflow then has every step and a FINISHED run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from keras_sync.tracking.spool import SpoolDir

pytestmark = pytest.mark.slow


def test_fit_ends_the_run_and_the_next_fit_continues_it_where_training_returns_kill_the_process(
    tmp_path,
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = textwrap.dedent(f"""
        import json, os, numpy as np, keras_sync
        from keras_sync.tracking.spool import SpoolDir

        def couriers():  # this process's courier children
            me, found = str(os.getpid()), []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
                    cmd = open(f"/proc/{{pid}}/cmdline").read()
                except OSError:
                    continue
                if stat[1] == me and "keras_sync.tracking.courier" in cmd:
                    found.append(int(pid))
            return found
        from mlflow import MlflowClient
        sync = keras_sync.load({{"strategy": {{"kind": "default"}}, "batch": {{"per_replica": 16}},
                                 "mlflow": {{"tracking_uri": {uri!r}, "experiment": "e", "log_every_n_steps": 1}}}})
        import keras
        with sync.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
        c = MlflowClient({uri!r})
        out = {{}}
        for i in (1, 2):
            sync.fit(model, x, x[:, :1], epochs=1, verbose=0)
            runs = c.search_runs([c.get_experiment_by_name("e").experiment_id])
            out[i] = [(r.info.run_id, r.info.status) for r in runs]
            out[f"couriers{{i}}"] = couriers()
            out[f"undelivered{{i}}"] = [rec["k"] for n in os.listdir(".keras_sync_spool")
                                        for spool in [SpoolDir(os.path.join(".keras_sync_spool", n))]
                                        for _, rec in spool.read(spool.delivered(), max_records=10**6)]
        out["steps"] = sorted(m.step for m in c.get_metric_history(runs[0].info.run_id, "sync/loss/replica_0"))
        print("RESULT " + json.dumps(out))
        os._exit(0)  # no atexit, as under Ray Train V2's ray.kill
    """)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID")
    }
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2", RAY_RAYLET_PID=str(os.getpid())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    (first,) = out["1"]
    assert first[1] == "FINISHED"
    assert out["2"] == [[first[0], "FINISHED"]]  # the same run, ended again
    assert out["steps"] == list(range(1, 33))  # 16 steps per fit, each once
    # MLflow had everything when fit returned but the report's data, which the courier draws after.
    assert set(out["undelivered1"]) <= {"report"} and set(out["undelivered2"]) <= {"report"}
    assert (
        len(out["couriers1"]) == 1 and out["couriers2"] == out["couriers1"]
    )  # one courier for both fits
    # The process ended without atexit: its orphaned courier finds everything delivered and removes the spool.
    spool_root = tmp_path / ".keras_sync_spool"
    deadline = time.monotonic() + 120
    while any(p.is_dir() for p in spool_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p.name for p in spool_root.iterdir() if p.is_dir()]
    assert left == [], (
        f"spools left after the process ended: {left} (pending: {[SpoolDir(spool_root / n).pending() for n in left]})"
    )
    from mlflow import MlflowClient

    artifacts = [a.path for a in MlflowClient(uri).list_artifacts(first[0])]
    assert "sync_report.png" in artifacts, artifacts  # drawn by the courier, after fit returned


def test_fit_returns_before_delivery_and_the_exit_delivers_every_step(tmp_path):
    """A first run (no store yet), two fits, a normal exit: nothing is lost, the run is FINISHED once
    MLflow has it all, and one line names the run and how to open it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tmp_path / "keras_sync.yaml"
    cfg.write_text(
        f"strategy: {{kind: default}}\nbatch: {{per_replica: 16}}\n"
        f"mlflow: {{tracking_uri: '{uri}', experiment: e, log_every_n_steps: 1}}\n"
    )
    script = textwrap.dedent(f"""
        import json, numpy as np, keras_sync
        sync = keras_sync.load({str(cfg)!r})
        import keras
        with sync.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
        for i in (1, 2):
            sync.fit(model, x, x[:, :1], epochs=1, verbose=0)
        print("FITS DONE", flush=True)
    """)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "RAY_RAYLET_PID")
    }
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FITS DONE" in r.stdout
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("sync/loss/replica_0", "sync/step_time_ms", "loss"):
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, key)) == list(
            range(1, 33)
        ), key
    # The exit waited: everything is in MLflow, so the spool is gone; at most one line said what was left.
    assert not [p for p in (tmp_path / ".keras_sync_spool").iterdir() if p.is_dir()]
    # The first run's line names the run and how to open it (the store was being built when fit began).
    assert (
        f"keras-sync: metrics go to MLflow at {uri}, experiment 'e', run {run.info.run_id}; "
        f"view it with: keras-sync ui {cfg}"
    ) in r.stderr, r.stderr[-3000:]
    assert "not created yet" not in r.stderr
    # The courier's exit (its stderr is ours): no abort in interpreter shutdown.
    assert "Fatal Python error" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "waiting for MLflow" in ln]
    assert len(lines) <= 1, lines
    if lines:
        assert "before exit. Ctrl-C leaves them in " in lines[0], lines[0]
        assert " for `keras-sync sync-spool " in lines[0], lines[0]


def test_ctrl_c_during_the_exit_wait_leaves_the_points_in_the_spool(tmp_path):
    """The courier is stopped (SIGSTOP) so nothing is delivered; at exit the one line says what is
    left; Ctrl-C (SIGINT) then ends the wait: the points stay in the spool, and `keras-sync
    sync-spool` delivers every step and ends the run FINISHED."""
    import signal
    import threading

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = textwrap.dedent(f"""
        import os, signal, time, numpy as np, keras_sync
        sync = keras_sync.load({{"strategy": {{"kind": "default"}}, "batch": {{"per_replica": 16}},
                                 "mlflow": {{"tracking_uri": {uri!r}, "experiment": "e", "log_every_n_steps": 1}}}})
        writer = sync.job_run.current
        while writer._sp.courier is None:  # the spooling thread starts the courier in its first round
            time.sleep(0.01)
        os.kill(writer._sp.courier.pid, signal.SIGSTOP)  # it delivers nothing from now on
        import keras
        with sync.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
        sync.fit(model, x, x[:, :1], epochs=1, verbose=0)
    """)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "RAY_RAYLET_PID")
    }
    # KERAS_SYNC_TEST_ZYGOTE="": the courier is a process of its own (SIGSTOP would stop only the stand-in of
    # a courier started by the suite's zygote, tests/_lean_site/_zygote.py)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2", KERAS_SYNC_TEST_ZYGOTE=""),
    )
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    try:
        err = []
        for line in proc.stderr:
            err.append(line)
            if "metric point(s) before exit" in line:
                proc.send_signal(signal.SIGINT)  # Ctrl-C while the exit waits
                break
        err += proc.stderr.readlines()
        proc.wait()
    finally:
        watchdog.cancel()
    text = "".join(err)
    (line,) = [ln for ln in err if "metric point(s) before exit" in ln]
    spools = [p for p in (tmp_path / ".keras_sync_spool").iterdir() if p.is_dir()]
    assert len(spools) == 1
    assert f"Ctrl-C leaves them in {spools[0]} for `keras-sync sync-spool {spools[0]}`" in line
    assert f"Deliver them with: keras-sync sync-spool {spools[0]}" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    from pathlib import Path

    r = subprocess.run(
        [str(Path(sys.executable).parent / "keras-sync"), "sync-spool", str(spools[0])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("e").experiment_id])
    assert sorted(
        m.step for m in c.get_metric_history(run.info.run_id, "sync/loss/replica_0")
    ) == list(range(1, 17))
    assert run.info.status == "FINISHED"


THREE_FITS = os.path.join(os.path.dirname(__file__), "_three_fits.py")


def _three_fits_config(uri: str) -> str:
    import json

    return json.dumps(
        {
            "strategy": {"kind": "default"},
            "batch": {"global": 16},
            "mlflow": {"tracking_uri": uri, "experiment": "e", "log_every_n_steps": 1},
        }
    )


def _the_run_holds_every_fit(uri: str, output: str) -> None:
    """One FINISHED run with steps 1-64 (fits of 16, 16 and 32 steps), each once; the third fit's
    other ``epochs`` under its own key; no refused param said."""
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("loss", "sync/loss/replica_0"):
        steps = [m.step for m in c.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == list(range(1, 65)), (key, sorted(steps))
    params = run.data.params
    assert (params["epochs"], params["fit_3.epochs"]) == ("1", "2"), params
    # Keras numbers the name of each new optimizer (sgd, sgd_1, ...): fit 2 changed nothing else,
    # and what did not change was not sent again.
    assert {k: v for k, v in params.items() if k.startswith("fit_")} == {
        "fit_2.optimizer_name": "sgd_1",
        "fit_3.optimizer_name": "sgd_2",
        "fit_3.epochs": "2",
    }, params
    assert "refused param" not in output, output[-3000:]


def test_three_fits_of_new_models_in_one_process_each_reach_the_run(tmp_path):
    """The keras-io "distributed training" guide calls `run_training()` three times in one process,
    a new model each time: every fit's steps reach the job's run, continuing after the last fit's."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "RAY_RAYLET_PID")
    }
    r = subprocess.run(
        [sys.executable, THREE_FITS, _three_fits_config(uri)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "FITS DONE" in r.stdout, r.stderr[-3000:]
    _the_run_holds_every_fit(uri, r.stdout + r.stderr)


@pytest.mark.timeout(900)  # two TensorFlow workers, three fits each, on a shared machine
def test_three_fits_under_two_workers_reach_the_job_run(tmp_path):
    """The keras-io "distributed training" guide's `run_training()` three times under `keras-sync launch
    -n 2`, a new model each time on the same Sync: the fits continue one run's steps. (A new
    `keras_sync.load()` per fit under two workers hangs in the second strategy's first variable broadcast:
    a second MultiWorkerMirroredStrategy in one process; not covered here.)"""
    import json

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = json.loads(_three_fits_config(uri))
    cfg["strategy"] = {"kind": "multi_worker_mirrored", "connect_timeout_s": 60}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "RAY_RAYLET_PID")
    }
    keras_sync_cli = os.path.join(os.path.dirname(sys.executable), "keras-sync")
    r = subprocess.run(
        [
            keras_sync_cli,
            "launch",
            "--workers",
            "2",
            "--grace-period",
            "2",
            THREE_FITS,
            json.dumps(cfg),
        ],
        cwd=tmp_path,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert r.returncode == 0 and "[w0] FITS DONE" in r.stdout, r.stderr[-3000:]
    # The courier's exit (its output is the chief's): no abort in interpreter shutdown.
    assert "Fatal Python error" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    _the_run_holds_every_fit(uri, r.stdout + r.stderr)


def test_a_fit_resumed_from_its_backup_logs_at_the_steps_it_trains_again(tmp_path):
    """The guide's three fits with a backup: the second is killed after step 13 of its model (job step
    29; backup at 10), the relaunch resumes it from the backup and runs the third. Each job step is in
    the run once, the steps trained twice (27-29) keep their first point, and the third fit continues."""
    import json

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = json.loads(_three_fits_config(uri))
    cfg["fault_tolerance"] = {"backup_dir": str(tmp_path / "backup"), "save_freq": 5}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "RAY_RAYLET_PID")
    }
    crashed = subprocess.run(
        [sys.executable, THREE_FITS, json.dumps(cfg), "--crash-at", "13"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    from mlflow import MlflowClient

    # The crashed process's courier delivers what it spooled; on a busy machine it may still be
    # building the store (MLflow's migrations) and creating the run: not opened here before that.
    deadline = time.monotonic() + 120
    while not (tmp_path / "mlflow.db").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    c = MlflowClient(uri)
    while c.get_experiment_by_name("e") is None and time.monotonic() < deadline:
        time.sleep(0.2)
    # The courier creates the experiment, then the run: wait for the run too.
    while not c.search_runs([c.get_experiment_by_name("e").experiment_id]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (run,) = c.search_runs([c.get_experiment_by_name("e").experiment_id])
    while len(c.get_metric_history(run.info.run_id, "loss")) < 29 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "loss")}
    assert sorted(before) == list(range(1, 30)), sorted(before)
    resumed = subprocess.run(
        [sys.executable, THREE_FITS, json.dumps(cfg), "--from-fit", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0 and "FITS DONE" in resumed.stdout, resumed.stderr[-3000:]
    assert "resumed from the backup" in resumed.stderr and "optimizer step 10" in resumed.stderr, (
        resumed.stderr
    )
    (run,) = c.search_runs([c.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED"
    after = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "loss")}
    steps = [m.step for m in c.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, 65)), sorted(steps)
    assert all(
        after[s] == before[s] for s in before
    )  # steps 27-29, trained again, hold the points they had
    assert "refused param" not in resumed.stderr, resumed.stderr[-3000:]
