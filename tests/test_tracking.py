"""Tests for keras_sync.tracking against real MLflow stores: sqlite files and a real `mlflow server`."""

from __future__ import annotations

import gc
import http.server
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

from keras_sync.errors import TrackingError
from keras_sync.tracking import MlflowWriter, redact_uri, replay_spool, resolve_tracking_uri

pytestmark = pytest.mark.timeout(
    900
)  # the machine is shared: a courier's start took 60 s at load 40
#: close() waits while delivery progresses (it returns as soon as MLflow has everything); its 10 s
#: default is a user's exit, too short for the run's end to reach a server on a loaded CI machine.
CLOSE_S = 300.0
slow = pytest.mark.slow  # a courier process imports MLflow (1-5 s); a server takes 6-30 s to start
HERE = Path(__file__).parent


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
    runs = c.search_runs(
        [exp.experiment_id], filter_string=f"tags.`keras_sync.job_id` = '{job_id}'"
    )
    assert len(runs) == 1
    return runs[0]


def _spooled_records(spool: Path) -> list[dict]:
    recs: list[dict] = []
    for seg in sorted(spool.glob("*.jsonl")):
        for line in seg.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:  # a line torn by a kill
                pass
    return recs


def _spooled_steps(spool: Path) -> list[int]:
    return [rec["s"] for rec in _spooled_records(spool) if rec["k"] == "m"]


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


def _crash_after_spooling(
    uri: str,
    experiment: str,
    job_id: str,
    spool_dir: Path,
    *,
    steps: int,
    timeout_s: float,
    value: float = 1.0,
) -> None:
    """A process logs ``steps`` steps of loss and acc, waits until they are in its spool, and dies
    (no atexit, no close: a crash)."""
    crash = (
        "import os\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={uri!r}, experiment={experiment!r}, job_id={job_id!r},\n"
        f"                 spool_dir={str(spool_dir)!r})\n"
        "w.start()\n"
        f"for s in range({steps}): w.log_metrics({{'loss': {value!r}, 'acc': 0.5}}, step=s)\n"
        "assert w.flush_to_spool(60)\n"
        "os._exit(9)\n"
    )
    # Output to a file, and wait for the process, not for its pipes: the courier it started inherits
    # stderr and, orphaned, makes its last delivery attempt after the crash (CI with two suites on
    # 2 cores: the process had exited 9, the courier held the pipe past the 120 s).
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", crash], stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            code = proc.wait(timeout=timeout_s)
        finally:
            proc.kill()
        err.seek(0)
        assert code == 9, err.read().decode(errors="replace")[-3000:]


def _wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _settled(w: MlflowWriter, timeout_s: float = 600) -> bool:
    """True once MLflow has everything `w` was given (flush returns early while the courier starts or retries)."""
    return _wait_for(lambda: w.flush(timeout_s=60), timeout_s)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch, sqlite_uri):
    monkeypatch.chdir(tmp_path)  # sqlite artifacts land in ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID")
    }
    keras_sync_cli = str(Path(sys.executable).with_name("keras-sync"))
    return subprocess.run(
        [keras_sync_cli, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full | (env or {}),
        timeout=120,
    )


# ---- pure functions, and the one precedence rule for the tracking URI ----


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("http://user:s3cret@127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("https://tok@host/path?x=1", "https://host/path?x=1"),
        ("http://h/?access_token=abc&run=2", "http://h/?access_token=***&run=2"),
        ("http://h/?sig=zz;password=pp", "http://h/?sig=***;password=***"),
        ("sqlite:////tmp/a@b/mlflow.db", "sqlite:////tmp/a@b/mlflow.db"),
        (None, None),
    ],
)
def test_redact_uri_strips_credentials(uri, expected):
    assert redact_uri(uri) == expected


def test_resolve_tracking_uri_only_fills_in_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")  # applied by load_config, not here
    assert resolve_tracking_uri("http://cfg:5000") == ("http://cfg:5000", "config")
    assert resolve_tracking_uri(None, cwd=tmp_path) == (
        f"sqlite:///{tmp_path.resolve()}/mlflow.db",
        "default",
    )


def test_tracking_uri_flag_beats_env_beats_file_beats_default(tmp_path):
    from keras_sync.config import load_config

    (tmp_path / "k.yaml").write_text("mlflow: {tracking_uri: 'http://file:1'}\n")
    env = {"MLFLOW_TRACKING_URI": "http://env:2"}
    flag = {"mlflow.tracking_uri": "http://flag:3"}
    cases = [
        (flag, env, "http://flag:3", "flag"),
        (None, env, "http://env:2", "env"),
        (None, {}, "http://file:1", "file"),
    ]
    for overrides, environ, uri, source in cases:
        cfg = load_config(tmp_path / "k.yaml", overrides=overrides, environ=environ)
        assert (cfg.mlflow.tracking_uri, cfg.source_of("mlflow.tracking_uri")) == (uri, source)
    assert (
        load_config({}, environ={}).mlflow.tracking_uri is None
    )  # then resolve_tracking_uri's default


def test_ui_and_plan_follow_the_same_rule(tmp_path):
    (tmp_path / "k.yaml").write_text("mlflow: {tracking_uri: 'http://file:1'}\n")
    out = _cli("ui", "k.yaml", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": "http://u:pw@env:2"})
    assert out.returncode == 0 and out.stdout.strip().endswith("open http://env:2"), out.stderr
    out = _cli(
        "ui",
        "k.yaml",
        "--tracking-uri",
        "http://flag:3",
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": "http://env:2"},
    )
    assert out.stdout.strip().endswith("open http://flag:3"), out.stderr
    out = _cli("ui", "k.yaml", cwd=tmp_path)
    assert out.stdout.strip().endswith("open http://file:1"), out.stderr
    assert "--tracking-uri, else $MLFLOW_TRACKING_URI, else mlflow.tracking_uri" in " ".join(
        _cli("ui", "--help", cwd=tmp_path).stdout.split()
    )
    plan = _cli(
        "plan",
        "k.yaml",
        "--json",
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": "http://env:2", "KERAS_SYNC_JOB_ID": "job-9"},
    )
    items = json.loads(plan.stdout)["items"]
    assert (items["mlflow.tracking_uri"]["value"], items["mlflow.tracking_uri"]["source"]) == (
        "http://env:2",
        "env",
    )
    assert (items["mlflow.job_id"]["value"], items["mlflow.job_id"]["source"]) == ("job-9", "env")


def test_job_id_from_env_is_validated_by_the_config_loader():
    from keras_sync.config import load_config
    from keras_sync.errors import ConfigError

    assert (
        load_config({"mlflow": {"job_id": "a"}}, environ={"KERAS_SYNC_JOB_ID": "b-7"}).mlflow.job_id
        == "b-7"
    )
    with pytest.raises(
        ConfigError,
        match=r"\$KERAS_SYNC_JOB_ID: mlflow.job_id: received \"a'b\", expected "
        r"1-250 letters, digits or _.:/@\+- or null; fix or unset",
    ):
        load_config({}, environ={"KERAS_SYNC_JOB_ID": "a'b"})
    with pytest.raises(ConfigError, match="mlflow.job_id: received 'a b'"):
        load_config({"mlflow": {"job_id": "a b"}}, environ={})


def test_spool_dir_is_a_config_key():
    from keras_sync.config import load_config

    assert load_config({}, environ={}).mlflow.spool_dir == ".keras_sync_spool"
    assert (
        load_config({"mlflow": {"spool_dir": "/data/spool"}}, environ={}).mlflow.spool_dir
        == "/data/spool"
    )


def test_invalid_job_id_names_value_and_expectation(tmp_path):
    with pytest.raises(TrackingError, match=r"`job_id`. Received: job_id=\"a'b\""):
        MlflowWriter(
            tracking_uri="sqlite:///x.db", experiment="e", spool_dir=tmp_path, job_id="a'b"
        )


def test_import_loads_no_mlflow():
    code = "import sys, keras_sync.tracking; print([m for m in ('mlflow','tensorflow','keras') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_replay_rejects_what_is_not_a_spool(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"k": "m"}\n')
    with pytest.raises(TrackingError, match="Expected a keras-sync spool directory"):
        replay_spool(tmp_path)
    with pytest.raises(TrackingError, match="which does not exist"):
        replay_spool(tmp_path / "missing")


@slow
def test_replay_failure_is_one_clean_error(tmp_path):
    spool = tmp_path / "j"
    spool.mkdir()
    (spool / "header.json").write_text(
        '{"v":2,"experiment":"e","run_name":null,"job_id":"j","explicit":true,'
        '"tracking_uri":"http://127.0.0.1:1"}'
    )
    (spool / "00000001.jsonl").write_text('{"k":"m","s":0,"ts":1,"d":{"loss":1.0}}\n')
    with pytest.raises(
        TrackingError, match=r"Could not deliver spool .* run `keras-sync sync-spool` again"
    ) as err:
        replay_spool(
            spool, tracking_uri="http://user:s3cret@127.0.0.1:1", timeout_s=0
        )  # each request once
    assert "s3cret" not in str(err.value)
    assert "1 of 1 requests failed with connection refused" in str(err.value)
    assert not (spool / "delivered").exists()  # nothing marked delivered
    assert (spool / "00000001.jsonl").exists()


@slow
def test_close_rejects_unknown_status(in_tmp, sqlite_uri):
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    with pytest.raises(
        TrackingError,
        match="`status`. Received: status='DONE'. Expected one of FINISHED, FAILED, KILLED",
    ):
        w.close(status="DONE")
    w.close(timeout_s=120)


@slow
def test_the_courier_runs_at_the_trainings_priority(in_tmp, sqlite_uri):
    # README: "It runs at normal priority" (a child inherits its forking thread's nice value).
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"loss": 1.0}, step=1)
    try:
        assert _wait_for(lambda: w._sp.courier is not None, 120), "no courier started"
        assert _nice(Path(f"/proc/{w._sp.courier.pid}/stat")) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        w.close(timeout_s=120)


