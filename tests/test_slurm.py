"""Slurm end to end: a real single-node Slurm cluster (slurmctld, slurmd, munged from Debian's
slurm-wlm and munge), started in a temporary directory by `.ci/slurm_setup.sh` and stopped by PID.

`srun -n 2 python _mwr_train.py` with `strategy.cluster: slurm` trains as 2 workers (task 0 the
chief), with the weights of one process, and logs one FINISHED MLflow run with both replicas at
every step. As root the fixture installs the packages if they are missing (about 2 minutes with
apt here); elsewhere it fails and says how to install them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / ".ci" / "slurm_setup.sh"
TRAIN = Path(__file__).parent / "_mwr_train.py"
STEPS = 2 * 8  # 2 epochs x 256 samples / global batch 32


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(["bash", str(SETUP), "start", str(d)], capture_output=True, text=True, timeout=600)
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        yield {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SETUP), "stop", str(d)], capture_output=True, timeout=60)


def _env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


@pytest.mark.timeout(900)
def test_srun_two_tasks_train_as_two_workers_like_one_process(slurm: dict, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = {"batch": {"global": 32}, "learning_rate": {"base": 0.01, "base_batch_size": 32}}
    job = {**common, "strategy": {"kind": "auto", "cluster": "slurm", "connect_timeout_s": 120},
           "mlflow": {"enabled": True, "tracking_uri": uri, "experiment": "slurm"}}
    one = {**common, "strategy": {"kind": "multi_worker_mirrored"}, "mlflow": {"enabled": False}}
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    client.create_experiment("slurm")  # the store exists before the job, as a tracking server would
    alone = subprocess.Popen([sys.executable, str(TRAIN), json.dumps(one), str(tmp_path / "one"), "--epochs", "2"],
                             env=_env(dict(os.environ)), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    srun = [shutil.which("srun", path=slurm.get("PATH")) or "srun", "-n", "2", "--kill-on-bad-exit=1",
            sys.executable, str(TRAIN), json.dumps(job), str(tmp_path / "job"), "--epochs", "2"]
    r = subprocess.run(srun, env=_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    alone_log = alone.communicate(timeout=600)[0]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert alone.returncode == 0, alone_log[-3000:]

    w = [json.loads((tmp_path / "job" / f"w{i}.json").read_text()) for i in range(2)]
    reference = json.loads((tmp_path / "one" / "w0.json").read_text())
    assert [(x["task"], x["num_workers"], x["num_replicas"]) for x in w] == [(0, 2, 2), (1, 2, 2)]
    for x in w:
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(x["weights"], reference["weights"]))
        assert diff <= 1e-5, diff

    # What the courier could not deliver before the job step ended (on a loaded machine it runs
    # niced, and srun ends every process of the step) waits in the spool: deliver it the
    # documented way, then the run must be whole.
    spools = sorted((tmp_path / ".keras_sync_spool").glob("*.spool.jsonl"))
    for spool in spools:
        replay = subprocess.run([str(Path(sys.executable).with_name("keras-sync")), "sync-spool", str(spool)],
                                capture_output=True, text=True, timeout=300)
        assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    runs = client.search_runs([client.get_experiment_by_name("slurm").experiment_id])
    assert [run.info.status for run in runs] == ["FINISHED"]  # one run: the chief's (task 0)
    for replica in (0, 1):
        steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, f"sync/replica_{replica}/loss")]
        assert sorted(steps) == list(range(1, STEPS + 1)), (replica, steps)
    assert "Traceback" not in r.stderr and "unhealthy" not in r.stderr, r.stderr[-3000:]
