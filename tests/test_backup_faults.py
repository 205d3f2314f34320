"""One process killed and relaunched with its backup: an exact resume, and faults of the backup
directory made to happen: damaged backups, two jobs in one directory, a directory the process cannot
write (keras_sync.training.backup_files, keras_sync.training.paths).

Training runs tests/_mwr_train.py (one process, kind default, 8 steps per epoch, a Dropout layer, save
every 3 steps: a kill after step 22 leaves the backups of steps 18 and 21). The multi-worker kill
tests are in tests/test_multi_worker.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from _mwr import TRAIN, kill_and_resume, max_diff, result

from keras_sync.errors import UsageError
from keras_sync.training import backup_files as _backup_files
from keras_sync.training import paths as _paths

BASE = {
    "strategy": {"kind": "default"},
    "batch": {"global": 32},
    "learning_rate": {"base": 0.01},
    "mlflow": {"enabled": False},
}
MODEL = ("--dropout", "0.25")  # its seed state must resume too


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "KERAS_SYNC_JOB_ID")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _cfg(tmp: Path, *, backup: bool = True, mlflow: bool = False) -> dict:
    cfg = json.loads(json.dumps(BASE))
    if backup:
        cfg["fault_tolerance"] = {"backup_dir": str(tmp / "bk"), "save_freq": 3}
    if mlflow:
        cfg["mlflow"] = {
            "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
            "experiment": "faults",
            "spool_dir": str(tmp / "spool"),
        }
    return cfg


def _train(tmp: Path, name: str, cfg: dict, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TRAIN), json.dumps(cfg), str(tmp / name), *MODEL, *extra],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list:
    """The weights of the same seeded script without a backup, trained once for the module."""
    tmp = tmp_path_factory.mktemp("ref")
    ref = _train(tmp, "ref", _cfg(tmp, backup=False))
    assert ref.returncode == 0, ref.stderr[-3000:]
    return result(tmp / "ref")["weights"]


def _killed_at_22(tmp: Path, cfg: dict) -> None:
    r = _train(tmp, "res", cfg, "--kill-at", "22", "--marker", str(tmp / "killed"))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert [Path(p).name for p in _backup_files.checkpoints(str(tmp / "bk"))] == [
        "ckpt-21",
        "ckpt-18",
    ]
    assert all(_backup_files.problem(p) is None for p in _backup_files.checkpoints(str(tmp / "bk")))


def _keras_sync_lines(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("keras-sync: ") and "config:" not in line
    ]


# -- pure: manifests, choice, lock ------------------------------------------------------------------


def _fake_checkpoint(folder: Path, n: int, data: bytes = b"x" * 100) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ckpt-{n}.index").write_bytes(b"index" * 4)
    (folder / f"ckpt-{n}.data-00000-of-00001").write_bytes(data)
    return str(folder / f"ckpt-{n}")


def test_a_checkpoint_is_trusted_only_when_its_files_match_its_manifest(tmp_path: Path) -> None:
    old, new = _fake_checkpoint(tmp_path, 18), _fake_checkpoint(tmp_path, 21)
    _backup_files.write_manifest(old, {"job_id": "j"})
    assert _backup_files.problem(new) == "incomplete: no manifest (its save was cut off)"
    _backup_files.write_manifest(new)
    assert _backup_files.problem(new) is None
    Path(new + ".data-00000-of-00001").write_bytes(b"x" * 40)
    assert _backup_files.problem(new) == "ckpt-21.data-00000-of-00001 has 40 of 100 bytes"
    Path(new + ".data-00000-of-00001").write_bytes(b"y" * 100)
    assert _backup_files.problem(new) == "ckpt-21.data-00000-of-00001 is damaged (checksum differs)"
    choice = _backup_files.choose(str(tmp_path))
    assert choice.usable[0] == old and [Path(p).name for p, _ in choice.skipped] == ["ckpt-21"]
    assert _backup_files.manifest_run(old) == {"job_id": "j"}


def test_only_damaged_checkpoints_are_refused_in_one_line_naming_the_directory(
    tmp_path: Path,
) -> None:
    prefix = _fake_checkpoint(tmp_path, 21)
    _backup_files.write_manifest(prefix)
    Path(prefix + ".index").write_bytes(b"garbled!")
    with pytest.raises(UsageError) as e:
        _backup_files.choose(str(tmp_path))
    assert str(e.value) == (
        f"fault_tolerance.backup_dir: no usable backup in {tmp_path} (ckpt-21: ckpt-21.index has 8 of 20 bytes). "
        "Fix: restore that directory from a copy, or delete it to train from the start; nothing was trained."
    )


def test_a_save_cut_off_before_its_manifest_is_no_backup(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3)
    assert _backup_files.choose(str(tmp_path)).usable == []


def test_a_second_job_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = _backup_files.Holder("job-a", "hostx", os.getpid(), None)
    lock = _backup_files.BackupLock(str(tmp_path), first)
    lock.acquire()
    second = _backup_files.BackupLock(
        str(tmp_path), _backup_files.Holder("job-b", "hostx", os.getpid() + 1, None)
    )
    with pytest.raises(
        UsageError, match=r"is in use by job job-a \(pid \d+ on hostx\), which is training"
    ):
        second.acquire()
    lock.release()
    assert not (tmp_path / _backup_files.LOCK_FILE).exists()
    second.acquire()
    second.release()


def test_a_lock_of_a_dead_process_is_stale_and_a_worker_accepts_its_own_chief(
    tmp_path: Path,
) -> None:
    import socket

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = socket.gethostname()
    stale = _backup_files.Holder(None, host, int(dead.stdout), None)
    me = _backup_files.Holder(None, host, os.getpid(), None)
    assert _backup_files.live_other((stale, 0.0), me, chief=True) is None
    live = _backup_files.Holder("job-a", "other-host", 1, '{"worker": ["h:1", "h:2"]}')
    assert _backup_files.live_other((live, 1.0), me, chief=True) == live
    assert _backup_files.live_other((live, _backup_files.STALE_S + 1), me, chief=True) is None
    worker_same_job = _backup_files.Holder("job-a", host, os.getpid() + 7, None)
    assert _backup_files.live_other((live, 1.0), worker_same_job, chief=False) is None
    worker_other_job = _backup_files.Holder("job-b", host, os.getpid() + 7, None)
    assert _backup_files.live_other((live, 1.0), worker_other_job, chief=False) == live
    relaunched_chief = _backup_files.Holder("job-a", host, os.getpid(), None)
    assert _backup_files.live_other((live, 1.0), relaunched_chief, chief=True) is None


def test_an_unwritable_directory_is_named_with_the_key(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(UsageError) as e:
        _paths.check_writable(target / "bk", "fault_tolerance.backup_dir")
    assert str(e.value) == (
        f"fault_tolerance.backup_dir={str(target / 'bk')!r}: this process cannot create it in {target} (Not a "
        "directory). Fix: choose a directory it can write, or give it write permission there; nothing was trained."
    )


# -- real training, real kills ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_one_process_default_strategy_sigkill_mid_epoch_resumes_exactly(
    tmp_path: Path, reference: list
) -> None:
    """kind=default with arrays in a seeded script: Keras's own shuffle draws the same order again, so a
    resume replays it, and the weights equal those of the same script without a backup.

    The model has a Dropout layer: its seed state is in the backup too, so the resumed run draws
    the masks the uninterrupted one drew (without it: weights far apart, seen in a user trial).
    """
    cfg = {**BASE, "fault_tolerance": {"save_freq": 3}}
    a, b, second = kill_and_resume(tmp_path, cfg, kill_at=22, timeout=120, args=MODEL)
    assert b["start"] == {"iterations": 21, "epoch": 2}  # step 21 = epoch 2 after 5 of 8 batches
    assert second.stdout.splitlines()[0] == "step 22 epoch 2 batch 5"
    assert max_diff(a["weights"], b["weights"]) <= 1e-6
    assert np.allclose(b["loss"], a["loss"][2:], rtol=1e-6, atol=0)
    # The backup changes nothing but the ability to resume: the same seeded script without
    # backup_dir (the module's reference) trains the same weights (0.13 apart when a backup
    # reshuffled the arrays itself).
    assert max_diff(a["weights"], reference) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_damaged_backups_are_skipped_or_refused_and_the_run_is_continued_not_failed(
    tmp_path: Path, reference: list
) -> None:
    """One kill after step 22, then two damages of what it left (the backup restored between them).

    No usable backup (ckpt-21's index garbled, ckpt-18's data emptied): the relaunch ends in one
    line, exit 2, and leaves the MLflow run as the kill left it (FAILED, which a relaunch continues).
    Only ckpt-21's .data truncated: the relaunch skips ckpt-21 in one line, resumes from ckpt-18,
    trains the same weights as the same seeded script without a backup, and continues the one MLflow
    run (named by ckpt-18's manifest).
    """
    from _spools import deliver_leftovers
    from mlflow import MlflowClient

    cfg = _cfg(tmp_path, mlflow=True)
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])

    def statuses() -> list[str]:
        deliver_leftovers(tmp_path / "spool")  # once every courier has ended (the killed one's too)
        experiment = client.get_experiment_by_name("faults")
        return [r.info.status for r in client.search_runs([experiment.experiment_id])]

    _killed_at_22(tmp_path, cfg)
    assert statuses() == ["FAILED"]  # the killed process's courier ends its open run
    bk = tmp_path / "bk"
    shutil.copytree(bk, tmp_path / "bk-killed")

    (bk / "ckpt-21.index").write_bytes(b"\x00garbled" * 8)
    old = bk / "ckpt-18.data-00000-of-00001"
    old.write_bytes(b"")
    refused = _train(tmp_path, "refused", cfg)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert _keras_sync_lines(refused.stderr) == [
        f"keras-sync: fault_tolerance.backup_dir: no usable backup in {bk} (ckpt-21: ckpt-21.index has 64 of "
        f"{json.loads((bk / 'ckpt-21.manifest.json').read_text())['files']['ckpt-21.index']['size']} bytes; "
        f"ckpt-18: ckpt-18.data-00000-of-00001 has 0 of "
        f"{json.loads((bk / 'ckpt-18.manifest.json').read_text())['files'][old.name]['size']} bytes). Fix: restore "
        "that directory from a copy, or delete it to train from the start; nothing was trained."
    ]
    assert statuses() == ["FAILED"]  # the refusal leaves the run as the kill left it: continuable

    shutil.rmtree(bk)
    shutil.copytree(tmp_path / "bk-killed", bk)
    data = bk / "ckpt-21.data-00000-of-00001"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    second = _train(tmp_path, "res", cfg, "--kill-at", "22", "--marker", str(tmp_path / "killed"))
    assert second.returncode == 0, second.stderr[-3000:]
    lines = _keras_sync_lines(second.stderr)
    assert (
        f"keras-sync: skipped the backup {bk / 'ckpt-21'} (ckpt-21.data-00000-of-00001 has {size // 2} of "
        f"{size} bytes); using ckpt-18"
    ) in lines, "\n".join(lines)  # (every line: pytest shortens them)
    assert "Traceback" not in second.stderr
    assert result(tmp_path / "res")["start"] == {"iterations": 18, "epoch": 2}
    assert max_diff(reference, result(tmp_path / "res")["weights"]) <= 1e-6
    assert statuses() == ["FINISHED"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_job_in_a_live_jobs_backup_dir_is_refused_before_training(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    go = tmp_path / "go"
    first = subprocess.Popen(
        [
            sys.executable,
            str(TRAIN),
            json.dumps(cfg),
            str(tmp_path / "a"),
            "--wait-at",
            "5",
            "--wait-for",
            str(go),
        ],
        # its pid is in the message: this process's own (not started by the suite's zygote)
        env={**_env(), "KERAS_SYNC_JOB_ID": "job-a", "KERAS_SYNC_TEST_ZYGOTE": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err: list[str] = []
    threading.Thread(target=lambda: err.append(first.stderr.read()), daemon=True).start()
    try:
        for (
            line
        ) in first.stdout:  # job a holds the directory: it has saved after step 3, waits after 5
            if line.startswith("step 5 "):
                break
        second = subprocess.run(
            [sys.executable, str(TRAIN), json.dumps(cfg), str(tmp_path / "b")],
            env={**_env(), "KERAS_SYNC_JOB_ID": "job-b"},
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        go.touch()
    assert first.wait(timeout=240) == 0, err
    assert second.returncode == 2, second.stderr[-3000:]
    assert _keras_sync_lines(second.stderr) == [
        f"keras-sync: fault_tolerance.backup_dir: {tmp_path / 'bk'} is in use by job job-a (pid {first.pid} on "
        f"{os.uname().nodename}), which is training into it now; two jobs in one backup directory would resume "
        f"from each other's backups. Fix: give this job its own backup_dir, or wait for that job to end (if it is "
        f"gone, delete {tmp_path / 'bk' / _backup_files.LOCK_FILE}); nothing was trained."
    ]
    assert "step " not in second.stdout
    assert result(tmp_path / "a")["start"] == {"iterations": 0, "epoch": 0}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_backup_dir_or_local_store_the_process_cannot_write_is_refused_at_load(
    tmp_path: Path,
) -> None:
    """Run without the permission override root has (CAP_DAC_OVERRIDE): the directory's modes apply."""
    ro = Path(tempfile.mkdtemp(prefix="ks_ro_"))
    try:
        (ro / "locked").mkdir()
        os.chmod(ro / "locked", 0o555)
        code = (
            "import json, sys, keras_sync\n"
            "keras_sync.load(json.loads(sys.argv[1]))\nprint('trained')"
        )
        store = f"sqlite:///{ro / 'locked' / 'mlflow.db'}"
        configs = [
            {"mlflow": {"enabled": False}, "fault_tolerance": {"backup_dir": str(ro / "locked")}},
            {
                "mlflow": {"enabled": False},
                "fault_tolerance": {"backup_dir": str(ro / "locked" / "bk")},
            },
            {"mlflow": {"tracking_uri": store, "spool_dir": str(tmp_path / "spool")}},
        ]
        shown = []
        for cfg in configs:
            cfg["strategy"] = {"kind": "default"}
            r = subprocess.run(
                [
                    "setpriv",
                    "--bounding-set=-dac_override,-dac_read_search,-fowner",
                    sys.executable,
                    "-c",
                    code,
                    json.dumps(cfg),
                ],
                env=_env(),
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert r.returncode == 2 and "trained" not in r.stdout, r.stderr[-3000:]
            shown += _keras_sync_lines(r.stderr)
        assert shown == [
            f"keras-sync: fault_tolerance.backup_dir={str(ro / 'locked')!r}: this process cannot write it (Permission "
            "denied). Fix: choose a directory it can write, or give it write permission there; nothing was trained.",
            f"keras-sync: fault_tolerance.backup_dir={str(ro / 'locked' / 'bk')!r}: this process cannot create it in "
            f"{ro / 'locked'} (Permission denied). Fix: choose a directory it can write, or give it write permission "
            "there; nothing was trained.",
            f"keras-sync: mlflow.tracking_uri={store!r}: this process cannot write its folder {ro / 'locked'} "
            "(Permission denied). Fix: choose a directory it can write, or give it write permission there; nothing "
            "was trained.",
        ]
    finally:
        os.chmod(ro / "locked", 0o755)
        subprocess.run(["rm", "-rf", str(ro)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_backup_disk_is_said_once_training_goes_on_and_the_relaunch_resumes_from_the_last_good_backup(
    tmp_path: Path, reference: list
) -> None:
    """backup_dir on a small tmpfs that fills up after step 10 (a file fills it while every worker waits):
    the saves of steps 12, 15, 18, 21 fail; one line says so, training goes on to the kill after step 22,
    and the relaunch (the disk freed) resumes from ckpt-9, the newest complete backup, to the weights of
    the same script without a backup. Before: a 17-line ResourceExhaustedError traceback at step 12, exit 1."""
    from _mounts import tmpfs

    cfg = _cfg(tmp_path)
    with tmpfs(tmp_path / "bk", size="512k") as bk:
        go = tmp_path / "disk-full"

        def fill_disk_at_step_10() -> None:
            while not (tmp_path / "res-step10").exists():
                threading.Event().wait(0.05)
            fd = os.open(bk / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:  # ENOSPC: the disk is full
                pass
            finally:
                os.close(fd)
                go.touch()

        filler = threading.Thread(target=fill_disk_at_step_10, daemon=True)
        filler.start()
        first = subprocess.Popen(
            [
                sys.executable,
                str(TRAIN),
                json.dumps(cfg),
                str(tmp_path / "res"),
                *MODEL,
                "--kill-at",
                "22",
                "--marker",
                str(tmp_path / "killed"),
                "--wait-at",
                "10",
                "--wait-for",
                str(go),
                "--step-file",
                str(tmp_path / "res-step10"),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, stderr = first.communicate(timeout=240)
        finally:
            if (
                first.poll() is None
            ):  # it waits at step 10 for a disk that was never filled: no stray process
                first.kill()
                first.wait()
        assert first.returncode == -signal.SIGKILL, stderr[-3000:]  # it trained on to step 22
        assert "Traceback" not in stderr
        failed = [line for line in _keras_sync_lines(stderr) if "could not be written" in line]
        assert len(failed) == 1, _keras_sync_lines(
            stderr
        )  # said once for the saves of steps 12, 15, 18 and 21
        assert failed[0].startswith(
            f"keras-sync: the backup at optimizer step 12 could not be written to {bk} "
            "(No space left on device); "
        )
        assert (
            "training goes on, and a relaunch resumes from the newest backup, optimizer step 9."
            in failed[0]
        )
        assert not list(bk.glob("*_temp"))  # TensorFlow's half-written checkpoints are removed
        assert _backup_files.choose(str(bk)).usable[0] == str(bk / "ckpt-9")
        (bk / "filler").unlink()
        second = _train(tmp_path, "res", cfg)
    assert second.returncode == 0, second.stderr[-3000:]
    assert result(tmp_path / "res")["start"]["iterations"] == 9
    assert max_diff(reference, result(tmp_path / "res")["weights"]) <= 1e-6