def _nice(stat: Path) -> int:
    """The nice value in a /proc/<pid>/stat (or task) file: field 19, counted after the command's ')'."""
    return int(stat.read_text().rpartition(")")[2].split()[16])


# ---- sqlite store ----


@slow
def test_every_point_delivered_exactly_once_with_steps(in_tmp, sqlite_uri):
    uri = sqlite_uri
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=in_tmp / "spool")
    w.start()
    _log_timed(w, range(1200))
    w.log_params({"lr": 0.1, "long": "x" * 10_000})
    w.set_tags({"team": "ml"})
    w.log_text_artifact("hello", "notes/hello.txt")
    assert _settled(w)
    w.close()
    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(w.run_id)
    assert _history(uri, w.run_id) == list(range(1200))
    assert _history(uri, w.run_id, "acc") == list(range(1200))
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.1"
    assert len(run.data.params["long"]) == 6000 and run.data.params["long"].endswith("[truncated]")
    assert run.data.tags["team"] == "ml"
    assert (
        Path(
            MlflowClient(uri).download_artifacts(w.run_id, "notes/hello.txt", str(in_tmp))
        ).read_text()
        == "hello"
    )
    assert not w.spool_path.exists()  # all delivered: the spool is removed


@slow
def test_a_run_name_longer_than_a_command_line_argument_reaches_the_courier(in_tmp, sqlite_uri):
    # Linux takes at most 128 KiB per argument or environment variable: the header in the
    # courier's environment failed with "[Errno 7] Argument list too long" at every start.
    w = MlflowWriter(
        tracking_uri=sqlite_uri, experiment=_exp(), run_name="r" * 140_000, spool_dir=in_tmp
    )
    w.start()
    w.log_metrics({"loss": 1.0}, step=1)
    w.close(timeout_s=120)
    from mlflow import MlflowClient

    run = MlflowClient(sqlite_uri).get_run(w.run_id)
    assert (run.info.status, run.info.run_name, run.data.metrics) == (
        "FINISHED",
        "r" * 140_000,
        {"loss": 1.0},
    )


@slow
def test_a_spool_deleted_while_the_run_logs_stops_logging_in_one_error_line(in_tmp, caplog):
    """An operator (or a cleanup job) removes the spool directory mid-run: the writer sees its
    segment unlinked and says so in one line, instead of appending to a file no one can read."""
    w = MlflowWriter(
        tracking_uri="http://127.0.0.1:1", experiment=_exp(), spool_dir=in_tmp / "spool"
    )
    w.start()
    for s in range(300):
        w.log_metrics({"loss": 1.0 / (s + 1)}, step=s)
    assert w.flush_to_spool(timeout_s=60)
    shutil.rmtree(w.spool_path)
    for s in range(300, 600):
        w.log_metrics({"loss": 1.0 / (s + 1)}, step=s)
    w.flush_to_spool(timeout_s=60)
    said = [r.getMessage() for r in caplog.records if "was deleted while" in r.getMessage()]
    assert len(said) == 1 and said[0] == (
        f"keras-sync cannot write its MLflow spool {w.spool_path} ({w.spool_path} was deleted "
        "while this run logged into it); MLflow logging stops for this run."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.close(timeout_s=1)


@slow
def test_a_spool_deleted_after_a_full_disk_held_records_closes_with_one_error_line(
    in_tmp, monkeypatch, caplog
):
    """A full disk left records in memory, then the spool was removed: close does not raise
    (the spill of what memory holds fails too) and one error line names what is lost."""
    from keras_sync.tracking.spool import SpoolFull

    w = MlflowWriter(
        tracking_uri="http://127.0.0.1:1", experiment=_exp(), spool_dir=in_tmp / "spool"
    )
    w.start()
    assert w.flush_to_spool(timeout_s=60)
    full = OSError(28, "No space left on device")

    def refuse(records):
        raise SpoolFull(full, 0, w._sp.spooled_pos)

    monkeypatch.setattr(w._sp.spool, "append", refuse)
    for s in range(1, 11):
        w.log_metrics({"loss": 1.0 / s}, step=s)
    assert w.flush_to_spool(timeout_s=60)
    monkeypatch.undo()
    shutil.rmtree(w.spool_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.close(timeout_s=1)
    said = [r.getMessage() for r in caplog.records if "MLflow lost" in r.getMessage()]
    assert len(said) == 1 and "the points of steps 1-10" in said[0], said
    assert f"{w.spool_path} could not be written" in said[0] and "was deleted" in said[0], said


@slow
def test_invalid_metric_key_is_rewritten(in_tmp, sqlite_uri, caplog):
    uri = sqlite_uri
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"top@1": 0.5, "/abs/../x": 1.0}, step=0)
    w.close(timeout_s=120)
    from mlflow import MlflowClient

    assert set(MlflowClient(uri).get_run(w.run_id).data.metrics) == {"top_1", "abs/__/x"}
    assert "Metric key 'top@1' is not valid in MLflow; logged as 'top_1'" in caplog.text


@slow
def test_explicit_job_id_shares_one_run_even_after_it_finished(in_tmp, sqlite_uri):
    uri, exp = sqlite_uri, _exp()
    ids = []
    for attempt in range(2):
        w = MlflowWriter(
            tracking_uri=uri, experiment=exp, job_id="job-7", spool_dir=in_tmp / "spool"
        )
        w.start()
        w.log_metrics({"loss": 1.0}, step=attempt)
        w.close(timeout_s=120)
        ids.append(w.run_id)
    assert ids[0] is not None and ids[0] == ids[1]
    assert _history(uri, ids[0]) == [0, 1]


