"""The local launcher, with real worker processes (tiny Python scripts, no TensorFlow)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _spools import deliver_leftovers

from keras_sync.errors import UsageError
from keras_sync.launch import launch, worker_tf_configs

pytestmark = (
    pytest.mark.slow
)  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`

WORKER = str(Path(__file__).with_name("_launch_worker.py"))
ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by init) is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _pids(folder: Path, workers: int) -> list[int]:
    return [
        int((folder / f"w{i}.{kind}").read_text())
        for i in range(workers)
        for kind in ("pid", "child")
    ]


def _wait_for_pids(folder: Path, workers: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return _pids(folder, workers)
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError(f"workers did not start: {sorted(os.listdir(folder))}")


def _assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 3.0  # SIGKILLed children may take a moment to vanish
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keras_sync.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_each_worker_gets_its_own_tf_config_and_prefixed_output(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("strategy: auto\n")
    proc = _run_cli("--workers", "3", "--config", str(config), WORKER, "print", "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    reports = {}
    for line in proc.stdout.splitlines():
        prefix, _, payload = line.partition(" ")
        reports[prefix] = json.loads(payload)
    assert sorted(reports) == ["[w0]", "[w1]", "[w2]"]
    clusters = {json.dumps(r["tf_config"]["cluster"]) for r in reports.values()}
    assert len(clusters) == 1
    workers = reports["[w0]"]["tf_config"]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(
        w.startswith("127.0.0.1:") and int(w.split(":")[1]) > 0 for w in workers
    )
    for i in range(3):
        r = reports[f"[w{i}]"]
        assert r["tf_config"]["task"] == {"type": "worker", "index": i}
        assert r["config"] == str(config.resolve())
        assert r["unbuffered"] == "1"
        assert r["argv"] == ["--lr", "0.1"]
    assert sorted(proc.stderr.splitlines()) == [
        "[w0] stderr of 0",
        "[w1] stderr of 1",
        "[w2] stderr of 2",
    ]


def test_worker_tf_configs_share_cluster() -> None:
    configs = [json.loads(c) for c in worker_tf_configs([1234, 5678])]
    assert configs[1] == {
        "cluster": {"worker": ["127.0.0.1:1234", "127.0.0.1:5678"]},
        "task": {"type": "worker", "index": 1},
    }
    assert configs[0]["cluster"] == configs[1]["cluster"]


def test_inherited_tf_config_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["elsewhere:1"]}, "task": {"type": "worker", "index": 0}}',
    )
    assert launch(WORKER, ["print"], workers=1, env={"EXTRA": "1"}) == 0
    report = json.loads(capsys.readouterr().out.partition(" ")[2])
    assert report["tf_config"]["cluster"]["worker"][0].startswith("127.0.0.1:")


def test_failed_worker_stops_the_others_and_its_code_is_returned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    code = launch(WORKER, ["fail-or-hang", str(tmp_path)], workers=2, grace_period_s=0.5)
    elapsed = time.monotonic() - start
    assert code == 3
    # w0 hangs for ever and ignores SIGTERM: returning at all means launch killed it. The bound only
    # turns a launcher that waits for ever into a failure before pytest's timeout; a busy machine
    # stalls for seconds, so it is far wider than the 0.5 s grace period.
    assert elapsed < 120, elapsed
    _assert_all_gone(_pids(tmp_path, 2))
    err = capsys.readouterr().err
    assert "[launch] w1 exited with code 3; stopping the other 1 worker(s)" in err
    assert "sending SIGKILL" in err  # w0 ignores SIGTERM


def test_workers_that_end_between_two_polls_are_all_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Seen under load in CI: the chief was SIGKILLed and its peer ended before the launcher's next
    # look, so no worker was left to stop and the launcher used to say nothing about either.
    from keras_sync import launch as launch_module

    class Ended:
        def __init__(self, code: int) -> None:
            self.returncode = code

        def poll(self) -> int:
            return self.returncode

    code, failed = launch_module._supervise([Ended(-9), Ended(1)], [], grace_period_s=1.0)
    assert (code, failed) == (137, 0)
    assert (
        "[launch] w0 exited with code 137; w1 exited too, with code 1\n" in capsys.readouterr().err
    )


def test_sigint_to_launcher_stops_all_workers(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_sync.launch",
            "--workers",
            "2",
            "--grace-period",
            "1",
            WORKER,
            "hang",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err
    assert "[launch] Ctrl-C: stopping 2 worker(s); Ctrl-C again to kill them at once\n" in err
    assert "[w0] KeyboardInterrupt" in err  # w0 got the forwarded SIGINT
    _assert_all_gone(pids)


def test_sigterm_to_launcher_stops_all_workers(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_sync.launch",
            "--workers",
            "2",
            "--grace-period",
            "0.5",
            WORKER,
            "hang",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2)
        launcher.terminate()
        launcher.wait(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    _assert_all_gone(pids)


def test_all_workers_succeed_returns_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(WORKER, ["print"], workers=2, grace_period_s=0) == 0


def test_cli_rejects_zero_workers_with_clicks_usage_error() -> None:
    proc = _run_cli("--workers", "0", WORKER, "print")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert (
        proc.stderr.splitlines()[-1]
        == "Error: Invalid value for '--workers' / '-n': 0 is not in the range x>=1."
    )
    assert proc.stderr.startswith("Usage: python -m keras_sync.launch [OPTIONS] SCRIPT [ARGS]...")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--max-restarts", "Invalid value for '--max-restarts': -1 is not in the range x>=0."),
        ("--grace-period", "Invalid value for '--grace-period': -1.0 is not in the range x>=0."),
    ],
)
def test_cli_rejects_negative_restarts_and_grace_with_clicks_usage_error(
    option: str, message: str
) -> None:
    proc = _run_cli(option, "-1", WORKER, "print")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"Error: {message}"


def test_cli_missing_script_is_one_line() -> None:
    proc = _run_cli("--workers", "2", "no_such_train.py")
    assert proc.returncode == 2
    assert proc.stderr == (
        "Invalid value for argument `script`. Received: script='no_such_train.py', which is not a "
        "file. Fix: check the path (relative to the current directory).\n"
    )


def test_module_and_console_script_are_one_command_line() -> None:
    """`python -m keras_sync.launch` is the click command of `keras-sync launch`: same options, same help."""
    module = _run_cli("--help")
    script = subprocess.run(
        [str(Path(sys.executable).with_name("keras-sync")), "launch", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert module.returncode == script.returncode == 0
    assert "--max-restarts" in module.stdout
    assert (
        module.stdout.replace("python -m keras_sync.launch", "keras-sync launch") == script.stdout
    )


def test_max_restarts_starts_the_job_again_with_the_same_job_id(tmp_path: Path) -> None:
    proc = _run_cli("--workers", "2", "--max-restarts", "2", WORKER, "fail-once", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "[launch] w1 exited with code 3; stopping the other 1 worker(s)" in proc.stderr
    assert proc.stderr.count("[launch] restart") == 1
    assert "[launch] restart 1/2 after worker 1 exited with code 3" in proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if " job " in line]
    jobs = {job for _, _, job, _, _ in lines}
    assert len(jobs) == 1 and jobs.pop().startswith(
        "launch-"
    )  # every worker of every try: one identity
    # Both workers of the second try, numbered 1; w1 of the first (w0 may be stopped before it prints).
    assert {(w, n) for w, _, _, _, n in lines} >= {("[w1]", "0"), ("[w0]", "1"), ("[w1]", "1")}, (
        lines
    )


def test_max_restarts_exhausted_returns_the_last_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = launch(
        WORKER,
        ["fail-always", str(tmp_path)],
        workers=2,
        grace_period_s=1,
        max_restarts=2,
        env={"KERAS_SYNC_JOB_ID": "mine"},
    )
    assert code == 3
    out, err = capsys.readouterr()
    assert [l for l in err.splitlines() if "restart" in l] == [
        "[launch] restart 1/2 after worker 1 exited with code 3",
        "[launch] restart 2/2 after worker 1 exited with code 3",
    ]
    assert {line.split()[2] for line in out.splitlines() if " job " in line} == {
        "mine"
    }  # the user's id is kept
    assert {line.split()[-1] for line in out.splitlines() if line.startswith("[w1] job ")} == {
        "0",
        "1",
        "2",
    }


def test_zero_max_restarts_is_one_try(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(WORKER, ["fail-once", str(tmp_path)], workers=2, grace_period_s=1) == 3
    assert "restart" not in capsys.readouterr().err


def test_launch_rejects_a_config_that_is_not_a_file() -> None:
    with pytest.raises(UsageError) as e:
        launch(WORKER, ["print"], workers=2, config="missing.yaml")
    assert str(e.value) == (
        "Invalid value for argument `config`. Received: config='missing.yaml', which is not a file. "
        "Fix: check the path (relative to the current directory)."
    )


def test_launcher_and_cluster_load_no_tensorflow() -> None:
    code = "import sys, keras_sync.launch, keras_sync.cluster; print('tensorflow' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.stdout.strip() == "False", proc.stderr


def _results(out: str) -> dict[str, dict]:
    found = {}
    for line in out.splitlines():
        prefix, _, payload = line.partition(" ")
        if payload.startswith('{"task_id"'):
            found[prefix] = json.loads(payload)
    return found


def test_two_tensorflow_workers_all_reduce_over_the_launchers_tf_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = launch(
        str(ROOT / "tests" / "_launch_tf_worker.py"), ["tf_config"], workers=2, grace_period_s=1
    )
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    results = _results(out)
    assert [results[f"[w{i}]"]["sum"] for i in range(2)] == [
        3.0,
        3.0,
    ]  # 1 + 2 across the two workers
    assert [results[f"[w{i}]"]["replicas"] for i in range(2)] == [2, 2]
    assert [(r["is_chief"], r["tf_is_chief"]) for r in (results["[w0]"], results["[w1]"])] == [
        (True, True),
        (False, False),
    ]


@pytest.mark.slow
@pytest.mark.compat  # 2 workers through launch, exact resume after SIGKILL, one MLflow run: on every stack
@pytest.mark.timeout(1500)
def test_max_restarts_resumes_a_sigkilled_worker_exactly_in_one_mlflow_run(tmp_path: Path) -> None:
    """`launch --workers 2 --max-restarts 1`, worker 1 SIGKILLed after step 17 on the first try only."""
    import numpy as np
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(
        uri
    ).search_experiments()  # the store exists before the job, as a tracking server would
    train = str(ROOT / "tests" / "_mwr_train.py")

    def config(**extra: object) -> str:
        return json.dumps(
            {
                "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 90},
                "batch": {"global": 32},
                "learning_rate": {"base": 0.01, "base_batch_size": 32},
                **extra,
            }
        )

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "KERAS_SYNC_JOB_ID")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_sync.launch",
                "--workers",
                "2",
                "--grace-period",
                "2",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=1000,
            cwd=tmp_path,
            env=env,
        )

    ref = run(train, config(mlflow={"enabled": False}), str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = run(
        "--max-restarts",
        "1",
        train,
        config(
            mlflow={"tracking_uri": uri, "experiment": "restarts", "log_every_n_steps": 1},
            fault_tolerance={"backup_dir": str(tmp_path / "backup"), "save_freq": 5},
        ),
        str(tmp_path / "job"),
        "--kill-at",
        "17",
        "--kill-task",
        "1",
        "--marker",
        str(tmp_path / "killed"),
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "[launch] restart 1/1 after worker 1 exited with code 137" in job.stderr
    assert "[w0] keras-sync: resumed from the backup" in job.stderr
    # The backup's end-of-fit barrier runs in a tf.function (eagerly MWMS warns on every worker).
    assert "eagerly has significant overhead" not in job.stderr + job.stdout
    for t in (0, 1):
        a, b = (json.loads((tmp_path / d / f"w{t}.json").read_text()) for d in ("ref", "job"))
        assert b["start"] == {"iterations": 15, "epoch": 1}
        diff = max(
            float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(a["weights"], b["weights"])
        )
        assert diff <= 1e-6
    deliver_leftovers(tmp_path / ".keras_sync_spool")  # what exit's bounded wait left
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("restarts").experiment_id])
    assert len(runs) == 1  # both tries continued one run: launch gave them one KERAS_SYNC_JOB_ID
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "sync/loss/replica_1")]
    assert sorted(steps) == list(
        range(1, 33)
    )  # 4 epochs x 8 steps, steps 16-17 (trained twice) once


# -- who can reach the workers --------------------------------------------------------------------

LISTEN = str(Path(__file__).with_name("_listen_worker.py"))


def _listening(pids: set[int], netns_of: int | None = None) -> list[str]:
    """``ss -ltnp``'s local addresses of the sockets of ``pids``, on the host or in ``netns_of``'s network namespace."""
    cmd = ["ss", "-ltnpH"]
    if netns_of is not None:
        cmd = ["nsenter", f"--net=/proc/{netns_of}/ns/net", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout
    return sorted(
        line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)
    )


def _listening_job(tmp_path: Path, *flags: str) -> tuple[list[str], list[str], list[str]]:
    """Launch 2 TensorFlow workers that hold once their servers listen: (host addresses, namespace
    addresses, the namespace's interfaces) of their listening sockets."""
    release = tmp_path / "release"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_sync.launch", "-n", "2", *flags, LISTEN, str(release)],
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        pids = {int(next(launcher.stdout).split()[-1]) for _ in range(2)}  # "[wI] listening PID"
        host = _listening(pids)
        inside = _listening(pids, netns_of=min(pids))
        links = subprocess.run(
            ["nsenter", f"--net=/proc/{min(pids)}/ns/net", "ip", "-o", "link"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        release.touch()
        assert launcher.wait(timeout=120) == 0
    finally:
        launcher.kill()
    return host, inside, sorted(line.split(":")[1].strip() for line in links.splitlines())


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root"
)
def test_private_network_leaves_no_worker_port_on_the_host_while_by_default_they_listen_on_every_interface(
    tmp_path: Path,
) -> None:
    # By default TensorFlow's servers listen on every interface ("*": 0.0.0.0 and [::]), though
    # TF_CONFIG says 127.0.0.1: what launch --help warns of. (A TensorFlow that binds the address
    # it is given would fail here: then launch no longer needs the namespace.)
    host, inside, _ = _listening_job(tmp_path)
    assert len(host) == 2 and all(addr.startswith("*:") for addr in host), host
    assert inside == host  # the host's namespace
    # --private-network: nothing of theirs on the host; in their namespace, only a loopback exists.
    host, inside, links = _listening_job(tmp_path, "--private-network")
    assert host == []
    assert len(inside) == 2 and all(addr.startswith("*:") for addr in inside), inside
    assert links == ["lo"]


def test_private_network_refused_in_one_line_where_no_namespace_can_be_made() -> None:
    code = (
        "import os, sys\nos.geteuid = lambda: 1000\n"
        "from keras_sync.launch import refuse_private_network_unless_possible\n"
        "try:\n    refuse_private_network_unless_possible()\nexcept Exception as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert out == (
        "Invalid value for argument `private_network`. Received: private_network=True, but a network "
        "namespace needs root or CAP_SYS_ADMIN (uid 1000). Fix: run launch as root on Linux, or drop "
        "--private-network and keep the workers' ports behind a firewall.\n"
    )


def _worker_addresses(launcher_pid: int) -> list[str]:
    """The cluster the launcher's workers were given (read from a worker's environment)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
    tf_config = next(v for v in environ if v.startswith(b"TF_CONFIG=")).split(b"=", 1)[1]
    return json.loads(tf_config)["cluster"]["worker"]


@pytest.mark.timeout(600)
def test_a_foreign_client_reaches_a_worker_and_the_job_ends_with_the_lost_peer_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    # Loopback only: the client stands for any host that reaches the workers' ports.
    cfg = {
        "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
        "batch": {"global": 32},
        "learning_rate": {"base": 0.01, "base_batch_size": 32},
        "mlflow": {"enabled": False},
    }
    go, out, err = tmp_path / "go", tmp_path / "out", tmp_path / "err"
    with out.open("w") as o, err.open("w") as e:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "keras_sync.launch",
                "-n",
                "2",
                str(ROOT / "tests" / "_mwr_train.py"),
                json.dumps(cfg),
                str(tmp_path / "job"),
                "--epochs",
                "3",
                "--wait-at",
                "5",
                "--wait-for",
                str(go),
            ],
            cwd=ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while not {"[w0] step 5 epoch 0 batch 4", "[w1] step 5 epoch 0 batch 4"} <= set(
            out.read_text().splitlines()
        ):
            assert launcher.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        chief = _worker_addresses(launcher.pid)[0]
        client = subprocess.run(
            [
                sys.executable,
                str(ROOT / "tests" / "_foreign_client.py"),
                chief,
                str(tmp_path / "written"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        go.touch()
        code = launcher.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    # What launch --help warns of: the client ran ops on worker 0 (it wrote a file there).
    assert client.stdout == "written by a client that is not in the job\n", client.stderr[-3000:]
    log = err.read_text()
    assert code != 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert (
        f"[w1] keras-sync: /job:worker/task:1 lost contact with /job:worker/task:0 ({chief}): "
        in log
    ), log[-3000:]


def test_private_network_refuses_an_http_tracking_server_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    with pytest.raises(UsageError) as e:
        launch(
            WORKER,
            ["hang", str(tmp_path)],
            workers=2,
            private_network=True,
            env={"MLFLOW_TRACKING_URI": "http://alice:secret@10.0.0.1:5000"},
        )
    assert str(e.value) == (
        "Invalid value for argument `private_network`. Received: private_network=True with "
        "mlflow.tracking_uri='http://10.0.0.1:5000', which the namespace cannot reach. Fix: use a "
        "sqlite or file store, set mlflow.enabled: false, or drop --private-network."
    )
    assert not list(tmp_path.iterdir())  # no worker started; the password is in no message
