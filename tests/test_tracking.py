"""Tests for keras_sync.tracking against real MLflow stores: sqlite files and a real `mlflow server`."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

from keras_sync.errors import TrackingError
from keras_sync.tracking import MlflowWriter, redact_uri, replay_spool, resolve_tracking_uri

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # real MLflow stores, servers and couriers


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """One migrated sqlite store for the module (a fresh one costs 1-6 s to migrate)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def _exp() -> str:
    return f"exp-{uuid.uuid4().hex[:8]}"


def _history(uri: str, run_id: str, key: str = "loss") -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _run_of_job(uri: str, experiment: str, job_id: str):
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`keras_sync.job_id` = '{job_id}'")
    assert len(runs) == 1
    return runs[0]


def _spooled_steps(path: Path) -> list[int]:
    steps: list[int] = []
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["k"] == "m":
            steps.append(rec["s"])
    return steps


def _log_timed(w: MlflowWriter, steps: range) -> list[float]:
    # A full gc pass over the MLflow-sized heap (~0.2 s here) can land in any allocating call;
    # it is not the writer's doing, so start the timed calls from a collected heap.
    gc.collect()
    durations = []
    for s in steps:
        t0 = time.perf_counter()
        w.log_metrics({"loss": 1.0 / (s + 1), "acc": s / 1000}, step=s)
        durations.append(time.perf_counter() - t0)
    return durations


def _crash_after_spooling(uri: str, experiment: str, job_id: str, spool_dir: Path, *, steps: int,
                          flush_interval_s: float, timeout_s: float) -> None:
    """A process logs ``steps`` steps of loss and acc, waits until they are in its spool, and dies
    (no atexit, no close: a crash)."""
    crash = (
        "import os, time\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={uri!r}, experiment={experiment!r}, job_id={job_id!r},\n"
        f"                 spool_dir={str(spool_dir)!r}, flush_interval_s={flush_interval_s!r})\n"
        "w.start()\n"
        f"for s in range({steps}): w.log_metrics({{'loss': 1.0, 'acc': 0.5}}, step=s)\n"
        f"while not w.spool_path.exists() or w.spool_path.read_text().count('\"k\":\"m\"') < {steps}:\n"
        "    time.sleep(0.05)\n"
        "os._exit(9)\n"
    )
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 9, out.stderr


def _wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch, sqlite_uri):
    monkeypatch.chdir(tmp_path)  # sqlite artifacts land in ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


# ---- pure functions ----

