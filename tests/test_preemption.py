"""SIGTERM under fault_tolerance.backup_dir: save a backup here, exit 143, resume exactly.

The 2-worker case (SIGTERM to one host's worker inside a collective) is in tests/test_two_hosts.py;
lost-peer lines are tested here as pure functions and end to end in tests/test_two_hosts.py.
"""

from __future__ import annotations

import contextlib
import doctest
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _spools import deliver_leftovers

from keras_sync import load_config
from keras_sync.cluster import lost_peer as _lost_peer
from keras_sync.cluster.preemption import PREEMPTED_EXIT_CODE
from keras_sync.errors import ConfigError, PeerLostError, UsageError

TRAIN = Path(__file__).with_name("_mwr_train.py")
KERAS_SYNC = Path(sys.executable).with_name("keras-sync")  # the real console script of this venv
EPOCHS, SAMPLES = 3, 320  # 10 steps per epoch at global batch 32


def test_grace_period_defaults_to_25_s_and_must_be_positive() -> None:
    assert load_config({}).fault_tolerance.grace_period_s == 25.0
    assert (
        load_config({"fault_tolerance": {"grace_period_s": 55}}).fault_tolerance.grace_period_s
        == 55.0
    )
    with pytest.raises(
        ConfigError,
        match=r"<dict>: fault_tolerance\.grace_period_s: received 0, expected a number > 0",
    ):
        load_config({"fault_tolerance": {"grace_period_s": 0}})


@pytest.mark.parametrize("bad", [0, -1, "25", True])
def test_backup_callback_rejects_bad_grace_period(bad: object) -> None:
    from keras_sync.callbacks.backup import BackupAndRestore

    with pytest.raises(UsageError) as e:
        BackupAndRestore("/tmp/x", grace_period_s=bad)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"Invalid value for argument `grace_period_s`. Received: grace_period_s={bad!r}. "
        "Expected a number of seconds > 0, or None to leave SIGTERM alone."
    )


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )


def test_preemption_saver_records_sigterm_and_sigint_and_gives_them_back() -> None:
    r = _python(
        "import os, signal, time\n"
        "from keras_sync.cluster.preemption import PreemptionSaver\n"
        "for sig in (signal.SIGTERM, signal.SIGINT):\n"
        "    w = PreemptionSaver(30)\n"
        "    assert w.install()\n"
        "    os.kill(os.getpid(), sig); time.sleep(0.2)\n"
        "    print('pending', w.pending, w.signum == sig)\n"
        "    w.done(); w.uninstall()\n"
        "print('handlers restored', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,\n"
        "      signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('not reached')\n"
    )
    assert r.stdout.split("\n")[:3] == [
        "pending True True",
        "pending True True",
        "handlers restored True True",
    ]
    assert r.returncode == -signal.SIGTERM


def test_watchdog_exits_143_with_a_line_when_no_save_comes_within_the_grace() -> None:
    start = time.monotonic()
    r = _python(
        "import os, signal, threading\n"
        "from keras_sync.cluster.preemption import PreemptionSaver\n"
        "PreemptionSaver(1.5).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "threading.Event().wait(60)  # a main thread that never reaches the save\n"
    )
    assert r.returncode == PREEMPTED_EXIT_CODE
    assert 1.5 <= time.monotonic() - start < 30
    assert r.stderr == (
        "keras-sync: SIGTERM: no backup could be saved within fault_tolerance.grace_period_s=1.5 s; "
        "exiting without it. Relaunch the job to resume from the last backup.\n"
    )


def test_a_second_ctrl_c_exits_130_at_once_while_the_first_waits_for_its_save() -> None:
    # The main thread never returns to Python (as inside a TensorFlow call): the watchdog thread,
    # woken by the signal itself, ends the process on the second Ctrl-C, long before the grace.
    r = _python(
        "import os, signal, threading, time\n"
        "from keras_sync.cluster.preemption import PreemptionSaver\n"
        "PreemptionSaver(600).install()\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.3)\n"
        "print('first Ctrl-C recorded', flush=True)\n"
        "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "threading.Event().wait(300)\n",
        timeout=120,
    )
    assert r.returncode == 130, r.stderr
    assert r.stdout == "first Ctrl-C recorded\n"
    assert r.stderr == "keras-sync: Ctrl-C again: exiting at once, without a backup at this step\n"