@slow
def test_a_finished_run_is_not_reopened_for_a_job_id_that_came_with_a_backup(in_tmp, sqlite_uri):
    uri, exp = sqlite_uri, _exp()
    first = MlflowWriter(
        tracking_uri=uri, experiment=exp, job_id="bk-1", job_id_explicit=False, spool_dir=in_tmp
    )
    first.start()
    first.log_metrics({"loss": 1.0}, step=1)
    first.close(timeout_s=120)
    again = MlflowWriter(
        tracking_uri=uri,
        experiment=exp,
        job_id="bk-1",
        job_id_explicit=False,
        run_id=first.run_id,
        spool_dir=in_tmp,
    )
    again.start()
    again.log_metrics({"loss": 2.0}, step=1)
    again.close(timeout_s=120)
    assert again.run_id not in (None, first.run_id)
    assert _history(uri, first.run_id) == [1] and _history(uri, again.run_id) == [1]


@slow
def test_a_step_logged_twice_keeps_one_point(in_tmp, sqlite_uri):
    # The same job id, started twice from step 0 (no backup): the run never gets two points at
    # one (key, step); the first point stays.
    uri, exp = sqlite_uri, _exp()
    for attempt in range(2):
        w = MlflowWriter(tracking_uri=uri, experiment=exp, job_id="twice", spool_dir=in_tmp)
        w.start()
        for s in range(5):
            w.log_metrics({"loss": float(attempt)}, step=s)
        w.close(timeout_s=120)
    from mlflow import MlflowClient

    hist = MlflowClient(uri).get_metric_history(w.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(5)) and {m.value for m in hist} == {0.0}


@slow
def test_resumed_job_keeps_one_point_per_step(in_tmp, sqlite_uri):
    # A crashed process logged steps 0..39; its backup was at step 24, so the restarted process
    # trains and logs 25..59 again from there.
    uri, exp = sqlite_uri, _exp()
    _crash_after_spooling(uri, exp, "resumed", in_tmp, steps=40, timeout_s=120)
    w = MlflowWriter(tracking_uri=uri, experiment=exp, job_id="resumed", spool_dir=in_tmp)
    w.start()
    for s in range(25, 60):
        w.log_metrics({"loss": 2.0, "acc": 0.5}, step=s)
    assert _settled(w)
    w.close()
    from mlflow import MlflowClient

    hist = MlflowClient(uri).get_metric_history(w.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(60)), "each step exactly once"
    assert {m.step: m.value for m in hist}[39] == 1.0 and {m.step: m.value for m in hist}[40] == 2.0


@slow
def test_replay_after_crash_before_the_position_was_written_duplicates_nothing(in_tmp, sqlite_uri):
    uri = sqlite_uri
    exp = _exp()
    # Logged to a port nobody listens on: the crashed process's orphaned courier cannot deliver (and
    # end the run, removing the spool) before the copy is taken; the replays name the real store.
    _crash_after_spooling("http://127.0.0.1:1", exp, "crash", in_tmp, steps=100, timeout_s=120)
    spool = in_tmp / "crash"
    assert _wait_for(
        lambda: not _couriers_of(spool), 600
    )  # its courier (if it got to start) has ended
    import shutil

    shutil.copytree(spool, in_tmp / "copy", ignore=shutil.ignore_patterns("*.lock"))
    replay_spool(spool, uri)
    assert not spool.exists()  # delivered: removed
    # The writer was killed with its run open: the replay ends it FAILED, as a relaunch finds it.
    run = _run_of_job(uri, exp, "crash")
    assert run.info.status == "FAILED"
    # The copy is the spool as it was before the batch, as if a courier died after MLflow took
    # the batch and before it moved the delivered position.
    spool = in_tmp / "copy"
    assert replay_spool(spool, uri) == 0  # every step is in the run already
    run = _run_of_job(uri, exp, "crash")
    assert _history(uri, run.info.run_id) == list(range(100))
    assert run.info.status == "FAILED"
    assert not spool.exists()  # delivered: removed


def _spool_of_ended_run(root: Path, experiment: str, uri: str):
    """A spool whose records ended their run FINISHED (a job id that came with a backup, not explicit)."""
    from keras_sync.tracking.spool import SpoolDir

    spool = SpoolDir(root)
    spool.path.mkdir()
    spool.write_header(
        {
            "v": 2,
            "experiment": experiment,
            "run_name": None,
            "job_id": "from-backup",
            "explicit": False,
            "tracking_uri": uri,
            "run_id": None,
        }
    )
    spool.start_segment()
    spool.append(
        [{"k": "begin", "ts": 1}]
        + [{"k": "m", "s": s, "ts": 1, "d": {"loss": 0.5}} for s in (1, 2)]
        + [{"k": "end", "status": "FINISHED", "ts": 2, "last": False}]
    )
    return spool


def test_leftovers_of_an_ended_run_go_to_that_run_not_a_new_one(tmp_path, sqlite_uri):
    # A courier killed after MLflow took the batch that ended the run and before it moved the
    # delivered position; or one killed (a bounded wait at exit) before it delivered the "stop"
    # that follows the end. The next courier, or `keras-sync sync-spool`, delivers what is left:
    # into the spool's own run, FINISHED as it is, never into a second run of the job.
    import shutil

    from mlflow import MlflowClient

    from keras_sync.tracking.courier import Delivery

    exp = _exp()
    spool = _spool_of_ended_run(tmp_path / "spool", exp, sqlite_uri)
    before_delivery = tmp_path / "copy"
    shutil.copytree(spool.path, before_delivery)
    Delivery(spool, sqlite_uri).deliver_available()
    run = _run_of_job(sqlite_uri, exp, "from-backup")
    assert run.info.status == "FINISHED"
    # The replay: run.json names the run, the delivered position is where it was before the batch.
    shutil.copy(spool.path / "run.json", before_delivery / "run.json")
    from keras_sync.tracking.spool import SpoolDir

    replay = SpoolDir(before_delivery)
    assert (
        Delivery(replay, sqlite_uri).deliver_available() == 0
    )  # both steps are in the run already
    spool.append([{"k": "stop"}])  # the writer closed after ending the run; its courier was killed
    Delivery(spool, sqlite_uri).deliver_available()
    # With nothing left to deliver, a courier or replay does not take the ended run for the open
    # run of a killed writer.
    Delivery(spool, sqlite_uri).end_open_run()
    assert _run_of_job(sqlite_uri, exp, "from-backup").info.run_id == run.info.run_id
    after = MlflowClient(sqlite_uri).get_run(run.info.run_id)
    assert after.info.status == "FINISHED" and after.info.end_time == run.info.end_time
    assert _history(sqlite_uri, run.info.run_id) == [1, 2]


def _couriers_of(spool: Path) -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(spool) in " ".join(p.info["cmdline"] or ())
        and "keras_sync.tracking.courier" in " ".join(p.info["cmdline"])
    ]


@slow
def test_log_after_close_raises(in_tmp, sqlite_uri):
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.close(timeout_s=120)
    with pytest.raises(TrackingError, match="closed"):
        w.log_metrics({"loss": 1.0}, step=0)


