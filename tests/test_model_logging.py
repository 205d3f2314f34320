"""Autolog parity: the trained model (MLflow Keras flavour), fit and optimizer params, model summary,
source tags, the run's real start and end, and `mlflow.keras.autolog()` beside `sync.fit`.

The TensorFlow runs are tests/_autolog_scenarios.py (fixture `autolog_runs` in conftest.py, shared
with test_sync_report.py), read back with `MlflowClient` from a real sqlite store and a real
`mlflow server`; models are loaded with `mlflow.pyfunc.load_model` in a fresh Python process.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from keras_sync.config import load_config
from keras_sync.errors import ConfigError
from keras_sync.tracking import source_tags as _source_tags

# The shared TensorFlow runs take 5-15 minutes on a shared 2-core machine (the first test pays for them).
pytestmark = pytest.mark.timeout(2400)

# ---- no TensorFlow --------------------------------------------------------------------------------


def test_log_model_is_off_and_sync_report_at_end_by_default():
    cfg = load_config({})
    assert (cfg.mlflow.log_model, cfg.mlflow.sync_report) == (False, "end")


def test_sync_report_accepts_bare_off_and_names_the_allowed_values(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("mlflow:\n  log_model: true\n  sync_report: off\n")
    cfg = load_config(str(f))
    assert (cfg.mlflow.log_model, cfg.mlflow.sync_report) == (True, "off")
    f.write_text("mlflow:\n  sync_report: always\n")
    with pytest.raises(
        ConfigError,
        match=r":2: mlflow.sync_report: received 'always', expected one of end, epoch, off",
    ):
        load_config(str(f))
    f.write_text("mlflow:\n  log_model: 1\n")
    with pytest.raises(
        ConfigError, match=r":2: mlflow.log_model: received 1, expected true or false"
    ):
        load_config(str(f))


def test_source_tags_doctest():
    assert doctest.testmod(_source_tags).failed == 0


def test_source_tags_name_the_commit_and_hide_credentials(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "exp"], check=True)
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    subprocess.run(
        [*git, "remote", "add", "origin", "https://alice:tok-Zz91@git.example.com/ml/train.git"],
        check=True,
    )
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tags = _source_tags.source_tags([str(repo / "train.py")])
    assert tags["mlflow.source.name"] == str(repo / "train.py")
    assert tags["mlflow.source.git.commit"] == commit and tags["mlflow.source.git.branch"] == "exp"
    assert tags["mlflow.source.git.repoURL"] == "https://git.example.com/ml/train.git"
    assert tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL"
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "t.py").write_text("")
    assert not any(
        k.startswith("mlflow.source.git") for k in _source_tags.source_tags([str(outside / "t.py")])
    )


@pytest.mark.slow  # a courier process and a fresh sqlite store: 20-70 s on a busy machine
def test_writer_uploads_files_in_order_and_the_run_keeps_its_real_start_and_end(tmp_path):
    from mlflow import MlflowClient

    from keras_sync.tracking import MlflowWriter
    from keras_sync.tracking import artifacts as _artifacts

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    started = int(time.time() * 1000)
    writer = MlflowWriter(tracking_uri=uri, experiment="files", spool_dir=tmp_path / "spool")
    writer.start()
    src = tmp_path / "report.txt"
    src.write_text("first")
    writer.log_artifact_file(src)
    src.write_text("changed after the call")  # the writer copied it: the upload is "first"
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.bin").write_bytes(b"\x00\x01")
    writer.log_artifact_file(folder, "things")
    writer.log_metrics({"x": 1.0}, step=1)
    before_close = int(time.time() * 1000)
    writer.close(timeout_s=120)
    c = MlflowClient(uri)
    run = c.get_run(writer.run_id)
    assert started <= run.info.start_time <= before_close
    assert before_close <= run.info.end_time <= int(time.time() * 1000)
    assert (
        Path(c.download_artifacts(writer.run_id, "report.txt", str(tmp_path / "dl"))).read_text()
        == "first"
    )
    assert (
        Path(
            c.download_artifacts(writer.run_id, "things/sub/a.bin", str(tmp_path / "dl"))
        ).read_bytes()
        == b"\x00\x01"
    )
    assert not _artifacts.staging_dir(
        writer.spool_path
    ).exists()  # every staged copy removed once delivered


# ---- real training runs ---------------------------------------------------------------------------


def _ok(result):
    assert "unexpected" not in result, (
        f"{result.get('unexpected')}: {result.get('message')}\n{result.get('tb')}"
    )


def _load_in_fresh_process(uri: str, model_uri: str, probe_seed_rows: int = 32) -> np.ndarray:
    """`mlflow.pyfunc.load_model` in a process that never imported keras_sync, predictions of the probe rows."""
    code = (
        "import sys, json, numpy as np, mlflow\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        f"m = mlflow.pyfunc.load_model({model_uri!r})\n"
        "rng = np.random.default_rng(0)\n"
        f"X = rng.normal(size=(640, 8)).astype('float32')[:{probe_seed_rows}]\n"
        "assert 'keras_sync' not in sys.modules\n"
        "print('PRED' + json.dumps(np.asarray(m.predict(X)).ravel().tolist()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("PRED")][-1]
    return np.asarray(json.loads(line[4:]), dtype=np.float32)


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(uri)


@pytest.mark.slow
def test_logged_model_loads_with_pyfunc_and_predicts_like_the_trained_model(autolog_runs):
    r = autolog_runs["mirrored"]["logged"]
    _ok(r)
    c = _client(autolog_runs["sqlite"])
    run = c.get_run(r["run_id"])
    models = c.search_logged_models([run.info.experiment_id])
    assert [(m.name, m.source_run_id, m.status.name) for m in models] == [
        ("model", r["run_id"], "READY")
    ]
    trained = np.load(autolog_runs["out"] / "logged.npy").ravel()
    # Saved without its optimizer (it holds keras-sync's GradualWarmup), so plain MLflow loads it.
    loaded = _load_in_fresh_process(autolog_runs["sqlite"], f"runs:/{r['run_id']}/model")
    np.testing.assert_allclose(loaded, trained, rtol=0, atol=1e-6)
    assert np.abs(trained).max() > 0.1


@pytest.mark.slow
def test_model_with_plain_keras_objects_keeps_its_optimizer(autolog_runs, monkeypatch):
    import mlflow

    r = autolog_runs["mirrored"]["compiled"]
    _ok(r)
    # mlflow.set_tracking_uri also sets $MLFLOW_TRACKING_URI, which every later test's training
    # subprocess would inherit (and keras-sync reads it over the YAML): monkeypatch removes it after.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", autolog_runs["sqlite"])
    mlflow.set_tracking_uri(autolog_runs["sqlite"])
    model = mlflow.keras.load_model(f"runs:/{r['run_id']}/model")
    assert model.compiled and type(model.optimizer).__name__ == "Adam"
    assert int(model.optimizer.iterations.numpy()) == r["iterations"] == 10
    np.testing.assert_allclose(
        model.predict(
            np.random.default_rng(0).normal(size=(640, 8)).astype("float32")[:32], verbose=0
        ).ravel(),
        np.load(autolog_runs["out"] / "compiled.npy").ravel(),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.slow
def test_fit_params_optimizer_summary_and_source_tags(autolog_runs):
    r = autolog_runs["mirrored"]["logged"]
    run = _client(autolog_runs["sqlite"]).get_run(r["run_id"])
    p, tags = run.data.params, run.data.tags
    # 640 examples, validation_split 0.2: 512 / 64 = 8 steps per epoch.
    assert {
        k: p[k] for k in ("epochs", "steps_per_epoch", "batch_size", "per_replica_batch_size")
    } == {"epochs": "3", "steps_per_epoch": "8", "batch_size": "64", "per_replica_batch_size": "32"}
    assert p["optimizer_name"] == "SGD".lower() and p["optimizer_momentum"] == "0.9"
    assert "GradualWarmup" in p["optimizer_learning_rate"]
    assert tags["mlflow.source.name"].endswith("_autolog_scenarios.py") and tags["mlflow.user"]
    assert tags["mlflow.source.type"] == "LOCAL"
    assert len(tags["mlflow.source.git.commit"]) == 40  # the tests run from the keras-sync checkout
    local = _client(autolog_runs["sqlite"]).download_artifacts(
        r["run_id"], "model_summary.txt", str(autolog_runs["out"] / "dl-summary")
    )
    summary = Path(local).read_text()
    assert "dense" in summary and "Trainable params: 161" in summary  # 8*16+16 + 16+1


@pytest.mark.slow
def test_config_is_params_and_an_artifact_not_one_long_tag(autolog_runs):
    r = autolog_runs["mirrored"]["logged"]
    run = _client(autolog_runs["sqlite"]).get_run(r["run_id"])
    p = run.data.params
    assert p["config.mlflow.log_model"] == "True" and p["config.mlflow.sync_report"] == "epoch"
    assert (
        p["config.strategy.simulated_cpu_replicas"] == "2"
        and p["config.batch.per_replica"] == "null"
    )
    assert max(len(v) for v in run.data.tags.values()) < 200, "a long tag is unreadable in the UI"
    assert "keras_sync.config" not in run.data.tags


@pytest.mark.slow
def test_run_starts_when_fit_starts_and_ends_when_fit_returns(autolog_runs):
    r = autolog_runs["mirrored"]["logged"]
    run = _client(autolog_runs["sqlite"]).get_run(r["run_id"])
    # The writer is made inside fit (before its first step); sync.fit ends the run before it
    # returns, once MLflow has everything (Ray Train V2 ends workers without atexit).
    assert r["fit_start_ms"] <= run.info.start_time <= r["fit_start_ms"] + 30_000
    assert run.info.start_time < run.info.end_time <= r["fit_end_ms"]
    assert run.info.end_time - run.info.start_time >= r["fit_end_ms"] - r["fit_start_ms"] - 30_000
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_autolog_beside_sync_fit_is_one_run_without_errors(autolog_runs):
    r = autolog_runs["mirrored"]["autolog"]
    _ok(r)
    c = _client(autolog_runs["sqlite"])
    exp = c.get_experiment_by_name("autolog")
    runs = c.search_runs([exp.experiment_id])
    assert [x.info.run_id for x in runs] == [r["run_id"]]
    run = runs[0]
    p = run.data.params
    # autolog's own params (it logs fit() arguments as given) and keras-sync's, side by side.
    assert p["epochs"] == "2" and p["batch_size"] == "64" and p["optimizer_name"].startswith("adam")
    assert (
        p["shuffle"] == "False"
        and p["per_replica_batch_size"] == "32"
        and p["sync.num_replicas"] == "2"
    )
    assert run.data.tags["keras_sync.autolog"] == "true"
    assert {"sync/loss/replica_0", "sync/grad_norm/replica_1", "sync/weight_divergence"} <= set(
        run.data.metrics
    )
    # The Keras logs come from autolog only (per epoch, step = epoch index): one point per (key, step).
    loss = c.get_metric_history(r["run_id"], "loss")
    assert sorted(m.step for m in loss) == [0, 1]
    # One model, autolog's (mlflow.log_model: true leaves it to autolog).
    assert [m.name for m in c.search_logged_models([exp.experiment_id])] == ["model"]
    assert not any(w.startswith("UserWarning: keras-sync") for w in r["warnings"]), r["warnings"]
    # (autolog re-emits Python warnings it sees during fit, e.g. numpy's DeprecationWarning from Keras: not ours)
    bad = [
        m
        for m in r["mlflow_warnings"]
        if "DeprecationWarning" not in m
        and any(
            s in m.lower()
            for s in ("error", "exception", "changing param", "already active", "failed")
        )
    ]
    assert not bad, bad
    assert r["active_after"] is False  # sync.fit leaves no MLflow run active behind it


@pytest.mark.slow
def test_multi_worker_chief_logs_the_model_and_the_worker_leaves_at_once(autolog_runs):
    """Both workers call mlflow.keras.autolog(log_models=False): still one run, one model, the chief's."""
    r = autolog_runs["multi_worker"]
    assert (r["kind"], r["replicas"]) == ("multi_worker_mirrored", 2)
    c = _client(autolog_runs["mw_sqlite"])
    assert (
        c.search_runs(["0"]) == []
    )  # no autolog run of a worker in the "Default" experiment either
    exp = c.get_experiment_by_name("mw-model")
    runs = c.search_runs([exp.experiment_id])
    assert [x.info.run_id for x in runs] == [r["run_id"]]
    assert (
        runs[0].data.params["epochs"] == "2" and runs[0].data.tags["keras_sync.autolog"] == "true"
    )
    assert [m.name for m in c.search_logged_models([exp.experiment_id])] == ["model"]
    loaded = _load_in_fresh_process(autolog_runs["mw_sqlite"], f"runs:/{r['run_id']}/model")
    np.testing.assert_allclose(
        loaded, np.load(autolog_runs["out"] / "multi_worker.npy").ravel(), rtol=0, atol=1e-6
    )
    assert "sync_report.png" in [a.path for a in c.list_artifacts(r["run_id"])]