def test_ctrl_c_out_of_fit_without_a_backup_is_one_line_and_a_second_one_skips_the_exit_wait() -> (
    None
):
    # An exit hook that waits (as the MLflow delivery at exit does): the second Ctrl-C ends it at once.
    code = (
        "import atexit, threading\n"
        "from keras_sync.cluster.preemption import ctrl_c_ends_fit\n"
        "atexit.register(lambda: (print('exit waits', flush=True), threading.Event().wait(300)))\n"
        "with ctrl_c_ends_fit(None, is_chief=True, backup_dir=None):\n"
        "    raise KeyboardInterrupt\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "exit waits\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err == (
        "keras-sync: Ctrl-C: training stopped; exiting with code 130. Set fault_tolerance.backup_dir to "
        "save a backup where Ctrl-C stops and resume there.\n"
        "keras-sync: Ctrl-C again: exiting at once, without a backup at this step\n"
    )


def test_ctrl_c_out_of_fit_with_a_backup_dir_names_where_the_relaunch_resumes() -> None:
    code = (
        "from keras_sync.cluster.preemption import ctrl_c_ends_fit\n"
        "with ctrl_c_ends_fit(None, is_chief=True, backup_dir='/bk'):\n"
        "    raise KeyboardInterrupt\n"
    )
    r = _python(code)
    assert r.returncode == 130
    assert r.stderr == (
        "keras-sync: Ctrl-C: training stopped before keras-sync could save a backup at this step; "
        "exiting with code 130. A relaunch resumes from the newest backup in /bk, if there is one.\n"
    )
    worker = _python(code.replace("is_chief=True", "is_chief=False"))
    assert (worker.returncode, worker.stderr) == (130, "")  # one line per job: the chief's


def test_lost_peer_doctests_pass() -> None:
    assert doctest.testmod(_lost_peer).failed == 0


CLUSTER = {"worker": ["10.203.7.1:20000", "10.203.7.2:20000"]}
UNHEALTHY = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed."
)


def test_lost_peer_line_names_task_address_reason_and_resume() -> None:
    assert _lost_peer.lost_peer_message(
        UNHEALTHY, CLUSTER, ("worker", 0), backup_dir="/shared/bk"
    ) == (
        "/job:worker/task:0 lost contact with /job:worker/task:1 (10.203.7.2:20000): the worker stopped, or its host "
        "or the network failed (TensorFlow: stopped sending heartbeats). Relaunch every worker to continue; with "
        "fault_tolerance.backup_dir=/shared/bk it resumes from the last backup."
    )


def test_isolated_worker_names_the_coordination_service_host() -> None:
    line = _lost_peer.lost_peer_message(
        "Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat",
        {"chief": ["10.0.0.9:1"], "worker": ["10.0.0.1:1", "10.0.0.2:1"]},
        ("worker", 1),
        backup_dir=None,
    )
    assert line.startswith("/job:worker/task:1 lost contact with /job:chief/task:0 (10.0.0.9:1): ")
    assert "(TensorFlow: heartbeat deadline exceeded)" in line
    assert line.endswith(
        "set fault_tolerance.backup_dir to resume where it stopped instead of from the start."
    )


def test_only_tensorflow_peer_errors_count_as_lost_peers() -> None:
    class UnavailableError(Exception):
        pass

    assert _lost_peer.is_lost_peer_error(UnavailableError(UNHEALTHY))
    assert not _lost_peer.is_lost_peer_error(UnavailableError("file system unavailable"))
    assert not _lost_peer.is_lost_peer_error(RuntimeError(UNHEALTHY))