@slow
def test_uncaught_exception_ends_run_failed_at_exit(sqlite_uri, tmp_path):
    exp = _exp()
    code = (
        "import time\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={sqlite_uri!r}, experiment={exp!r}, job_id='boom',\n"
        f"                 spool_dir={str(tmp_path)!r})\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
        "while w.run_id is None: time.sleep(0.05)\n"
        "raise ValueError('boom')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert "ValueError: boom" in out.stderr
    run = _run_of_job(sqlite_uri, exp, "boom")
    assert run.info.status == "FAILED" and run.data.metrics == {"loss": 1.0}


# ---- the spool: the only interface, small on disk ----


@slow
def test_long_run_keeps_little_spool_on_disk(mlflow_server, tmp_path):
    w = MlflowWriter(tracking_uri=mlflow_server, experiment=_exp(), spool_dir=tmp_path)
    w.start()
    keys = [f"sync/loss/replica_{i}" for i in range(4)] + [f"sync/metric_{i}" for i in range(8)]
    biggest = 0
    for s in range(5000):
        w.log_metrics({k: 1.0 / (s + 1) for k in keys}, step=s)
        if s % 500 == 499:
            time.sleep(0.3)  # a 5,000-step run takes a while; the spool is measured along the way
            biggest = max(
                biggest, sum(p.stat().st_size for p in w.spool_path.glob("*") if p.is_file())
            )
    assert _settled(w)
    size = sum(p.stat().st_size for p in w.spool_path.glob("*") if p.is_file())
    written = w._sp.spooled_pos[0]  # segments written (256 KB each): > 1 MB went through the spool
    assert written >= 5 and size < 1_000_000, (written, size)
    w.close()
    assert _history(mlflow_server, w.run_id, keys[0]) == list(range(5000))
    assert not w.spool_path.exists()


@slow
def test_delivery_runs_in_a_child_process_at_normal_priority(in_tmp, sqlite_uri):
    import os

    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"loss": 1.0}, step=0)
    assert _settled(w)
    (courier,) = _couriers_of(w.spool_path)
    assert (
        os.sched_getscheduler(courier) == os.SCHED_OTHER
    )  # not SCHED_IDLE: a busy machine starved it
    assert os.getpriority(os.PRIO_PROCESS, courier) <= 5
    w.close()
    assert _gone(courier) and _couriers_of(w.spool_path) == []


@slow
def test_busy_cores_do_not_stop_delivery(in_tmp, sqlite_uri):
    # Two CPU-bound processes beside the training (as a tf.data pipeline or another job would be):
    # every point is in MLflow when flush returns, and fit-end finds nothing to warn about. They
    # hold both cores (and starve the suite's other worker), so they run only while the steps are
    # logged and delivered: the courier's start (an MLflow import) is not what this test measures,
    # and 1,000 steps show a starved courier (at SCHED_IDLE it never ran) as well as 3,000 did.
    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    w.log_metrics({"m0": 0.0}, step=-1)
    assert _settled(w)  # the courier is up
    from _busy import busy_loops

    with busy_loops(2):
        for s in range(1000):
            w.log_metrics({f"m{i}": float(s) for i in range(10)}, step=s)
            if s % 100 == 0:
                time.sleep(0.01)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            w.end_of_fit()
        assert not warned and w.undelivered_message() is None, [str(x.message) for x in warned]
    assert _history(sqlite_uri, w.run_id, "m3") == list(range(1000))
    w.close()


@slow
def test_failing_local_store_is_named_as_such_and_not_waited_for(in_tmp):
    (in_tmp / "blocker").write_text(
        ""
    )  # a file where the store's directory should be (MLflow makes missing dirs)
    uri = f"sqlite:///{in_tmp}/blocker/mlflow.db"
    w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=in_tmp / "spool")
    w.start()
    w.log_metrics({"loss": 1.0}, step=0)
    assert _wait_for(lambda: w.failure() is not None, 600)
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning) as rec:
        w.end_of_fit()
        w.end_of_fit()  # a second fit: no second warning for the same outage
    assert time.perf_counter() - t0 < 5.0  # no wait (the old end-of-fit wait was 10 s)
    (msg,) = [str(r.message) for r in rec]
    assert f"the local store {uri} fails" in msg and "server" not in msg
    assert f"kept in {w.spool_path}" in msg and w.spool_path.is_dir()
    with pytest.warns(RuntimeWarning, match=f"keras-sync sync-spool {w.spool_path}"):
        w.close(timeout_s=5)
    assert w.spool_path.is_dir() and _spooled_steps(w.spool_path) == [0]


@slow
def test_courier_says_ok_before_it_moves_the_delivered_position(tmp_path, sqlite_uri):
    # After an outage the first successful delivery must clear the failure before the position
    # moves: a writer that sees the position reach its target and still reads the old failure
    # gives up in close() on a server that is back (run left RUNNING; seen in CI under load).
    from keras_sync.tracking.courier import Delivery
    from keras_sync.tracking.spool import SpoolDir

    spool = SpoolDir(tmp_path / "spool")
    spool.path.mkdir()
    spool.write_header(
        {
            "v": 2,
            "experiment": "order",
            "run_name": None,
            "job_id": "j",
            "explicit": False,
            "tracking_uri": sqlite_uri,
            "run_id": None,
        }
    )
    spool.start_segment()
    spool.append([{"k": "begin", "ts": 1}, {"k": "m", "s": 1, "ts": 1, "d": {"loss": 0.5}}])
    spool.close_segment()
    import io

    news = io.BytesIO()  # what the writer reads from the courier's stdout

    def told_status() -> dict:
        told = [json.loads(line) for line in news.getvalue().splitlines()]
        return [m["status"] for m in told if "status" in m][-1]

    delivery = Delivery(spool, sqlite_uri, news=news)
    delivery.report(ConnectionError("server away"))
    seen = []
    mark = spool.mark_delivered
    spool.mark_delivered = lambda pos: (seen.append(told_status()), mark(pos))  # type: ignore[method-assign]
    delivery.deliver_available()
    assert seen and all(status["ok"] for status in seen), seen
    assert told_status()["ok"] is True


def test_metric_points_wait_for_a_batch_and_anything_else_takes_them_along(tmp_path, sqlite_uri):
    """The courier sends metric points in batches (`courier.BATCH_S`): a `log_batch` call costs ~6 ms
    of MLflow's CPU besides ~90 us per value, so one call per step cost as much as the values. A
    run's end (or params, a report) is sent at once, with every point before it."""
    from mlflow import MlflowClient

    from keras_sync.tracking.courier import Delivery
    from keras_sync.tracking.spool import SpoolDir

    spool = SpoolDir(tmp_path / "spool")
    spool.path.mkdir()
    spool.write_header(
        {
            "v": 2,
            "experiment": _exp(),
            "run_name": None,
            "job_id": "batch",
            "explicit": False,
            "tracking_uri": sqlite_uri,
            "run_id": None,
        }
    )
    spool.start_segment()
    spool.append([{"k": "begin", "ts": 1}])
    delivery = Delivery(spool, sqlite_uri)
    calls = []
    send = delivery.sender.send
    delivery.sender.send = lambda records, done=None: (  # type: ignore[method-assign]
        calls.append([r["k"] for r in records]),
        send(records, done=done),
    )[1]
    assert delivery.deliver_available(hold_metrics=True) == 0 and calls == [
        ["begin"]
    ]  # not a metric: at once
    spool.append([{"k": "m", "s": s, "ts": 1, "d": {"loss": 1.0 / s}} for s in range(1, 6)])
    assert (
        delivery.deliver_available(hold_metrics=True) == 0 and len(calls) == 1
    )  # held for a batch
    spool.append(
        [{"k": "m", "s": 6, "ts": 1, "d": {"loss": 0.1}}, {"k": "end", "status": "FINISHED"}]
    )
    assert delivery.deliver_available(hold_metrics=True) == 6  # the end takes the held points along
    assert calls[1:] == [["m"] * 6 + ["end"]]
    c = MlflowClient(sqlite_uri)
    assert _history(sqlite_uri, delivery.sender.run_id) == [1, 2, 3, 4, 5, 6]
    assert c.get_run(delivery.sender.run_id).info.status == "FINISHED"
    # Without holding (the batch time is up, or `keras-sync sync-spool`), points go at once.
    spool.append([{"k": "begin", "ts": 2}, {"k": "m", "s": 7, "ts": 2, "d": {"loss": 0.1}}])
    assert delivery.deliver_available() == 1


