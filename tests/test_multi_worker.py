"""Multi-worker training through `keras-sync launch`: real worker processes on 127.0.0.1.

One process vs 2 workers x 2 simulated replicas give the same weights; a failing
worker ends the launch; a missing worker fails with its address; a SIGKILLed worker (chief or
not) and a relaunch give the weights of an uninterrupted run, mid-epoch included.
Scripts: tests/_mwr_train.py, tests/_mwr_fail.py and examples/multi_worker.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _mwr import max_diff, result
from _ports import free_ports
from _spools import deliver_leftovers

pytestmark = (
    pytest.mark.slow
)  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`

HERE = Path(__file__).parent
TRAIN = HERE / "_mwr_train.py"
FAIL = HERE / "_mwr_fail.py"
EXAMPLE = HERE.parent / "examples" / "multi_worker.py"
KERAS_SYNC = Path(sys.executable).with_name("keras-sync")  # the real console script of this venv
SAME_AS_ONE_PROCESS = 1e-5
EXACT_RESUME = 1e-6
STEPS_PER_EPOCH = 8  # 256 samples / global batch 32


def _config(
    mlflow_uri: str | None = None, runtime: dict | None = None, **fault_tolerance: object
) -> str:
    cfg = {
        "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 60},
        "batch": {"global": 32},
        "learning_rate": {"base": 0.01, "base_batch_size": 32},  # same rate for 1 or 2 workers
        "mlflow": {"enabled": False},
    }
    if mlflow_uri:
        cfg["mlflow"] = {
            "enabled": True,
            "tracking_uri": mlflow_uri,
            "experiment": "resume",
            "log_every_n_steps": 1,
        }
    if fault_tolerance:
        cfg["fault_tolerance"] = fault_tolerance
    if runtime:
        cfg["runtime"] = runtime
    return json.dumps(cfg)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _launch(
    tmp: Path, script: Path, *args: str, workers: int = 2, timeout: float = 150, grace: float = 2.0
) -> subprocess.CompletedProcess[str]:
    cmd = [
        str(KERAS_SYNC),
        "launch",
        "--workers",
        str(workers),
        "--grace-period",
        str(grace),
        str(script),
        *args,
    ]
    return subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=timeout)


def _alone(
    tmp: Path, script: Path, *args: str, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def two_workers(tmp_module: Path) -> dict:
    """An uninterrupted 2-worker run: the reference for every resume test."""
    r = _launch(tmp_module, TRAIN, _config(), str(tmp_module / "two"))
    assert r.returncode == 0, r.stderr[-3000:]
    return {"w0": result(tmp_module / "two", 0), "w1": result(tmp_module / "two", 1)}


@pytest.mark.timeout(
    900
)  # two TF workers twice plus an MLflow import: 200 s was exceeded at load ~30
def test_two_workers_via_console_script_train_every_step_on_both(two_workers: dict) -> None:
    # That workers train as one process does (the same weights) is the next test's, with 2 replicas in
    # each worker and in the one process: a reference fit of its own here proved it a second time.
    for w in ("w0", "w1"):
        assert two_workers[w]["num_workers"] == 2 and two_workers[w]["num_replicas"] == 2
        assert two_workers[w]["iterations"] == 4 * STEPS_PER_EPOCH
    assert (
        max_diff(two_workers["w0"]["weights"], two_workers["w1"]["weights"]) <= EXACT_RESUME
    )  # one model, mirrored


@pytest.mark.timeout(
    900
)  # two TF workers twice plus an MLflow import: 200 s was exceeded at load ~30
def test_example_two_workers_times_two_simulated_replicas_give_four(tmp_path: Path) -> None:
    alone = _alone(tmp_path, EXAMPLE, "--epochs", "1", "--out", "one.json")
    assert alone.returncode == 0, alone.stderr[-3000:]
    launched = _launch(tmp_path, EXAMPLE, "--epochs", "1", "--out", "four.json")
    assert launched.returncode == 0, launched.stderr[-3000:]
    one, four = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "four.json"))
    assert (one["workers"], one["replicas"]) == (
        1,
        2,
    )  # multi_worker_mirrored without TF_CONFIG: one worker
    assert (four["workers"], four["replicas"]) == (2, 4)
    assert "[w0] strategy=multi_worker_mirrored workers=2 replicas=4" in launched.stdout
    # The example asks for verbose=2 on every worker: one job, one progress report (the chief's).
    progress = [line for line in launched.stdout.splitlines() if "/step - loss:" in line]
    assert progress and all(line.startswith("[w0] ") for line in progress), launched.stdout[-2000:]
    assert max_diff(four["weights"], one["weights"]) <= SAME_AS_ONE_PROCESS
    assert not (tmp_path / "keras_sync_backup").exists()  # the backup is deleted when training ends


@pytest.mark.timeout(120)
def test_failing_worker_stops_launch_within_seconds_and_leaves_no_process(tmp_path: Path) -> None:
    r = _launch(tmp_path, FAIL, timeout=100)
    ended = time.time()
    assert r.returncode == 1, r.stderr[-3000:]
    failed_at = float(re.search(r"\[w1\] failing at ([\d.]+)", r.stdout).group(1))
    # The message below proves the launcher stopped the peer; this bound only says "not waiting for
    # TensorFlow's collectives" (which ignore SIGTERM) and is wide: this machine stalls for seconds.
    assert ended - failed_at < 60, f"launch ended {ended - failed_at:.1f} s after the failure"
    assert "[launch] w1 exited with code 1; stopping the other 1 worker(s)" in r.stderr
    pids = [int(p) for p in re.findall(r"\[w\d\] pid (\d+)", r.stdout)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _listening(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(480)
def test_worker_alone_fails_after_connect_timeout_naming_missing_task_and_address(
    tmp_path: Path,
) -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = _env()
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": 0}}
    )
    cfg = json.loads(_config())
    cfg["strategy"]["connect_timeout_s"] = 10
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), json.dumps(cfg), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Clock the wait from when worker 0's server listens (the TensorFlow import before it takes
    # 4 s to minutes on this shared machine), polling rather than sleeping a guessed time.
    while proc.poll() is None and not _listening(addrs[0]):
        time.sleep(0.1)
    listening = time.monotonic()
    stdout, stderr = proc.communicate(timeout=400)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    waited, elapsed = time.monotonic() - listening, time.monotonic() - start
    assert r.returncode == 2
    # No Python traceback: keras-sync's excepthook prints one line and exits before TensorFlow's
    # cluster teardown. TensorFlow's own C++ log (on by default) comes before it.
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "keras-sync: Workers did not join the cluster within "
        f"strategy.connect_timeout_s=10 s: missing /job:worker/task:1 ({addrs[1]}). Start them, check their "
        "addresses in TF_CONFIG, or raise strategy.connect_timeout_s."
    )
    assert elapsed >= 10  # it waited for the peer at least connect_timeout_s
    # ...and gave up near it (TensorFlow adds ~5 s), far below the 300 s default: a wide bound
    assert waited < 150, f"failed {waited:.0f} s after listening, expected about 10-15 s"


def _kill_and_resume(
    tmp: Path,
    name: str,
    *,
    save_freq: object,
    kills: list[tuple[int, int]],
    mlflow_uri: str | None = None,
    runtime: dict | None = None,
) -> dict:
    """Launch the job, SIGKILL task I after step N for each (N, I) of ``kills`` (one per launch), relaunch.

    Returns the last launch's results and the stdout and stderr of every relaunch (``relaunches``).
    """
    out, marker = tmp / name, tmp / f"{name}.killed"
    args = [
        _config(mlflow_uri, runtime, backup_dir=str(tmp / f"{name}_backup"), save_freq=save_freq),
        str(out),
    ]
    for kill_at, kill_task in kills:
        args += ["--kill-at", str(kill_at), "--kill-task", str(kill_task)]
    args += ["--marker", str(marker)]
    relaunches = []
    for k, (_, kill_task) in enumerate(kills):
        killed = _launch(tmp, TRAIN, *args)
        assert Path(f"{marker}.{k}" if k else marker).exists(), killed.stderr[-3000:]
        assert killed.returncode == 137, killed.stderr[-3000:]  # SIGKILL: 128 + 9
        assert f"[launch] w{kill_task} exited with code 137" in killed.stderr
        assert not out.exists()
        if mlflow_uri:  # the chief's courier outlived the kill: it delivered all, ended the run
            assert deliver_leftovers(tmp / ".keras_sync_spool") == []
            assert [run.info.status for run in _runs(mlflow_uri)] == ["FAILED"]
        if k:
            relaunches.append(killed)
    last = _launch(tmp, TRAIN, *args)
    assert last.returncode == 0, last.stderr[-3000:]
    relaunches.append(last)
    for r in relaunches:
        # The chief says once that the job continued; the other worker stays quiet.
        said = re.findall(
            r"^\[w(\d)\] keras-sync: resumed from the backup in .*: epoch \d+, after batch \d+ "
            r"\(optimizer step \d+\)$",
            r.stderr,
            re.M,
        )
        assert said == ["0"], r.stderr[-3000:]
    assert not (tmp / f"{name}_backup").exists()
    return {
        "w0": result(out, 0),
        "w1": result(out, 1),
        "stdout": last.stdout,
        "relaunches": relaunches,
    }


def _runs(uri: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name("resume").experiment_id])


def _assert_exact(resumed: dict, reference: dict, *, epoch: int, iterations: int) -> None:
    for w in ("w0", "w1"):
        r = resumed[w]
        assert r["start"] == {
            "iterations": iterations,
            "epoch": epoch,
        }  # restored before other callbacks ran
        assert r["iterations"] == reference[w]["iterations"]
        assert r["epochs_run"] == list(range(epoch, 4))
        assert max_diff(r["weights"], reference[w]["weights"]) <= EXACT_RESUME
        # The interrupted epoch's mean loss includes the batches trained before the kill.
        assert np.allclose(r["loss"], reference[w]["loss"][epoch:], rtol=1e-5, atol=0)


@pytest.mark.timeout(1200)  # three launches of two TF workers, MLflow in each
def test_sigkill_non_chief_then_chief_mid_epoch_resumes_exactly_each_time(
    tmp_module: Path, two_workers: dict
) -> None:
    # One job, a backup every 3 batches, killed twice (one launch fewer than two jobs killed once):
    # - w1 (not the chief) after step 13: the last backup, step 12, is epoch 1 after 4 of its 8 batches;
    # - on the relaunch, the chief after step 17 (epoch 2, batch 0): the last backup, step 15, is in the
    #   epoch before (after 7 of its 8 batches), so the second relaunch goes back across the epoch end.
    uri = f"sqlite:///{tmp_module / 'kill_twice_mlflow.db'}"
    resumed = _kill_and_resume(
        tmp_module, "kill_twice", save_freq=3, kills=[(13, 1), (17, 0)], mlflow_uri=uri
    )
    first_resume, second_resume = resumed["relaunches"]
    assert re.search(
        r"^\[w0\] keras-sync: resumed from the backup in .*: epoch 2, after batch 4 \(optimizer step 12\)$",
        first_resume.stderr,
        re.M,
    ), first_resume.stderr[-3000:]
    assert re.search(r"^\[w0\] step 13 epoch 1 batch 4$", first_resume.stdout, re.M)
    assert not re.search(r"^\[w0\] step \d+ epoch 1 batch [0-3]$", first_resume.stdout, re.M)
    assert re.search(
        r"^\[w0\] step 17 epoch 2 batch 0$", first_resume.stdout, re.M
    )  # where the chief died
    # Exact after both: the interrupted epoch 1's mean loss includes batches of all three launches.
    _assert_exact(resumed, two_workers, epoch=1, iterations=15)
    assert re.search(r"^\[w0\] step 16 epoch 1 batch 7$", resumed["stdout"], re.M)
    assert not re.search(r"^\[w0\] step \d+ epoch 1 batch [0-6]$", resumed["stdout"], re.M)
    # The MLflow side: each relaunch continues the one run, and steps 13..17, trained twice (after
    # a backup, before a kill), appear once.
    from mlflow import MlflowClient

    runs = _runs(uri)
    assert [run.info.status for run in runs] == ["FINISHED"]  # the FAILED run, continued
    history = MlflowClient(uri).get_metric_history(runs[0].info.run_id, "sync/loss/replica_1")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, resumed["w0"]["iterations"] + 1))


@pytest.mark.timeout(
    900
)  # two TF workers twice plus an MLflow import: 200 s was exceeded at load ~30
def test_sigkill_with_epoch_backups_resumes_exactly(tmp_module: Path, two_workers: dict) -> None:
    # Saved at each epoch end: killed at epoch 2 batch 2, resumes at epoch 2 batch 0.
    resumed = _kill_and_resume(tmp_module, "kill_epoch", save_freq="epoch", kills=[(19, 1)])
    _assert_exact(resumed, two_workers, epoch=2, iterations=16)


@pytest.mark.timeout(
    900
)  # two TF workers twice plus an MLflow import: 200 s was exceeded at load ~30
def test_sigkill_with_steps_per_execution_4_resumes_exactly(
    tmp_module: Path, two_workers: dict
) -> None:
    # keras-team/keras#19246 fixed under multi-worker: 4 steps per execution, a backup every 4 steps,
    # the chief killed after step 20 (epoch 2 after 4 of its 8 batches). The reference trained 1 step
    # per execution: the relaunch ends on the same weights.
    resumed = _kill_and_resume(
        tmp_module, "kill_spe4", save_freq=4, kills=[(20, 0)], runtime={"steps_per_execution": 4}
    )
    _assert_exact(resumed, two_workers, epoch=2, iterations=20)
    # Batches are reported once per execution: the first after the resume is step 24, batch 7.
    steps = re.findall(r"^\[w0\] step (\d+) epoch (\d+) batch (\d+)$", resumed["stdout"], re.M)
    assert steps[0] == ("24", "2", "7") and [int(s) for s, _, _ in steps] == list(range(24, 33, 4))


@pytest.mark.timeout(900)  # three TF workers on 2 shared cores
def test_the_slow_worker_is_named_by_its_own_times_on_the_chief_and_in_the_report(
    tmp_path: Path,
) -> None:
    # Worker 1 sleeps 0.2 s before each of its 40 batches: the job's step time follows it, and the
    # per-worker times say which worker it is. The line's hold is 3 s here (60 s by default).
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = {
        "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
        "batch": {"global": 30},
        "mlflow": {
            "enabled": True,
            "tracking_uri": uri,
            "experiment": "slow",
            "log_every_n_steps": 1,
        },
    }
    r = _launch(
        tmp_path, HERE / "_slow_worker_train.py", json.dumps(cfg), "1", "3", workers=3, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    said = re.findall(
        r"^\[w(\d)\] keras-sync: worker (\d) holds the job back: for \d+ s it took (\d+) ms a step "
        r"to reach the gradient all-reduce \((\d+) ms between steps, compute -?\d+ ms\) against the "
        r"other workers' median of (\d+) ms, and they wait for it\. Its times are "
        r"sync/between_steps_ms/worker_1 and sync/compute_ms/worker_1 in MLflow\.$",
        r.stderr,
        re.M,
    )
    assert len(said) == 1, r.stderr[-3000:]  # once, on the chief only
    chief, worker, took, wait, median = said[0]
    assert (
        (chief, worker) == ("0", "1")
        and int(took) >= 150
        and int(wait) >= 150
        and int(median) < int(took) / 1.5
    )

    from mlflow import MlflowClient

    from keras_sync.tracking.report_plot import SyncHistory

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("slow").experiment_id])
    h = SyncHistory()
    for key in [
        f"sync/{q}/worker_{w}" for q in ("between_steps_ms", "compute_ms") for w in range(3)
    ]:
        points = client.get_metric_history(run.info.run_id, key)
        assert len(points) >= 35, key  # every logged step but the first
        for m in points:
            h.add({key: m.value}, m.step)
    waits = {w: float(np.median(h.between_steps[w].values)) for w in range(3)}
    assert waits[1] >= 150 and max(waits[0], waits[2]) < waits[1] / 3, waits
    worst = h.slowest_worker()  # what the report's summary names
    assert worst is not None and worst[0] == 1, worst
    step_ms = [m.value for m in client.get_metric_history(run.info.run_id, "sync/step_time_ms")]
    assert float(np.median(step_ms)) >= 150


def _worker_history(uri: str, experiment: str, workers: int) -> object:
    """The sync report's history of the workers' times, read back from the run in MLflow."""
    from mlflow import MlflowClient

    from keras_sync.tracking.report_plot import SyncHistory

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    h = SyncHistory()
    for key in [
        f"sync/{q}/worker_{w}" for q in ("between_steps_ms", "compute_ms") for w in range(workers)
    ]:
        for m in client.get_metric_history(run.info.run_id, key):
            h.add({key: m.value}, m.step)
    return h


@pytest.mark.timeout(900)  # two TF workers, twice, on 2 shared cores
@pytest.mark.parametrize("slow_task", [-1, 1], ids=["none_slow", "worker_1_sleeps_0.1s"])
def test_report_names_a_slow_worker_only_above_the_threshold(
    tmp_path: Path, slow_task: int
) -> None:
    # Issue 41 item 7: the report named "slowest worker: 1, 0.152 ms ... median 0.148 ms" on an even run.
    from keras_sync.tracking.report_plot import slow_worker_lines

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = {
        "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
        "batch": {"global": 30},
        "mlflow": {
            "enabled": True,
            "tracking_uri": uri,
            "experiment": "even",
            "log_every_n_steps": 1,
        },
    }
    r = _launch(
        tmp_path,
        HERE / "_slow_worker_train.py",
        json.dumps(cfg),
        str(slow_task),
        "600",
        "0.1",
        workers=2,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = "\n".join(slow_worker_lines(_worker_history(uri, "even", 2)))
    if slow_task < 0:
        assert lines.startswith("no worker is slow: none took over 1.5x"), lines
    else:
        assert lines.startswith("slowest worker: 1, "), lines


@pytest.mark.timeout(600)
def test_the_chief_says_what_it_waits_for_at_exit(tmp_path: Path) -> None:
    # Issue 41 item 3: the workers leave together, and the chief's wait for a late one was silent.
    r = _launch(tmp_path, HERE / "_late_exit_train.py", "6", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    said = re.findall(
        r"^\[w(\d)\] keras-sync: waiting for worker 1 to finish its script \(the workers leave together; "
        r"closing TensorFlow's input pipeline can take seconds\)$",
        r.stderr,
        re.M,
    )
    assert said == ["0"], r.stderr[-3000:]  # once, on the chief only
