"""Slurm end to end: a real single-node Slurm cluster (slurmctld, slurmd, munged from Debian's
slurm-wlm and munge), started in a temporary directory by `.ci/slurm_setup.sh` and stopped by PID.

`srun -n 2 python _mwr_train.py` with `strategy.cluster: slurm` trains as 2 workers (task 0 the
chief), with the weights of one process, and logs one FINISHED MLflow run with both replicas at
every step. `scancel --signal=TERM` mid-epoch on an `sbatch -n 2` job makes both tasks save a
backup at one step and exit 143, and the job submitted again resumes there exactly (one MLflow
run, every step once). As root the fixture installs the packages if they are missing (about 2
minutes with apt here); elsewhere it fails and says how to install them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _mwr import TRAIN, max_diff, result
from _spools import deliver_leftovers

from keras_sync.cluster.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / ".ci" / "slurm_setup.sh"
STEPS = 2 * 8  # 2 epochs x 256 samples / global batch 32


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(
        ["bash", str(SETUP), "start", str(d)], capture_output=True, text=True, timeout=600
    )
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        yield {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SETUP), "stop", str(d)], capture_output=True, timeout=60)


def _env(base: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in base.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


@pytest.fixture(scope="module")
def uninterrupted(slurm: dict, tmp_module: Path) -> dict:
    """`srun -n 2` of the training script (MLflow on), and one process alone beside it."""
    uri = f"sqlite:///{tmp_module / 'mlflow.db'}"
    common = {"batch": {"global": 32}, "learning_rate": {"base": 0.01, "base_batch_size": 32}}
    job = {
        **common,
        "strategy": {"kind": "auto", "cluster": "slurm", "connect_timeout_s": 120},
        "mlflow": {
            "enabled": True,
            "tracking_uri": uri,
            "experiment": "slurm",
            "log_every_n_steps": 1,
        },
    }
    one = {**common, "strategy": {"kind": "multi_worker_mirrored"}, "mlflow": {"enabled": False}}
    from mlflow import MlflowClient

    MlflowClient(uri).create_experiment(
        "slurm"
    )  # the store exists before the job, as a tracking server would
    alone = subprocess.Popen(
        [sys.executable, str(TRAIN), json.dumps(one), str(tmp_module / "one"), "--epochs", "2"],
        env=_env(dict(os.environ)),
        cwd=tmp_module,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    srun = [
        _slurm_command(slurm, "srun"),
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        sys.executable,
        str(TRAIN),
        json.dumps(job),
        str(tmp_module / "job"),
        "--epochs",
        "2",
    ]
    r = subprocess.run(
        srun, env=_env(slurm), cwd=tmp_module, capture_output=True, text=True, timeout=600
    )
    alone_log = alone.communicate(timeout=600)[0]
    return {"srun": r, "alone": (alone.returncode, alone_log), "uri": uri, "dir": tmp_module}


def _slurm_command(slurm: dict, name: str) -> str:
    return shutil.which(name, path=slurm.get("PATH")) or name


@pytest.mark.timeout(900)
def test_srun_two_tasks_train_as_two_workers_like_one_process(uninterrupted: dict) -> None:
    host = socket.gethostname().split(".")[0]  # SLURM_STEP_NODELIST: the node's short name
    r, (alone_code, alone_log), tmp = (
        uninterrupted["srun"],
        uninterrupted["alone"],
        uninterrupted["dir"],
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert alone_code == 0, alone_log[-3000:]

    w = [result(tmp / "job", i) for i in range(2)]
    reference = result(tmp / "one")
    assert [(x["task"], x["num_workers"], x["num_replicas"]) for x in w] == [(0, 2, 2), (1, 2, 2)]
    for x in w:
        assert max_diff(x["weights"], reference["weights"]) <= 1e-5
    # strategy.slurm.port_base: auto; the step's ports come from its job and step ids, not 8888.
    from keras_sync.cluster import slurm_port_base

    base = slurm_port_base(w[0]["env"])
    assert base != 8888 and w[0]["env"]["SLURM_JOB_ID"], w[0]["env"]
    assert [x["cluster"] for x in w] == [{"worker": [f"{host}:{base}", f"{host}:{base + 1}"]}] * 2

    # What the courier could not deliver before the job step ended (on a loaded machine it runs
    # niced, and srun ends every process of the step) waits in the spool: deliver it the
    # documented way, then the run must be whole.
    _deliver_spools(tmp)
    from mlflow import MlflowClient

    client = MlflowClient(uninterrupted["uri"])
    runs = client.search_runs([client.get_experiment_by_name("slurm").experiment_id])
    assert [run.info.status for run in runs] == ["FINISHED"]  # one run: the chief's (task 0)
    for replica in (0, 1):
        steps = [
            m.step
            for m in client.get_metric_history(runs[0].info.run_id, f"sync/loss/replica_{replica}")
        ]
        assert sorted(steps) == list(range(1, STEPS + 1)), (replica, steps)
    assert "Traceback" not in r.stderr and "unhealthy" not in r.stderr, r.stderr[-3000:]


def _deliver_spools(cwd: Path) -> None:
    deliver_leftovers(cwd / ".keras_sync_spool")


# -- scancel --signal=TERM mid-epoch: a coordinated save, exit 143, the resubmitted job resumes --


HOLD_AT = 11  # epoch 2, batch 3 of 8; both tasks hold there until the SIGTERM has reached them


class Job:
    """An `sbatch --wait -n 2` job whose batch script is `srun -l python _mwr_train.py ARGS`."""

    def __init__(self, slurm: dict, cwd: Path, name: str, train_args: list[str]):
        script = cwd / f"{name}.sh"
        script.write_text(
            "#!/bin/bash\n"
            + shlex.join(["srun", "-l", sys.executable, str(TRAIN), *train_args])
            + "\n"
        )
        self.output = cwd / f"{name}.out"
        self.slurm = slurm
        self.proc = subprocess.Popen(
            [
                _slurm_command(slurm, "sbatch"),
                "--parsable",
                "--wait",
                "-n",
                "2",
                "-o",
                str(self.output),
                str(script),
            ],
            env=_env(slurm),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.id = self.proc.stdout.readline().strip().split(";")[0]
        assert self.id.isdigit(), self.proc.communicate(timeout=60)

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def wait_for_lines(self, lines: set[str], timeout: float = 600) -> None:
        """Until every line of ``lines`` is in the job's output (polled: Slurm writes it to a file)."""
        deadline = time.monotonic() + timeout
        while not lines <= set(self.log().splitlines()):
            assert self.proc.poll() is None, (
                f"the job ended ({self.proc.returncode}) first:\n{self.log()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no {sorted(lines)} within {timeout:g} s:\n{self.log()[-3000:]}"
            )
            time.sleep(0.1)

    def wait(self, timeout: float = 600) -> int:
        self.proc.communicate(timeout=timeout)
        return self.proc.returncode

    def cancel(self) -> None:
        if self.proc.poll() is None:
            subprocess.run(
                [_slurm_command(self.slurm, "scancel"), self.id], env=_env(self.slurm), timeout=60
            )
            self.proc.communicate(timeout=120)