@pytest.mark.parametrize("uri, expected", [
    ("http://user:s3cret@127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("https://tok@host/path?x=1", "https://host/path?x=1"),
    ("http://h/?access_token=abc&run=2", "http://h/?access_token=***&run=2"),
    ("http://h/?sig=zz;password=pp", "http://h/?sig=***;password=***"),
    ("sqlite:////tmp/a@b/mlflow.db", "sqlite:////tmp/a@b/mlflow.db"),
    (None, None),
])
def test_redact_uri_strips_credentials(uri, expected):
    assert redact_uri(uri) == expected


def test_resolve_tracking_uri_config_beats_env_beats_default(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://env:5000"}
    assert resolve_tracking_uri("http://cfg:5000", environ=env) == ("http://cfg:5000", "file")
    assert resolve_tracking_uri(None, environ=env) == ("http://env:5000", "env")
    assert resolve_tracking_uri(None, environ={}, cwd=tmp_path) == (
        f"sqlite:///{tmp_path.resolve()}/mlflow.db", "default")


@pytest.mark.parametrize("kwargs, match", [
    ({"job_id": "a'b"}, r"`job_id`. Received: job_id=\"a'b\""),
    ({"max_batch": 5000}, r"`max_batch`. Received: max_batch=5000. Expected 1..1000"),
    ({"flush_interval_s": 0}, r"`flush_interval_s`. Received: flush_interval_s=0"),
    ({"experiment": ""}, r"`experiment`. Received: experiment=''"),
])
def test_invalid_arguments_name_value_and_expectation(tmp_path, kwargs, match):
    args = {"tracking_uri": "sqlite:///x.db", "experiment": "e", "spool_dir": tmp_path} | kwargs
    with pytest.raises(TrackingError, match=match):
        MlflowWriter(**args)


def test_import_loads_no_mlflow():
    code = "import sys, keras_sync.tracking; print([m for m in ('mlflow','tensorflow','keras') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- sqlite store ----

def test_every_point_delivered_exactly_once_with_steps(in_tmp, sqlite_uri):
    uri = sqlite_uri
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=in_tmp / "spool",
                     flush_interval_s=0.1, max_batch=300)
    w.start()
    _log_timed(w, range(1200))
    w.log_params({"lr": 0.1, "long": "x" * 10_000})
    w.set_tags({"team": "ml"})
    w.log_text_artifact("hello", "notes/hello.txt")
    assert w.flush(60)
    w.close()
    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(w.run_id)
    assert _history(uri, w.run_id) == list(range(1200))
    assert _history(uri, w.run_id, "acc") == list(range(1200))
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.1"
    assert len(run.data.params["long"]) == 6000 and run.data.params["long"].endswith("[truncated]")
    assert run.data.tags["team"] == "ml"
    assert Path(MlflowClient(uri).download_artifacts(w.run_id, "notes/hello.txt", str(in_tmp))).read_text() == "hello"
    assert not w.spool_path.exists()  # all delivered: the write-ahead spool is removed


def test_invalid_metric_key_is_rewritten(in_tmp, sqlite_uri, caplog):
    uri = sqlite_uri
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"top@1": 0.5, "/abs/../x": 1.0}, step=0)
    w.close()
    from mlflow import MlflowClient

    assert set(MlflowClient(uri).get_run(w.run_id).data.metrics) == {"top_1", "abs/__/x"}
    assert "Metric key 'top@1' is not valid in MLflow; logged as 'top_1'" in caplog.text


def test_same_job_id_resumes_same_run(in_tmp, sqlite_uri):
    uri, exp = sqlite_uri, _exp()
    ids = []
    for attempt in range(2):
        w = MlflowWriter(tracking_uri=uri, experiment=exp, job_id="job-7", spool_dir=in_tmp / "spool")
        w.start()
        w.log_metrics({"loss": 1.0}, step=attempt)
        w.close()
        ids.append(w.run_id)
    assert ids[0] is not None and ids[0] == ids[1]
    assert _history(uri, ids[0]) == [0, 1]


def test_replay_after_crash_before_offset_write_does_not_duplicate(in_tmp, sqlite_uri):
    uri = sqlite_uri
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), job_id="crash", spool_dir=in_tmp)
    w.start()
    _log_timed(w, range(100))
    assert w.flush(30)
    spooled = w.spool_path.read_bytes()
    w.close()
    # As if the process died after delivering, before moving the delivered-offset marker.
    w.spool_path.write_bytes(spooled + b'{"k":"m","s":7,"ts"')  # and tore its last line
    header_end = spooled.index(b"\n") + 1
    Path(f"{w.spool_path}.offset").write_text(str(header_end))
    assert replay_spool(w.spool_path) == 200
    assert _history(uri, w.run_id) == list(range(100))
    assert replay_spool(w.spool_path) == 0


def test_log_after_close_raises(in_tmp, sqlite_uri):
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.close()
    with pytest.raises(TrackingError, match="closed"):
        w.log_metrics({"loss": 1.0}, step=0)


def test_replay_rejects_a_file_that_is_not_a_spool(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"k": "m"}\n')
    with pytest.raises(TrackingError, match="Expected a keras-sync spool file"):
        replay_spool(bad)
    with pytest.raises(TrackingError, match="which does not exist"):
        replay_spool(tmp_path / "missing.spool.jsonl")