def test_the_courier_delivers_held_points_when_the_writer_wakes_it(
    tmp_path, sqlite_uri, monkeypatch
):
    """Between batches the courier sleeps (`courier.BATCH_S`) instead of polling the spool; the
    writer's wake line (a record that is not a point, or a flush) has it deliver at once."""
    from keras_sync.tracking import courier
    from keras_sync.tracking.records import WAKE_LINE
    from keras_sync.tracking.spool import SpoolDir

    monkeypatch.setattr(courier, "BATCH_S", 600.0)  # without the wake: nothing for 10 minutes
    spool = SpoolDir(tmp_path / "spool")
    spool.path.mkdir()
    spool.write_header(
        {"v": 2, "experiment": _exp(), "run_name": None, "job_id": "wake", "explicit": False}
        | {"tracking_uri": sqlite_uri, "run_id": None}
    )
    spool.start_segment()
    spool.append([{"k": "begin", "ts": 1}])
    delivery = courier.Delivery(spool, sqlite_uri)
    read, write = os.pipe()
    threading.Thread(target=delivery.read_pipe, args=(os.fdopen(read, "rb"),), daemon=True).start()
    serving = threading.Thread(target=delivery.serve, args=(None,), daemon=True)
    serving.start()
    assert _wait_for(lambda: delivery.sender.run_id is not None, 120)  # the begin: at once
    spool.append([{"k": "m", "s": s, "ts": 1, "d": {"loss": 1.0 / s}} for s in (1, 2)])
    time.sleep(1.0)
    assert delivery.sender.points_sent == 0  # held for a batch
    os.write(write, WAKE_LINE)  # a flush waits
    assert _wait_for(lambda: delivery.sender.points_sent == 2, 120)
    spool.append([{"k": "end", "status": "FINISHED", "ts": 2}])
    os.write(write, WAKE_LINE)  # a record that is not a point
    serving.join(120)
    assert not serving.is_alive()
    assert _history(sqlite_uri, delivery.sender.run_id) == [1, 2]
    os.close(write)


# ---- real mlflow server, with outages ----


@slow
def test_server_down_from_start_buffers_then_delivers(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    server.stop()
    exp = f"down-{uuid.uuid4().hex[:6]}"
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j1", spool_dir=tmp_path)
    w.start()
    durations = _log_timed(w, range(500))
    # The calls' own time: the whole of _log_timed also holds its gc.collect() of the MLflow-sized
    # heap, which took 2.5 s at load 20 (this failed with calls of at most 3e-5 s, total 2.58 s).
    total = sum(durations)
    assert max(durations) < 0.05 and total < 2.0, (max(durations), total)  # 0.52 s seen at load 15
    assert _wait_for(lambda: len(_spooled_steps(w.spool_path)) == 500, 60)
    assert _wait_for(lambda: w.failure() is not None, 600)
    t0 = time.perf_counter()
    with pytest.warns(
        RuntimeWarning, match="the tracking server http://127.0.0.1:.* is unreachable"
    ) as rec:
        w.end_of_fit()  # known away: no wait
    assert time.perf_counter() - t0 < 5.0 and str(w.spool_path) in str(rec[0].message)
    assert w.run_id is None
    server.start()
    assert _settled(w)  # the courier retries within 30 s
    w.close(timeout_s=CLOSE_S)
    assert _history(server.uri, w.run_id) == list(range(500))
    assert _run_of_job(server.uri, exp, "j1").info.status == "FINISHED"


@slow
def test_server_killed_mid_run_loses_and_duplicates_nothing(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    w = MlflowWriter(
        tracking_uri=server.uri, experiment=f"kill-{uuid.uuid4().hex[:6]}", spool_dir=tmp_path
    )
    w.start()
    _log_timed(w, range(0, 200))
    assert _settled(w)
    server.stop()
    durations = _log_timed(w, range(200, 400))
    assert max(durations) < 0.05
    assert _wait_for(lambda: w.failure() is not None, 600)
    server.start()
    _log_timed(w, range(400, 600))
    assert _settled(w)
    w.close(timeout_s=CLOSE_S)
    assert _history(server.uri, w.run_id) == list(range(600))
    assert _history(server.uri, w.run_id, "acc") == list(range(600))


@slow
def test_close_with_server_down_warns_and_replay_delivers_once(restartable_mlflow_server, tmp_path):
    server = restartable_mlflow_server
    server.stop()
    exp = f"close-{uuid.uuid4().hex[:6]}"
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j2", spool_dir=tmp_path)
    w.start()
    _log_timed(w, range(50))
    with pytest.warns(RuntimeWarning, match="keras-sync sync-spool") as rec:
        w.close(timeout_s=60)
    assert str(w.spool_path) in str(rec[0].message) and w.spool_path.is_dir()
    assert _couriers_of(w.spool_path) == []  # after close nothing runs in the background
    server.start()
    out = _cli("sync-spool", str(w.spool_path), cwd=tmp_path)
    assert out.returncode == 0 and "sent 100 metric point(s)" in out.stdout, (
        out.stderr
    )  # 50 steps x 2 keys
    assert not w.spool_path.exists()
    run = _run_of_job(server.uri, exp, "j2")
    assert _history(server.uri, run.info.run_id) == list(range(50))
    assert run.info.status == "FINISHED"


@slow
def test_secrets_never_reach_params_tags_artifacts_spool_or_logs(
    mlflow_server, tmp_path, monkeypatch, caplog, capfd
):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok123")
    caplog.set_level(logging.DEBUG)
    port = mlflow_server.rsplit(":", 1)[1]
    secret_uri = f"http://user:s3cret@127.0.0.1:{port}"
    w = MlflowWriter(
        tracking_uri=secret_uri, experiment=f"red-{uuid.uuid4().hex[:6]}", spool_dir=tmp_path
    )
    w.start()
    w.log_params({"tracking_uri": secret_uri, "token": "tok123", "cmd": "train --password s3cret"})
    w.set_tags({"env": "MLFLOW_TRACKING_TOKEN=tok123", "uri": secret_uri})
    w.log_text_artifact(f"uri: {secret_uri}\ntoken: tok123\n", "config.txt")
    w.log_metrics({"loss": 1.0}, step=0)
    assert _settled(w)
    w.close(timeout_s=CLOSE_S)
    # A writer to a dead server with the same credentials: its failure logs and warning too.
    dead = MlflowWriter(
        tracking_uri="http://user:s3cret@127.0.0.1:1/?token=tok123",
        experiment="x",
        spool_dir=tmp_path,
    )
    dead.start()
    dead.log_params({"u": secret_uri})
    assert _wait_for(lambda: "unreachable" in caplog.text, 600)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        dead.close(timeout_s=1.0)
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    run = client.get_run(w.run_id)
    artifact = Path(client.download_artifacts(w.run_id, "config.txt", str(tmp_path))).read_text()
    assert run.data.params["tracking_uri"] == f"http://127.0.0.1:{port}"
    assert run.data.params["token"] == "***"
    everything = "\n".join(
        [
            json.dumps(run.data.params),
            json.dumps(run.data.tags),
            artifact,
            caplog.text,
            *[str(x.message) for x in warned],
            *capfd.readouterr(),
            *[
                p.read_text()
                for p in tmp_path.rglob("*")
                if p.is_file() and not p.name.endswith(".lock")
            ],
        ]
    )
    assert "unreachable" in caplog.text and warned  # the failure paths did run
    assert "s3cret" not in everything and "tok123" not in everything


@slow
def test_process_exit_with_server_down_is_bounded_and_warns(tmp_path):
    code = (
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri='http://127.0.0.1:1', experiment='e', spool_dir={str(tmp_path)!r})\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
        "import time\n"
        "while w.failure() is None: time.sleep(0.05)\n"
        "print(time.time(), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    exit_took = time.time() - float(out.stdout.strip())
    assert out.returncode == 0
    assert "the tracking server http://127.0.0.1:1 is unreachable" in out.stderr
    assert "keras-sync sync-spool" in out.stderr
    assert (
        exit_took < 10
    )  # MLflow known to be away: no wait at exit (a stopped courier, interpreter teardown)


@slow
def test_restarted_job_delivers_what_the_crashed_process_spooled(
    restartable_mlflow_server, tmp_path
):
    server = restartable_mlflow_server
    server.stop()
    exp = f"restart-{uuid.uuid4().hex[:6]}"
    _crash_after_spooling(server.uri, exp, "j3", tmp_path, steps=50, timeout_s=120)
    server.start()
    w = MlflowWriter(tracking_uri=server.uri, experiment=exp, job_id="j3", spool_dir=tmp_path)
    w.start()
    _log_timed(w, range(50, 100))
    assert _settled(w)
    w.close(timeout_s=CLOSE_S)
    run = _run_of_job(server.uri, exp, "j3")
    assert run.info.run_id == w.run_id
    assert _history(server.uri, w.run_id) == list(range(100))
    assert run.info.status == "FINISHED"


@slow
def test_replay_refuses_a_spool_a_live_writer_holds(tmp_path):
    w = MlflowWriter(
        tracking_uri="http://127.0.0.1:1", experiment=_exp(), job_id="busy", spool_dir=tmp_path
    )
    w.start()
    w.log_metrics({"loss": 1.0}, step=0)
    assert _wait_for(lambda: _spooled_steps(w.spool_path) == [0], 60)
    with pytest.raises(TrackingError, match="in use by a running keras-sync writer"):
        replay_spool(w.spool_path)
    with pytest.warns(RuntimeWarning, match="not delivered"):
        w.close(timeout_s=0.5)


# ---- the courier process that delivers ----


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@slow
def test_killed_courier_is_restarted_and_nothing_is_lost_or_duplicated(in_tmp, sqlite_uri, caplog):
    import os
    import signal

    w = MlflowWriter(tracking_uri=sqlite_uri, experiment=_exp(), spool_dir=in_tmp)
    w.start()
    _log_timed(w, range(0, 200))
    assert _settled(w)
    (courier,) = _couriers_of(w.spool_path)
    os.kill(courier, signal.SIGKILL)
    durations = _log_timed(w, range(200, 400))
    assert max(durations) < 0.05
    assert _wait_for(lambda: _couriers_of(w.spool_path) not in ([], [courier]), 600)
    assert _settled(w)
    w.close(timeout_s=CLOSE_S)
    assert "courier process exited (code -9); restarting it" in caplog.text
    assert _history(sqlite_uri, w.run_id) == list(range(400))
    assert _history(sqlite_uri, w.run_id, "acc") == list(range(400))


@slow
def test_crashed_process_leaves_no_courier_behind(sqlite_uri, tmp_path):
    # Killed with its process group, as `keras-sync launch` kills a worker stuck in a collective (no
    # test zygote: the courier is then the writer's own child). The courier, in its own session, sees
    # its parent die, delivers what it finds, ends the run and exits.
    code = (
        "import os, time, psutil\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={sqlite_uri!r}, experiment='crash', job_id='j', spool_dir={str(tmp_path)!r})\n"
        "w.start()\n"
        "w.log_metrics({'loss': 1.0}, step=0)\n"
        "while not w.flush(timeout_s=60): pass\n"
        "for s in range(1, 50): w.log_metrics({'loss': 1.0}, step=s)\n"
        "w.flush_to_spool()\n"
        "print([p.pid for p in psutil.Process().children()], w.run_id, flush=True)\n"
        "os.killpg(0, 9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=800,
        cwd=tmp_path,
        start_new_session=True,
        env={**os.environ, "KERAS_SYNC_TEST_ZYGOTE": ""},
    )
    assert out.returncode == -9, out.stderr
    # Nothing but MLflow's own lines from the courier (its stderr is the user's): once, `-m` on a
    # module its package imports printed a RuntimeWarning at every courier's start.
    assert "Warning" not in out.stderr, out.stderr
    pids, run_id = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    pids = json.loads(pids)
    assert len(pids) == 1
    assert _wait_for(lambda: all(_gone(p) for p in pids), 300)
    assert _history(sqlite_uri, run_id) == list(range(50))  # it delivered what the crash left
    assert _run_of_job(sqlite_uri, "crash", "j").info.status == "FAILED"  # not RUNNING forever


# ---- which run a `sync.fit` job writes to ----


def _fit(
    config: dict, tmp_path: Path, name: str, crash_at: int | None = None, env: dict | None = None
):
    import os

    cfg_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    cfg_path.write_text(json.dumps(config))
    full = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID")
    }
    full |= {"TF_CPP_MIN_LOG_LEVEL": "2"} | (env or {})
    args = [sys.executable, str(HERE / "_tracking_scenarios.py"), str(cfg_path), str(out_path)]
    out = subprocess.run(
        args + ([str(crash_at)] if crash_at else []),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=full,
    )
    if crash_at:
        assert out.returncode == 9, out.stderr[-3000:]
        return None, out.stderr
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_path.read_text())["run_id"], out.stderr


