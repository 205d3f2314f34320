"""SIGTERM under fault_tolerance.backup_dir: save a backup here, exit 143, resume exactly.

The 2-worker case (SIGTERM to one host's worker inside a collective) is in tests/test_two_hosts.py;
lost-peer lines are tested here as pure functions and end to end in tests/test_two_hosts.py.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _spools import deliver_leftovers
from keras_sync.cluster import lost_peer as _lost_peer
from keras_sync import load_config
from keras_sync.errors import ConfigError, PeerLostError, UsageError
from keras_sync.cluster.preemption import PREEMPTED_EXIT_CODE

TRAIN = Path(__file__).with_name("_mwr_train.py")
EPOCHS, SAMPLES = 3, 320  # 10 steps per epoch at global batch 32


def test_grace_period_defaults_to_25_s_and_must_be_positive() -> None:
    assert load_config({}).fault_tolerance.grace_period_s == 25.0
    assert load_config({"fault_tolerance": {"grace_period_s": 55}}).fault_tolerance.grace_period_s == 55.0
    with pytest.raises(ConfigError, match=r"<dict>: fault_tolerance\.grace_period_s: received 0, expected a number > 0"):
        load_config({"fault_tolerance": {"grace_period_s": 0}})


@pytest.mark.parametrize("bad", [0, -1, "25", True])
def test_backup_callback_rejects_bad_grace_period(bad: object) -> None:
    from keras_sync.callbacks.backup import BackupAndRestore

    with pytest.raises(UsageError) as e:
        BackupAndRestore("/tmp/x", grace_period_s=bad)  # type: ignore[arg-type]
    assert str(e.value) == (f"Invalid value for argument `grace_period_s`. Received: grace_period_s={bad!r}. "
                            "Expected a number of seconds > 0, or None to leave SIGTERM alone.")


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_sigterm_watch_records_the_signal_and_gives_it_back() -> None:
    r = _python(
        "import os, signal, time\n"
        "from keras_sync.cluster.preemption import SigtermWatch\n"
        "w = SigtermWatch(30)\n"
        "assert w.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "print('pending', w.pending)\n"
        "w.done(); w.uninstall()\n"
        "print('handler restored', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('not reached')\n"
    )
    assert r.stdout.split("\n")[:2] == ["pending True", "handler restored True"]
    assert r.returncode == -signal.SIGTERM


def test_watchdog_exits_143_with_a_line_when_no_save_comes_within_the_grace() -> None:
    start = time.monotonic()
    r = _python(
        "import os, signal, threading\n"
        "from keras_sync.cluster.preemption import SigtermWatch\n"
        "SigtermWatch(1.5).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "threading.Event().wait(60)  # a main thread that never reaches the save\n"
    )
    assert r.returncode == PREEMPTED_EXIT_CODE
    assert 1.5 <= time.monotonic() - start < 30
    assert r.stderr == (
        "keras-sync: SIGTERM: no backup could be saved within fault_tolerance.grace_period_s=1.5 s (TensorFlow did "
        "not return to Python: a peer stopped answering, or a long validation pass); exiting without it. Relaunch "
        "the job to resume from the last backup.\n")


def test_lost_peer_doctests_pass() -> None:
    assert doctest.testmod(_lost_peer).failed == 0


CLUSTER = {"worker": ["10.203.7.1:20000", "10.203.7.2:20000"]}
UNHEALTHY = ("Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
             "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.")


def test_lost_peer_line_names_task_address_reason_and_resume() -> None:
    assert _lost_peer.lost_peer_message(UNHEALTHY, CLUSTER, ("worker", 0), backup_dir="/shared/bk") == (
        "/job:worker/task:0 lost contact with /job:worker/task:1 (10.203.7.2:20000): the worker stopped, or its host "
        "or the network failed (TensorFlow: stopped sending heartbeats). Relaunch every worker to continue; with "
        "fault_tolerance.backup_dir=/shared/bk it resumes from the last backup.")


def test_isolated_worker_names_the_coordination_service_host() -> None:
    line = _lost_peer.lost_peer_message("Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat",
                                        {"chief": ["10.0.0.9:1"], "worker": ["10.0.0.1:1", "10.0.0.2:1"]},
                                        ("worker", 1), backup_dir=None)
    assert line.startswith("/job:worker/task:1 lost contact with /job:chief/task:0 (10.0.0.9:1): ")
    assert "(TensorFlow: heartbeat deadline exceeded)" in line
    assert line.endswith("set fault_tolerance.backup_dir to resume where it stopped instead of from the start.")


def test_only_tensorflow_peer_errors_count_as_lost_peers() -> None:
    class UnavailableError(Exception):
        pass

    assert _lost_peer.is_lost_peer_error(UnavailableError(UNHEALTHY))
    assert not _lost_peer.is_lost_peer_error(UnavailableError("file system unavailable"))
    assert not _lost_peer.is_lost_peer_error(RuntimeError(UNHEALTHY))


def test_excepthook_turns_an_uncaught_lost_peer_error_into_one_line_exit_75() -> None:
    code = ("import keras_sync.training.excepthook as h\nh.install()\n"
            "class UnavailableError(Exception): pass\n"
            f"raise UnavailableError({UNHEALTHY!r})\n")
    env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}})}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == PeerLostError.exit_code == 75
    assert r.stderr == ("keras-sync: /job:worker/task:0 lost contact with /job:worker/task:1 (10.203.7.2:20000): the "
                        "worker stopped, or its host or the network failed (TensorFlow: stopped sending heartbeats). "
                        "Relaunch every worker to continue; with fault_tolerance.backup_dir set it resumes from the "
                        "last backup.\n")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**env, "KERAS_SYNC_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback" in shown.stderr and "unhealthy" in shown.stderr


# -- one process, real training ------------------------------------------------------------------


def _train(tmp: Path, name: str, *extra: str, backup: bool = True, mlflow_uri: str | None = None,
           accumulate: int = 1, job_id: str | None = None) -> subprocess.CompletedProcess[str]:
    mlflow = ({"tracking_uri": mlflow_uri, "experiment": "preempted", "log_every_n_steps": 1, "spool_dir": str(tmp / "spool")}
              if mlflow_uri else {"enabled": False})
    cfg: dict = {"strategy": {"kind": "default"}, "batch": {"global": 32}, "mlflow": mlflow,
                 "learning_rate": {"base": 0.01}, "runtime": {"gradient_accumulation_steps": accumulate}}
    if backup:
        cfg["fault_tolerance"] = {"backup_dir": str(tmp / f"{name}_backup"), "save_freq": "epoch"}
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "KERAS_SYNC_JOB_ID")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if job_id is not None:
        env["KERAS_SYNC_JOB_ID"] = job_id
    return subprocess.run([sys.executable, str(TRAIN), json.dumps(cfg), str(tmp / name), "--epochs", str(EPOCHS),
                           "--samples", str(SAMPLES), *extra], env=env, capture_output=True, text=True, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_at_step_17_saves_there_and_the_relaunch_trains_the_13_left(tmp_path: Path) -> None:
    ref = _train(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    term = ("--term-at", "17", "--marker", str(tmp_path / "term.marker"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = time.monotonic()
    # Each try has its own job id, as two `keras-sync launch` commands give: the backup names the run.
    first = _train(tmp_path, "res", *term, mlflow_uri=uri, job_id="launch-first")
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    assert time.monotonic() - start < 200  # the whole process; the save itself is below
    assert first.stdout.splitlines()[-1] == "sigterm before step 17"
    # The line, not the last one: the exit's MLflow close may warn after it on a busy machine.
    assert (
        f"keras-sync: SIGTERM: saved a backup in {tmp_path / 'res_backup'} at epoch 2, after batch 7 (optimizer "
        "step 17); exiting with code 143. Relaunch the job to resume from there.\n") in first.stderr
    second = _train(tmp_path, "res", *term, mlflow_uri=uri, job_id="launch-second")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "refused param" not in first.stderr + second.stderr, second.stderr[-3000:]
    # The preempted exit ends the run KILLED, not FINISHED, so the relaunch continues it: one run,
    # each step once (a FINISHED run would not be reopened: a second run). What the first process
    # had not delivered at exit (a busy machine) is delivered by the relaunch's courier, in order.
    # What the relaunch had not delivered when it exited (the wait at exit is bounded): delivered
    # now, as `keras-sync sync-spool` does for a user.
    deliver_leftovers(tmp_path / "spool")
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("preempted").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 31))
    assert run.data.params["config.fault_tolerance.save_freq"] == "epoch"  # the config's params, once
    assert "config.mlflow.job_id" not in run.data.params
    trained = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert trained[0] == "step 18 epoch 1 batch 7" and len(trained) == 13
    a, b = (json.loads((tmp_path / n / "w0.json").read_text()) for n in ("ref", "res"))
    assert b["start"] == {"iterations": 17, "epoch": 1}
    diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a["weights"], b["weights"]))
    assert diff <= 1e-6
    assert not (tmp_path / "res_backup").exists()  # deleted when training ended


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_without_backup_dir_ends_the_process_at_once(tmp_path: Path) -> None:
    r = _train(tmp_path, "plain", "--term-at", "17", "--marker", str(tmp_path / "m"), backup=False)
    assert r.returncode == -signal.SIGTERM
    assert r.stdout.splitlines()[-1] == "sigterm before step 17"


def _weights_diff(tmp: Path, a: str, b: str) -> float:
    x, y = (json.loads((tmp / n / "w0.json").read_text()) for n in (a, b))
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(x["weights"], y["weights"]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backups_wait_for_the_accumulated_update_so_sigterm_and_sigkill_resume_exactly(tmp_path: Path) -> None:
    # Gradient accumulation 3 over 10-batch epochs: the optimizer updates after micro-batches 3, 6,
    # 9, 12, ... The sums are not in the backup, so each save waits for an update: epoch 1 ends
    # after micro-batch 10, its backup is taken after 12 (epoch 2, batch 2); epoch 2's after 21.
    ref = _train(tmp_path, "ref", accumulate=3)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # SIGTERM before update 5 (micro-batch 13): saved after micro-batch 15, the update, not 13.
    term = ("--term-at", "5", "--marker", str(tmp_path / "term.marker"))
    first = _train(tmp_path, "term", *term, accumulate=3)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    assert (f"keras-sync: SIGTERM: saved a backup in {tmp_path / 'term_backup'} at epoch 2, after batch 5 "
            "(optimizer step 5); exiting with code 143.") in first.stderr
    second = _train(tmp_path, "term", *term, accumulate=3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((tmp_path / "term" / "w0.json").read_text())["start"] == {"iterations": 5, "epoch": 1}
    assert _weights_diff(tmp_path, "ref", "term") <= 1e-6
    # SIGKILL at update 8 (micro-batch 24): the last backup is epoch 2's, taken after micro-batch 21.
    kill = ("--kill-at", "8", "--marker", str(tmp_path / "kill.marker"))
    killed = _train(tmp_path, "kill", *kill, accumulate=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _train(tmp_path, "kill", *kill, accumulate=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "kill" / "w0.json").read_text())["start"] == {"iterations": 7, "epoch": 2}
    assert _weights_diff(tmp_path, "ref", "kill") <= 1e-6