def test_a_peer_failing_its_preconditions_after_a_foreign_request_is_a_lost_peer() -> None:
    # A client from any host can run ops on a worker (TensorFlow's server has no authentication); the
    # worker it disturbed then fails its peers' calls instead of answering them.
    class FailedPreconditionError(Exception):
        pass

    text = (
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
        "/tensorflow.WorkerService/CompleteInstance: Device incarnation mismatch"
    )
    assert _lost_peer.is_lost_peer_error(FailedPreconditionError(text))
    assert _lost_peer.lost_peer_message(text, CLUSTER, ("worker", 1)).startswith(
        "/job:worker/task:1 lost contact with /job:worker/task:0 (10.203.7.1:20000): "
    )
    assert not _lost_peer.is_lost_peer_error(
        FailedPreconditionError("Attempting to use uninitialized value w")
    )


def test_an_uncaught_lost_peer_error_out_of_a_keras_sync_call_is_one_line_exit_75() -> None:
    # sync.fit/evaluate/predict run Keras inside raised_as_peer_lost; no sys.excepthook is involved.
    code = (
        "import sys\nfrom keras_sync.cluster.lost_peer import raised_as_peer_lost\n"
        "class UnavailableError(Exception): pass\n"
        "with raised_as_peer_lost(None, None):\n"
        f"    raise UnavailableError({UNHEALTHY!r})\n"
    )
    env = {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}}),
    }
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == PeerLostError.exit_code == 75
    assert r.stderr == (
        "keras-sync: /job:worker/task:0 lost contact with /job:worker/task:1 (10.203.7.2:20000): the "
        "worker stopped, or its host or the network failed (TensorFlow: stopped sending heartbeats). "
        "Relaunch every worker to continue; with fault_tolerance.backup_dir set it resumes from the "
        "last backup.\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "KERAS_SYNC_TRACEBACK": "1"},
    )
    assert shown.returncode == 1 and "Traceback" in shown.stderr and "unhealthy" in shown.stderr


# -- one process, real training ------------------------------------------------------------------