def _one_point_per_step(uri: str, run_id: str) -> list[int]:
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    for key in c.get_run(run_id).data.metrics:
        steps = [m.step for m in c.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))
    return _history(uri, run_id)


@slow
def test_run_identity_follows_the_backup_and_the_explicit_job_id(sqlite_uri, tmp_path):
    from mlflow import MlflowClient

    exp = _exp()
    config = {
        "strategy": {"kind": "default"},
        "mlflow": {
            "tracking_uri": sqlite_uri,
            "experiment": exp,
            "spool_dir": str(tmp_path / "myspool"),
            "log_every_n_steps": 1,
        },
        "fault_tolerance": {"backup_dir": str(tmp_path / "backup"), "save_freq": 5},
    }
    steps = list(range(1, 41))  # 2 epochs of 20 steps, MLflow step = optimizer step
    # A finished job, run again with the same script and YAML: a new run each time.
    first, err = _fit(config, tmp_path, "first")
    # One line says where the metrics go, with the run id: the writer's thread prints it once the
    # courier has created the run (training does not wait for that).
    # (the scenario passes its config as a dict: no file for `keras-sync ui`, so MLflow's own command)
    assert (
        f"keras-sync: metrics go to MLflow at {sqlite_uri}, experiment {exp!r}, run {first}; "
        f"view it with: mlflow ui --backend-store-uri {sqlite_uri}" in err
    ), err
    assert "not created yet" not in err
    assert _one_point_per_step(sqlite_uri, first) == steps
    assert MlflowClient(sqlite_uri).get_run(first).info.status == "FINISHED"
    # The same job again, killed after step 13 (last backup after step 10): a new run (the first
    # is finished), and the relaunch restores the backup and continues that new run.
    _, err = _fit(config, tmp_path, "crashed", crash_at=13)
    from keras_sync.training import backup_files

    record = backup_files.manifest_run(backup_files.choose(str(tmp_path / "backup")).usable[0])
    assert record["job_id"] and (tmp_path / "myspool").is_dir()
    assert record["run_id"] != first
    resumed, err = _fit(config, tmp_path, "resumed")
    assert "resumed from the backup" in err
    assert resumed != first and (record["run_id"] in (None, resumed))
    assert _one_point_per_step(sqlite_uri, resumed) == steps
    assert MlflowClient(sqlite_uri).get_run(resumed).info.status == "FINISHED"
    assert not (tmp_path / "backup").exists()
    # The explicit job id: two jobs share one run (and still one point per step).
    shared = [
        _fit(config, tmp_path, f"shared{i}", env={"KERAS_SYNC_JOB_ID": "exp-42"})[0]
        for i in range(2)
    ]
    assert shared[0] == shared[1] and shared[0] not in (first, resumed)
    assert _one_point_per_step(sqlite_uri, shared[0]) == steps