def _task_exit_codes(log: str) -> dict[int, int]:
    """srun's own report: `srun: error: NODE: tasks 0-1: Exited with exit code 143` (or one line per task)."""
    codes = {}
    for tasks, code in re.findall(
        r"^srun: error: \S+: tasks? ([\d,-]+): Exited with exit code (\d+)$", log, re.M
    ):
        for part in tasks.split(","):
            lo, _, hi = part.partition("-")
            codes.update({t: int(code) for t in range(int(lo), int(hi or lo) + 1)})
    return codes


def _processes_of_job(job_id: str) -> list[str]:
    """Processes whose environment says they belong to Slurm job ``job_id`` (root reads every /proc/PID/environ)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job_id}".encode() in environ:
                cmdline = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                found.append(f"{entry.name}: {cmdline[:200]}")
        except OSError:  # it ended while we looked
            continue
    return found


def _nothing_left(job_id: str, timeout: float = 60) -> list[str]:
    """What of the job still runs once Slurm has cleaned up (polled: the step's teardown takes a moment)."""
    deadline = time.monotonic() + timeout
    while (left := _processes_of_job(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.timeout(1500)
def test_scancel_signal_term_mid_epoch_saves_on_both_tasks_and_the_resubmitted_job_resumes_exactly(
    slurm: dict, tmp_module: Path, uninterrupted: dict, tmp_path: Path
) -> None:
    assert uninterrupted["srun"].returncode == 0, uninterrupted["srun"].stderr[-3000:]
    uri, backup = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "backup"
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp_id = client.create_experiment("slurm-preempted")
    cfg = {
        "batch": {"global": 32},
        "learning_rate": {"base": 0.01, "base_batch_size": 32},
        "strategy": {"kind": "auto", "cluster": "slurm", "connect_timeout_s": 120},
        "mlflow": {
            "enabled": True,
            "tracking_uri": uri,
            "experiment": "slurm-preempted",
            "log_every_n_steps": 1,
        },
        "fault_tolerance": {"backup_dir": str(backup), "save_freq": "epoch"},
    }
    args = [
        json.dumps(cfg),
        str(tmp_path / "job"),
        "--epochs",
        "2",
        "--hold-at",
        str(HOLD_AT),
        "--marker",
        str(tmp_path / "held"),
    ]

    first = Job(slurm, tmp_path, "first", args)
    try:
        first.wait_for_lines({f"{t}: holding after step {HOLD_AT}" for t in (0, 1)})
        # No --full/--batch: the signal goes to every process of the job's steps (both tasks and
        # the chief's MLflow courier), not to the batch shell or srun (see the README's Slurm part).
        signalled = time.monotonic()
        subprocess.run(
            [_slurm_command(slurm, "scancel"), "--signal=TERM", first.id],
            env=_env(slurm),
            check=True,
            timeout=60,
        )
        code = first.wait()
        took = time.monotonic() - signalled
    finally:
        first.cancel()
    log = first.log()
    assert code == PREEMPTED_EXIT_CODE, log[-4000:]  # the batch script's code: srun's, the tasks'
    assert _task_exit_codes(log) == {0: PREEMPTED_EXIT_CODE, 1: PREEMPTED_EXIT_CODE}, log[-4000:]
    # Both tasks had the signal before step 12: they agree on saving after step 13 (epoch 2, batch 5).
    assert (
        f"0: keras-sync: SIGTERM: saved a backup in {backup} at epoch 2, after batch 5 (optimizer step 13); "
        "exiting with code 143. Relaunch the job to resume from there." in log.splitlines()
    ), log[-4000:]
    assert "Traceback" not in log and "courier process exited" not in log, log[-4000:]
    assert took < 300, (
        took
    )  # the whole job's end as sbatch --wait sees it (it polls the controller)
    assert _nothing_left(first.id) == []
    (run,) = client.search_runs([exp_id])
    assert run.info.status == "KILLED"  # preempted: the relaunch continues this run

    second = Job(slurm, tmp_path, "second", args)
    try:
        code = second.wait()
    finally:
        second.cancel()
    log = second.log()
    assert code == 0, log[-4000:]
    assert (
        f"0: keras-sync: resumed from the backup in {backup}: epoch 2, after batch 5 (optimizer step 13)"
        in log.splitlines()
    ), log[-4000:]
    trained = [line for line in log.splitlines() if line.startswith("0: step ")]
    assert trained == [
        "0: step 14 epoch 1 batch 5",
        "0: step 15 epoch 1 batch 6",
        "0: step 16 epoch 1 batch 7",
    ]
    reference = uninterrupted["dir"] / "job"
    for t in (0, 1):
        resumed = result(tmp_path / "job", t)
        assert resumed["start"] == {"iterations": 13, "epoch": 1}
        assert resumed["iterations"] == STEPS
        assert max_diff(resumed["weights"], result(reference, t)["weights"]) <= 1e-6
    assert not backup.exists()  # deleted when training ended
    assert _nothing_left(second.id) == []

    _deliver_spools(tmp_path)  # as in the test above: what the step's end cut short
    (again,) = client.search_runs([exp_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    for replica in (0, 1):
        steps = [
            m.step
            for m in client.get_metric_history(run.info.run_id, f"sync/loss/replica_{replica}")
        ]
        assert sorted(steps) == list(range(1, STEPS + 1)), (replica, steps)