# ---- real mlflow server, with outages ----

def test_server_down_from_start_buffers_then_delivers(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    server.stop()
    exp = f"down-{uuid.uuid4().hex[:6]}"
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j1",
                     spool_dir=tmp_path, flush_interval_s=0.1)
    w.start()
    t0 = time.perf_counter()
    durations = _log_timed(w, range(500))
    total = time.perf_counter() - t0
    assert max(durations) < 0.05 and total < 0.5, (max(durations), total)
    assert _wait_for(lambda: len(_spooled_steps(w.spool_path)) == 500, 10)
    assert w.run_id is None and not w.flush(0.5)
    server.start()
    assert w.flush(60)
    w.close()
    assert _history(server.uri, w.run_id) == list(range(500))
    assert _run_of_job(server.uri, exp, "j1").info.status == "FINISHED"


def test_server_killed_mid_run_loses_and_duplicates_nothing(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    w = MlflowWriter(tracking_uri=server.uri, experiment=f"kill-{uuid.uuid4().hex[:6]}",
                     spool_dir=tmp_path, flush_interval_s=0.1)
    w.start()
    _log_timed(w, range(0, 200))
    assert w.flush(30)
    server.stop()
    durations = _log_timed(w, range(200, 400))
    assert max(durations) < 0.05
    time.sleep(1.0)  # let the thread fail a few times
    server.start()
    _log_timed(w, range(400, 600))
    assert w.flush(60)
    w.close()
    assert _history(server.uri, w.run_id) == list(range(600))
    assert _history(server.uri, w.run_id, "acc") == list(range(600))


def test_close_with_server_down_warns_and_replay_delivers_once(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    server.stop()
    exp = f"close-{uuid.uuid4().hex[:6]}"
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j2", spool_dir=tmp_path)
    w.start()
    _log_timed(w, range(50))
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="keras-sync sync-spool") as rec:
        w.close(timeout_s=2.0)
    assert time.perf_counter() - t0 < 4.0
    assert str(w.spool_path) in str(rec[0].message)
    server.start()
    assert replay_spool(w.spool_path) == 100  # 50 steps x 2 keys
    assert replay_spool(w.spool_path) == 0
    run = _run_of_job(server.uri, exp, "j2")
    assert _history(server.uri, run.info.run_id) == list(range(50))
    assert run.info.status == "FINISHED"


def test_secrets_never_reach_params_tags_artifacts_spool_or_logs(
        mlflow_server, tmp_path, monkeypatch, caplog, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok123")
    caplog.set_level(logging.DEBUG)
    port = mlflow_server.rsplit(":", 1)[1]
    secret_uri = f"http://user:s3cret@127.0.0.1:{port}"
    w = MlflowWriter(tracking_uri=secret_uri, experiment=f"red-{uuid.uuid4().hex[:6]}",
                     spool_dir=tmp_path, flush_interval_s=0.1)
    w.start()
    w.log_params({"tracking_uri": secret_uri, "token": "tok123", "cmd": "train --password s3cret"})
    w.set_tags({"env": "MLFLOW_TRACKING_TOKEN=tok123", "uri": secret_uri})
    w.log_text_artifact(f"uri: {secret_uri}\ntoken: tok123\n", "config.txt")
    w.log_metrics({"loss": 1.0}, step=0)
    assert w.flush(30)
    w.close()
    # A writer to a dead server with the same credentials: its failure logs and warning too.
    dead = MlflowWriter(tracking_uri=f"http://user:s3cret@127.0.0.1:1/?token=tok123",
                        experiment="x", spool_dir=tmp_path, flush_interval_s=0.1)
    dead.start()
    dead.log_params({"u": secret_uri})
    # The courier process reports its first failed delivery (it starts in ~1-2 s).
    assert _wait_for(lambda: "unreachable" in caplog.text, 30)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        dead.close(timeout_s=1.0)
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    run = client.get_run(w.run_id)
    artifact = Path(client.download_artifacts(w.run_id, "config.txt", str(tmp_path))).read_text()
    assert run.data.params["tracking_uri"] == f"http://127.0.0.1:{port}"
    assert run.data.params["token"] == "***"
    everything = "\n".join([
        json.dumps(run.data.params), json.dumps(run.data.tags), artifact, caplog.text,
        *[str(x.message) for x in warned], *capfd.readouterr(),
        *[p.read_text() for p in tmp_path.glob("*.spool.jsonl")]])
    assert "unreachable" in caplog.text and warned  # the failure paths did run
    assert "s3cret" not in everything and "tok123" not in everything


def test_process_exit_with_server_down_is_bounded_and_warns(tmp_path):
    code = (
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri='http://127.0.0.1:1', experiment='e', spool_dir={str(tmp_path)!r})\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - t0 < 20
    assert out.returncode == 0
    assert "keras-sync sync-spool" in out.stderr


def test_restarted_job_delivers_what_the_crashed_process_spooled(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    server.stop()
    exp = f"restart-{uuid.uuid4().hex[:6]}"
    _crash_after_spooling(server.uri, exp, "j3", tmp_path, steps=50, flush_interval_s=0.05, timeout_s=60)
    server.start()
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j3", spool_dir=tmp_path)
    w.start()
    _log_timed(w, range(50, 100))
    assert w.flush(60)
    w.close()
    run = _run_of_job(server.uri, exp, "j3")
    assert run.info.run_id == w.run_id
    assert _history(server.uri, w.run_id) == list(range(100))
    assert run.info.status == "FINISHED"


def test_replay_refuses_a_spool_a_live_writer_holds(tmp_path):
    w = MlflowWriter(tracking_uri="http://127.0.0.1:1", experiment=_exp(), job_id="busy", spool_dir=tmp_path,
                     flush_interval_s=0.05)
    w.start()
    w.log_metrics({"loss": 1.0}, step=0)
    assert _wait_for(lambda: _spooled_steps(w.spool_path) == [0], 10)
    with pytest.raises(TrackingError, match="in use by a running keras-sync writer"):
        replay_spool(w.spool_path)
    with pytest.warns(RuntimeWarning, match="not delivered"):
        w.close(timeout_s=0.5)


def test_replay_failure_is_one_clean_error(tmp_path):
    spool = tmp_path / "j.spool.jsonl"
    spool.write_text('{"k":"header","v":1,"experiment":"e","run_name":null,"job_id":"j",'
                     '"tracking_uri":"http://127.0.0.1:1"}\n{"k":"m","s":0,"ts":1,"d":{"loss":1.0}}\n')
    with pytest.raises(TrackingError, match=r"Could not deliver spool .* run `keras-sync sync-spool` again") as err:
        replay_spool(spool, tracking_uri="http://user:s3cret@127.0.0.1:1")
    assert "s3cret" not in str(err.value)
    assert Path(f"{spool}.offset").exists() is False  # nothing marked delivered


def test_uncaught_exception_ends_run_failed_at_exit(sqlite_uri, tmp_path):
    exp = _exp()
    code = (
        "import time\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={sqlite_uri!r}, experiment={exp!r}, job_id='boom',\n"
        f"                 spool_dir={str(tmp_path)!r}, flush_interval_s=0.1)\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
        "while w.run_id is None: time.sleep(0.05)\n"
        "raise ValueError('boom')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                         cwd=tmp_path)
    assert "ValueError: boom" in out.stderr
    run = _run_of_job(sqlite_uri, exp, "boom")
    assert run.info.status == "FAILED" and run.data.metrics == {"loss": 1.0}


def test_close_rejects_unknown_status(in_tmp, sqlite_uri):
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    with pytest.raises(TrackingError, match="`status`. Received: status='DONE'. Expected one of FINISHED, FAILED, KILLED"):
        w.close(status="DONE")
    w.close()


def test_resumed_job_skips_the_steps_it_trains_again(in_tmp, sqlite_uri):
    # A crashed process logged steps 0..39 (undelivered: the spool was never flushed); its backup was
    # at step 24, so the restarted process trains and logs 25..59 again from there.
    uri, exp = sqlite_uri, _exp()
    _crash_after_spooling(uri, exp, "resumed", in_tmp, steps=40, flush_interval_s=3600, timeout_s=120)
    w = MlflowWriter(tracking_uri=uri, experiment=exp, job_id="resumed", spool_dir=in_tmp)
    w.start()
    w.skip_logged_steps()
    for s in range(25, 60):
        w.log_metrics({"loss": 2.0, "acc": 0.5}, step=s)
    assert w.flush(60)
    w.close()
    from mlflow import MlflowClient

    hist = MlflowClient(uri).get_metric_history(w.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(60)), "each step exactly once"
    # Steps 25..39 keep the first process's points; 40.. are the new process's.
    assert {m.step: m.value for m in hist}[39] == 1.0 and {m.step: m.value for m in hist}[40] == 2.0


def test_without_skip_a_restart_from_step_zero_keeps_its_points(in_tmp, sqlite_uri):
    # A job restarted from scratch (no backup) does not call skip_logged_steps: nothing is dropped.
    uri, exp = sqlite_uri, _exp()
    for attempt in range(2):
        w = MlflowWriter(tracking_uri=uri, experiment=exp, job_id="fresh", spool_dir=in_tmp)
        w.start()
        for s in range(5):
            w.log_metrics({"loss": float(attempt)}, step=s)
        w.close()
    from mlflow import MlflowClient

    assert len(MlflowClient(uri).get_metric_history(w.run_id, "loss")) == 10


# ---- the courier process that delivers ----

def _couriers(pid: int | None = None) -> list[int]:
    import psutil

    parent = psutil.Process(pid) if pid else psutil.Process()
    return [p.pid for p in parent.children() if "keras_sync._courier" in " ".join(p.cmdline())]


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_delivery_runs_in_a_child_process_that_ends_with_the_writer(in_tmp, sqlite_uri):
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"loss": 1.0}, step=0)
    assert w.flush(60)
    (courier,) = _couriers()
    w.close()
    assert _gone(courier) and _couriers() == []


def test_killed_courier_is_restarted_and_nothing_is_lost_or_duplicated(in_tmp, sqlite_uri, caplog):
    import os
    import signal

    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp, flush_interval_s=0.1)
    w.start()
    _log_timed(w, range(0, 200))
    assert w.flush(60)
    (courier,) = _couriers()
    os.kill(courier, signal.SIGKILL)
    durations = _log_timed(w, range(200, 400))
    assert max(durations) < 0.05
    assert w.flush(60)
    assert _couriers() != [courier]
    w.close()
    assert "courier process exited (code -9); restarting it" in caplog.text
    assert _history(sqlite_uri, w.run_id) == list(range(400))
    assert _history(sqlite_uri, w.run_id, "acc") == list(range(400))


def test_crashed_process_leaves_no_courier_behind(sqlite_uri, tmp_path):
    # The courier sees its input end when the training process dies, and exits: the undelivered
    # rest stays in the spool for the restarted job (tested above) or `keras-sync sync-spool`.
    code = (
        "import os, time, psutil\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={sqlite_uri!r}, experiment='crash', spool_dir={str(tmp_path)!r},\n"
        "                 flush_interval_s=3600)\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
        "w.flush(60)\n"
        "for s in range(1, 50): w.log_metrics({'loss': 1.0}, step=s)\n"
        "print([p.pid for p in psutil.Process().children()], flush=True)\n"
        "os._exit(9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert out.returncode == 9, out.stderr
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) == 1
    assert _wait_for(lambda: all(_gone(p) for p in pids), 10)