def test_calls_to_a_server_see_its_uri_as_the_process_wide_one_and_nothing_leaks(monkeypatch):
    # MLflow 2.x resolves mlflow-artifacts: URIs with the process-wide tracking URI; setting it for
    # good in a process that later calls keras_sync.load() (a test, sync-spool, a notebook) would
    # send that job's metrics to this server (ENV_KEYS: MLFLOW_TRACKING_URI wins over the YAML).
    import os

    from keras_sync.tracking.deliver import fast_fail_env

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mine.db")
    with fast_fail_env("http://alice:pw@127.0.0.1:5000", 5):
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://alice:pw@127.0.0.1:5000"
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///mine.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with fast_fail_env("http://127.0.0.1:5000", 5):
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_a_big_batch_is_split_over_segments_and_read_back_in_order(tmp_path):
    # A writer that fell behind on a busy machine appends thousands of records at once (CI saw 3
    # segments and 1.06 MB left for 5,000 steps): the courier deletes whole segments only.
    from keras_sync.tracking.spool import SEGMENT_BYTES, SpoolDir

    spool = SpoolDir(tmp_path)
    spool.start_segment()
    spool.append([{"k": "m", "v": -1}])
    end = spool.append(
        [{"k": "m", "v": i, "pad": "x" * 100} for i in range(10_000)]
    )  # ~1.2 MB at once
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("*.jsonl"))]
    assert len(sizes) >= 5 and max(sizes) <= SEGMENT_BYTES + 200, sizes
    read = spool.read((0, 0), max_records=10**6)
    assert [r["v"] for _, r in read] == list(range(-1, 10_000))
    assert read[-1][0] == end


# ---- faults of the spool's disk and of the store (issue 24) ----


def _spool_filler(uri: str, experiment: str, spool_dir: Path, *, steps: int, wait_s: float) -> str:
    """A process that logs ``steps`` steps of 10 metrics (~200 bytes per step: a 64 KB spool fills)
    and a param, waits up to ``wait_s`` for delivery (or for MLflow to be known away), and exits
    without closing (atexit does)."""
    return (
        "import time\n"
        "from keras_sync.tracking import MlflowWriter\n"
        f"w = MlflowWriter(tracking_uri={uri!r}, experiment={experiment!r}, job_id='full',\n"
        f"                 spool_dir={str(spool_dir)!r})\n"
        "w.start()\n"
        "w.log_params({'lr': 0.1})\n"
        f"for s in range(1, {steps + 1}):\n"
        "    w.log_metrics({f'm{i}': s / 7 for i in range(9)} | {'loss': 1.0 / s}, step=s)\n"
        "    if s % 50 == 0: time.sleep(0.05)\n"
        f"print('flushed', w.flush(timeout_s={wait_s}), flush=True)\n"
        "while w.failure() is None and w.undelivered_message() is not None: time.sleep(0.05)\n"
    )