def _command(
    tmp: Path,
    name: str,
    *extra: str,
    backup: bool = True,
    mlflow_uri: str | None = None,
    accumulate: int = 1,
    job_id: str | None = None,
    workers: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one training run: alone, or under `keras-sync launch -n workers`."""
    mlflow = (
        {
            "tracking_uri": mlflow_uri,
            "experiment": "preempted",
            "log_every_n_steps": 1,
            "spool_dir": str(tmp / "spool"),
        }
        if mlflow_uri
        else {"enabled": False}
    )
    strategy = (
        {"kind": "multi_worker_mirrored", "connect_timeout_s": 120}
        if workers
        else {"kind": "default"}
    )
    cfg: dict = {
        "strategy": strategy,
        "batch": {"global": 32},
        "mlflow": mlflow,
        "learning_rate": {"base": 0.01, "base_batch_size": 32},
        "runtime": {"gradient_accumulation_steps": accumulate},
    }
    if backup:
        cfg["fault_tolerance"] = {"backup_dir": str(tmp / f"{name}_backup"), "save_freq": "epoch"}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "KERAS_SYNC_JOB_ID")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if job_id is not None:
        env["KERAS_SYNC_JOB_ID"] = job_id
    script = [
        str(TRAIN),
        json.dumps(cfg),
        str(tmp / name),
        "--epochs",
        str(EPOCHS),
        "--samples",
        str(SAMPLES),
        *extra,
    ]
    if workers:
        return [
            str(KERAS_SYNC),
            "launch",
            "-n",
            str(workers),
            "--grace-period",
            "120",
            *script,
        ], env
    return [sys.executable, *script], env


def _train(tmp: Path, name: str, *extra: str, **options: Any) -> subprocess.CompletedProcess[str]:
    cmd, env = _command(tmp, name, *extra, **options)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def reference(tmp_module: Path) -> Path:
    """One uninterrupted fit in one process (3 epochs of 10 steps): what every resume must equal."""
    ref = _train(tmp_module, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return tmp_module


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_at_step_17_saves_there_and_the_relaunch_trains_the_13_left(
    tmp_path: Path, reference: Path
) -> None:
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
        "step 17); exiting with code 143. Relaunch the job to resume from there.\n"
    ) in first.stderr
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
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(
        range(1, 31)
    )
    assert (
        run.data.params["config.fault_tolerance.save_freq"] == "epoch"
    )  # the config's params, once
    assert "config.mlflow.job_id" not in run.data.params
    trained = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert trained[0] == "step 18 epoch 1 batch 7" and len(trained) == 13
    a, b = (json.loads((d / "w0.json").read_text()) for d in (reference / "ref", tmp_path / "res"))
    assert b["start"] == {"iterations": 17, "epoch": 1}
    diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(a["weights"], b["weights"])
    )
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
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(x["weights"], y["weights"])
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backups_wait_for_the_accumulated_update_so_sigterm_and_sigkill_resume_exactly(
    tmp_path: Path,
) -> None:
    # Gradient accumulation 3 over 10-batch epochs: the optimizer updates after micro-batches 3, 6,
    # 9, 12, ... The sums are not in the backup, so each save waits for an update: epoch 1 ends
    # after micro-batch 10, its backup is taken after 12 (epoch 2, batch 2); epoch 2's after 21.
    ref = _train(tmp_path, "ref", accumulate=3)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # SIGTERM before update 5 (micro-batch 13): saved after micro-batch 15, the update, not 13.
    term = ("--term-at", "5", "--marker", str(tmp_path / "term.marker"))
    first = _train(tmp_path, "term", *term, accumulate=3)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    assert (
        f"keras-sync: SIGTERM: saved a backup in {tmp_path / 'term_backup'} at epoch 2, after batch 5 "
        "(optimizer step 5); exiting with code 143."
    ) in first.stderr
    second = _train(tmp_path, "term", *term, accumulate=3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((tmp_path / "term" / "w0.json").read_text())["start"] == {
        "iterations": 5,
        "epoch": 1,
    }
    assert _weights_diff(tmp_path, "ref", "term") <= 1e-6
    # SIGKILL at update 8 (micro-batch 24): the last backup is epoch 2's, taken after micro-batch 21.
    kill = ("--kill-at", "8", "--marker", str(tmp_path / "kill.marker"))
    killed = _train(tmp_path, "kill", *kill, accumulate=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _train(tmp_path, "kill", *kill, accumulate=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "kill" / "w0.json").read_text())["start"] == {
        "iterations": 7,
        "epoch": 2,
    }
    assert _weights_diff(tmp_path, "ref", "kill") <= 1e-6


# -- Ctrl-C: a person stopping the job -----------------------------------------------------------


class Running:
    """A training command started in a session of its own, as a terminal's foreground job; output to files."""

    def __init__(self, tmp: Path, name: str, cmd: list[str], env: dict[str, str]):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_for_lines(self, lines: set[str], limit_s: float = 600) -> None:
        deadline = time.monotonic() + limit_s
        while not lines <= set(self.out.read_text().splitlines()):
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            assert time.monotonic() < deadline, self.out.read_text()[-3000:]
            time.sleep(0.1)

    def ctrl_c(self) -> None:
        os.killpg(
            self.proc.pid, signal.SIGINT
        )  # what a terminal sends its foreground process group

    def finish(self, limit_s: float = 300) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout=limit_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return code, self.out.read_text(), self.err.read_text()


def _per_worker(text: str, last: int = 30) -> str:
    """The last lines of each prefix (``[launch]``, ``[w0]``, ``[w1]``): a failure shows every worker."""
    lines: dict[str, list[str]] = {}
    for line in text.splitlines():
        lines.setdefault(line.partition(" ")[0], []).append(line)
    return "\n".join(line for kept in lines.values() for line in kept[-last:])


def _run_status(uri: str) -> tuple[str, list[int]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("preempted").experiment_id])
    return run.info.status, [m.step for m in client.get_metric_history(run.info.run_id, "loss")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_mid_fit_saves_at_the_step_exits_130_in_one_line_and_the_relaunch_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    hold = ("--hold-at", "17", "--marker", str(tmp_path / "held"))
    first = Running(
        tmp_path, "first", *_command(tmp_path, "res", *hold, mlflow_uri=uri, job_id="ctrl-c-first")
    )
    first.wait_for_lines({"holding after step 17"})
    first.ctrl_c()
    code, _, err = first.finish()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # Held after step 17 (its batch end saw no signal yet): the save comes at the next batch end.
    assert [line for line in err.splitlines() if "Ctrl-C" in line and "sync-spool" not in line] == [
        f"keras-sync: Ctrl-C: saved a backup in {tmp_path / 'res_backup'} at epoch 2, after batch 8 (optimizer step "
        "18); exiting with code 130. Relaunch the job to resume from there."
    ], err[-3000:]
    assert _run_status(uri)[0] == "KILLED"
    second = _train(tmp_path, "res", *hold, mlflow_uri=uri, job_id="ctrl-c-second")
    assert second.returncode == 0, second.stderr[-3000:]
    deliver_leftovers(tmp_path / "spool")
    assert _run_status(uri) == ("FINISHED", list(range(1, 31)))
    resumed = json.loads((tmp_path / "res" / "w0.json").read_text())
    assert resumed["start"] == {"iterations": 18, "epoch": 1}
    assert resumed["signals_restored"]  # the handlers lived as long as fit, no longer
    assert _weights_diff(tmp_path, str(reference / "ref"), "res") == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_without_backup_dir_is_one_line_and_exit_130(tmp_path: Path) -> None:
    hold = ("--hold-at", "3", "--marker", str(tmp_path / "held"))
    run = Running(tmp_path, "plain", *_command(tmp_path, "plain", *hold, backup=False))
    run.wait_for_lines({"holding after step 3"})
    run.ctrl_c()
    code, _, err = run.finish()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [line for line in err.splitlines() if "Ctrl-C" in line] == [
        "keras-sync: Ctrl-C: training stopped at optimizer step 3; exiting with code 130. Set "
        "fault_tolerance.backup_dir to save a backup where Ctrl-C stops and resume there."
    ], err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three launches of two TensorFlow workers on 2 shared cores
def test_ctrl_c_to_launch_saves_on_both_workers_in_one_line_each_side_and_the_relaunch_resumes_exactly(
    tmp_path: Path,
) -> None:
    ref = _train(tmp_path, "ref2", workers=2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    hold = ("--hold-at", "12", "--marker", str(tmp_path / "held"))
    first = Running(
        tmp_path, "first", *_command(tmp_path, "res2", *hold, mlflow_uri=uri, workers=2)
    )
    first.wait_for_lines({"[w0] holding after step 12", "[w1] holding after step 12"})
    first.ctrl_c()
    code, out, err = first.finish()
    why = f"{_per_worker(out)}\n{_per_worker(err)}"
    assert code == 130, why
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, why
    # Both held after step 12: the first to see its Ctrl-C at a batch end (13) announces step 14 to all.
    # The launcher says it stops the job, the chief what it saved; worker 1 says nothing.
    assert [line for line in err.splitlines() if "Ctrl-C" in line and "sync-spool" not in line] == [
        "[launch] Ctrl-C: stopping 2 worker(s); Ctrl-C again to kill them at once",
        f"[w0] keras-sync: Ctrl-C: saved a backup in {tmp_path / 'res2_backup'} at epoch 2, after batch 4 (optimizer "
        "step 14); exiting with code 130. Relaunch the job to resume from there.",
    ], why
    assert not [line for line in err.splitlines() if line.startswith("[w1] keras-sync:")], why
    assert _run_status(uri)[0] == "KILLED"
    second = _train(tmp_path, "res2", *hold, mlflow_uri=uri, workers=2)
    assert second.returncode == 0, _per_worker(second.stderr)
    deliver_leftovers(tmp_path / "spool")
    assert _run_status(uri) == ("FINISHED", list(range(1, 31)))
    for task in (0, 1):
        a, b = (json.loads((tmp_path / n / f"w{task}.json").read_text()) for n in ("ref2", "res2"))
        assert b["start"] == {"iterations": 14, "epoch": 1}
        assert (
            max(
                float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                for x, y in zip(a["weights"], b["weights"])
            )
            == 0.0
        )