@slow
def test_spool_on_a_full_disk_loses_nothing_while_mlflow_takes_the_records(sqlite_uri, tmp_path):
    # Before: from the first refused write on no point was kept (the spool's last line cut off),
    # 166 of 600 points arrived, the run stayed RUNNING, courier and atexit tracebacks.
    from _mounts import tmpfs

    exp = _exp()
    with tmpfs(tmp_path / "small", size="64k") as small:
        out = subprocess.run(
            [sys.executable, "-c", _spool_filler(sqlite_uri, exp, small, steps=600, wait_s=600)],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "flushed True" in out.stdout, out.stderr[-3000:]
        assert f"cannot write its MLflow spool {small}/full (No space left on device)" in out.stderr
        assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[
            -3000:
        ]
        assert "not delivered" not in out.stderr and "lost" not in out.stderr.replace(
            "none is lost", ""
        )
        assert list(small.iterdir()) == []  # all in MLflow: the spool is removed
    run = _run_of_job(sqlite_uri, exp, "full")
    assert run.info.status == "FINISHED" and "keras_sync.metrics_lost" not in run.data.tags
    assert _history(sqlite_uri, run.info.run_id) == list(range(1, 601))
    assert _history(sqlite_uri, run.info.run_id, "m8") == list(range(1, 601))
    assert run.data.params == {"lr": "0.1"}


@slow
def test_full_spool_and_mlflow_away_name_the_lost_steps_and_sync_spool_ends_the_run(
    sqlite_uri, tmp_path
):
    # Both fail: one line names the steps lost; what the spool holds is delivered later, and the
    # run then ends FAILED with a tag naming the loss (before: RUNNING, sync-spool sent 0).
    import re

    from _mounts import tmpfs
    from mlflow import MlflowClient

    exp = _exp()
    with tmpfs(tmp_path / "small", size="64k") as small:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _spool_filler("http://127.0.0.1:1", exp, small, steps=600, wait_s=600),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[
            -3000:
        ]
        (line,) = [x for x in out.stderr.splitlines() if "MLflow lost" in x]
        first_lost = int(re.search(r"lost the points of steps (\d+)-600 ", line).group(1))
        assert 1 < first_lost < 600 and "No space left on device" in line
        assert "the tracking server http://127.0.0.1:1 is unreachable" in line
        assert f"keras-sync sync-spool {small}/full" in line
        # sync-spool to a server that is still away, with no time to retry: one line, a non-zero exit, no wait.
        away = _cli("sync-spool", str(small / "full"), "--timeout", "0", cwd=tmp_path)
        assert (
            away.returncode == 2
            and away.stderr.count("\n") == 1
            and "Could not deliver" in away.stderr
        )
        done = _cli("sync-spool", str(small / "full"), "--tracking-uri", sqlite_uri, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"sent {10 * (first_lost - 1)} metric point(s)" in done.stdout
        assert list(small.iterdir()) == []
    run = _run_of_job(sqlite_uri, exp, "full")
    assert _history(sqlite_uri, run.info.run_id) == list(range(1, first_lost))
    assert run.info.status == "FAILED"
    assert run.data.tags["keras_sync.metrics_lost"].startswith(
        f"the points of steps {first_lost}-600"
    )
    assert MlflowClient(sqlite_uri).get_run(run.info.run_id).data.params == {"lr": "0.1"}


@slow
def test_a_store_that_cannot_be_created_is_named_at_once_and_sync_spool_says_so(tmp_path):
    # Before: fit waited ~110 s (MLflow's engine retries), the line blamed a courier that "had not
    # reached" the store, and sync-spool then hung without output.
    from _mounts import tmpfs

    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        uri = f"sqlite:///{ro}/mlflow.db"
        w = MlflowWriter(tracking_uri=uri, experiment=_exp(), spool_dir=tmp_path / "spool")
        w.start()
        w.log_metrics({"loss": 1.0}, step=1)
        assert _wait_for(lambda: w.failure() is not None, 600)
        assert "Read-only file system" in w.failure()["error"]
        with pytest.warns(RuntimeWarning) as rec:
            t0 = time.perf_counter()
            assert w.end_run(timeout_s=600) is False
            waited = time.perf_counter() - t0
        assert (
            waited < 30
        )  # no wait on a store that cannot be created (MLflow's retries took ~110 s)
        (msg,) = [str(r.message) for r in rec]
        assert f"the local store {uri} fails" in msg and "Read-only file system" in msg
        assert "had not reached" not in msg
        with pytest.warns(RuntimeWarning, match="keras-sync sync-spool"):
            w.close(timeout_s=5)
        replay = _cli("sync-spool", str(w.spool_path), cwd=tmp_path)
        assert replay.returncode == 2 and replay.stderr.count("\n") == 1, replay.stderr
        assert f"cannot be created in '{ro}': Read-only file system" in replay.stderr
        assert w.spool_path.is_dir() and _spooled_steps(w.spool_path) == [1]


@slow
def test_fit_with_its_spool_on_a_full_disk_delivers_every_step(sqlite_uri, tmp_path):
    # Through `sync.fit`: the sync metrics, params, config artifact and the fit-end report of a
    # spool that fills after its first record; every step arrives once and the run is FINISHED.
    from _mounts import tmpfs
    from mlflow import MlflowClient

    exp = _exp()
    with tmpfs(tmp_path / "small", size="24k") as small:
        config = {
            "strategy": {"kind": "default"},
            "mlflow": {
                "tracking_uri": sqlite_uri,
                "experiment": exp,
                "spool_dir": str(small),
                "log_every_n_steps": 1,
            },
        }
        run_id, err = _fit(config, tmp_path, "full")
        assert "cannot write its MLflow spool" in err
        assert (
            "Traceback" not in err and "Exception ignored" not in err and "not delivered" not in err
        ), err[-3000:]
    assert _one_point_per_step(sqlite_uri, run_id) == list(range(1, 41))
    run = MlflowClient(sqlite_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["sync.num_replicas"] == "1"


def test_a_refused_append_leaves_whole_records_and_says_how_many(tmp_path):
    # A full disk cut the spool's last line (every later record was then lost with it); now the
    # torn line is cut off again, and the writer learns which records are in.
    from _mounts import tmpfs

    from keras_sync.tracking.spool import SpoolDir, SpoolFull

    with tmpfs(tmp_path / "small", size="8k") as small:
        spool = SpoolDir(small / "s")
        spool.path.mkdir()
        spool.start_segment()
        batches = [
            [{"k": "m", "s": i, "pad": "x" * 100} for i in range(b, b + 10)]
            for b in range(0, 300, 10)
        ]
        with pytest.raises(SpoolFull) as refused:
            for (
                batch
            ) in batches:  # ~36 KB in all, 10 records every 0.2 s as the writer's thread does
                spool.append(batch)
        first_refused = batch[0]["s"]
        assert refused.value.reason == "No space left on device" and 0 < first_refused < 290
        kept = first_refused + refused.value.done
        read = spool.read((0, 0), max_records=10**6)
        assert [r["s"] for _, r in read] == list(range(kept))
        assert read[-1][0] == refused.value.pos
        assert (spool.path / "00000001.jsonl").stat().st_size == refused.value.pos[1]


def test_one_batch_bigger_than_the_free_room_keeps_the_records_that_fit(tmp_path):
    # A writer's thread that starts late on a busy machine appends all its queued records at once.
    # Before, a refused write threw the whole batch out of the spool (kept only in memory, so with
    # MLflow away every step was lost, from step 1); now the whole lines the disk took stay.
    from _mounts import tmpfs

    from keras_sync.tracking.spool import SpoolDir, SpoolFull

    with tmpfs(tmp_path / "small", size="8k") as small:
        spool = SpoolDir(small / "s")
        spool.path.mkdir()
        spool.start_segment()
        batch = [{"k": "m", "s": i, "pad": "x" * 100} for i in range(300)]  # ~36 KB in one append
        with pytest.raises(SpoolFull) as refused:
            spool.append(batch)
        done = refused.value.done
        assert 0 < done < 300
        read = spool.read((0, 0), max_records=10**6)
        assert [r["s"] for _, r in read] == list(range(done))
        assert read[-1][0] == refused.value.pos
        assert (spool.path / "00000001.jsonl").stat().st_size == refused.value.pos[1]


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A tracking server behind an auth check: every request gets 401 and an HTML page."""

    def _refuse(self) -> None:
        body = b"<html><body><h1>401 Unauthorized</h1>You are not authenticated. Sign in first.</body></html>"
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_DELETE = _refuse

    def log_message(self, *args: object) -> None:
        pass


@slow
def test_refused_credentials_are_said_once_in_one_line_and_training_goes_on(sqlite_uri, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    exp = _exp()
    try:
        _, err = _fit(
            {
                "strategy": {"kind": "default"},
                "mlflow": {"tracking_uri": uri, "experiment": exp, "log_every_n_steps": 1},
            },
            tmp_path,
            "refused",
        )
        spool = json.loads((tmp_path / "refused.out.json").read_text())["spool"]
        again = _cli("sync-spool", spool, cwd=tmp_path)  # still refused: one line, the status only
    finally:
        server.shutdown()
    assert again.returncode != 0 and re.fullmatch(
        re.escape(
            f"Could not deliver spool {spool}: MLflow at {uri} refused the credentials (HTTP 401 Unauthorized); "
        )
        + r"(\d+) of \1 metric point\(s\) are left in it; "
        + re.escape(
            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), then run "
            "`keras-sync sync-spool` again."
        ),
        again.stderr.strip().splitlines()[-1],
    ), again.stderr
    # Before: the server's page in 4 messages (the first line, a warning, fit's end, exit).
    # Lines that speak of the refusal (not "401" alone: TensorFlow's start-up lines carry a timestamp and a pid whose
    # digits can hold "401", which failed CI once).
    said = [
        line
        for line in err.splitlines()
        if re.search(r"HTTP 401|Unauthori[sz]ed|not authenticated|refused", line)
    ]
    assert len(said) == 1, err[-3000:]
    assert said[0] == (
        f"keras-sync: MLflow at {uri} refused the credentials (HTTP 401 Unauthorized); training goes "
        f"on and the metrics are kept in {spool}. Set MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), then deliver them with: "
        f"keras-sync sync-spool {spool}"
    )
    assert "Unauthorized</h1>" not in err and "not delivered yet" not in err
    # Training went on (the scenario wrote its result after fit), and the spool kept every step.
    out = _cli("sync-spool", spool, "--tracking-uri", sqlite_uri, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    from mlflow import MlflowClient

    c = MlflowClient(sqlite_uri)
    (run,) = c.search_runs([c.get_experiment_by_name(exp).experiment_id])
    assert _history(sqlite_uri, run.info.run_id) == list(range(1, 41))


def test_a_refused_credential_is_told_by_its_http_status():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, PERMISSION_DENIED, UNAUTHENTICATED

    from keras_sync.tracking.deliver import is_transient, refused_credentials

    assert (
        refused_credentials(MlflowException("<html>...</html>", error_code=UNAUTHENTICATED)) == 401
    )
    assert (
        refused_credentials(MlflowException("<html>...</html>", error_code=PERMISSION_DENIED))
        == 403
    )
    assert refused_credentials(MlflowException("busy", error_code=INTERNAL_ERROR)) is None
    assert refused_credentials(OSError("connection refused")) is None
    assert not is_transient(
        MlflowException("x", error_code=UNAUTHENTICATED)
    )  # said, not retried quietly


def _report_spool(tmp_path: Path, uri: str, job: str) -> SpoolDir:  # noqa: F821
    from keras_sync.tracking.spool import SpoolDir

    spool = SpoolDir(tmp_path / f"spool-{job}")
    spool.path.mkdir()
    spool.write_header(
        {
            "v": 2,
            "experiment": _exp(),
            "run_name": None,
            "job_id": job,
            "explicit": False,
            "tracking_uri": uri,
            "run_id": None,
        }
    )
    spool.start_segment()
    return spool


def _report_of(step_ms: float) -> dict:
    from keras_sync.tracking.report_plot import SyncHistory

    h = SyncHistory()
    h.add({"sync/step_time_ms": step_ms, "sync/loss/replica_0": 1.0, "sync/loss/replica_1": 1.0}, 1)
    return {"k": "report", "f": "sync_report.png", "h": h.to_dict()}


def _artifacts(uri: str, run_id: str) -> list[str]:
    from mlflow import MlflowClient

    return [a.path for a in MlflowClient(uri).list_artifacts(run_id)]


def test_a_spooled_report_is_drawn_into_its_run_by_the_courier_and_by_sync_spool(
    tmp_path, sqlite_uri
):
    from keras_sync.tracking.courier import Delivery

    spool = _report_spool(tmp_path, sqlite_uri, "drawn")
    ended = [{"k": "begin", "ts": 1}, {"k": "end", "status": "FINISHED", "last": False}]
    spool.append([*ended, _report_of(5.0)])
    delivery = Delivery(spool, sqlite_uri)
    delivery.deliver_available()
    assert _artifacts(sqlite_uri, delivery.sender.run_id) == ["sync_report.png"]
    # A spool left with a report in it (its courier killed): sync-spool draws it into the run.
    left = _report_spool(tmp_path, sqlite_uri, "left")
    left.append([*ended, _report_of(6.0)])
    left.close_segment()
    experiment = left.header()["experiment"]
    replay_spool(left.path, sqlite_uri)
    run = _run_of_job(sqlite_uri, experiment, "left")
    assert _artifacts(sqlite_uri, run.info.run_id) == ["sync_report.png"]
