"""Saving from every worker (`keras_sync.training.saving`): a plain script's `model.save`, `save_weights`,
`ModelCheckpoint(save_best_only=True)`, Keras' `BackupAndRestore`, `TensorBoard`, `CSVLogger` and
`sync.save`. (`TensorBoard` needs the `tensorboard` package, which tensorflow-cpu 2.21 does not
bring: the `test` extra installs it.)

Two real workers on 127.0.0.1 run tests/_save_train.py, each under strace when it is installed
(it sees opens made by C code too, such as HDF5's) and with a Python audit hook on `open`: the
chief writes every path, the other worker opens none of them for writing. The files load in a
fresh process and predict like the trained model; one worker alone writes the same files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _ports import free_ports

from keras_sync.errors import UsageError
from keras_sync.training import saving

HERE = Path(__file__).parent
TRAIN = HERE / "_save_train.py"
CHECK = HERE / "_save_check.py"
USER_FILES = ("best.keras", "final.keras", "final.weights.h5", "explicit.keras")
USER_LOGS = ("log.csv", "tb")  # CSVLogger, TensorBoard (tb/train, tb/validation)
EPOCHS = 4  # as in _save_train.py
STRACE = shutil.which("strace")
_OPEN_FOR_WRITE = re.compile(r'(?:open|openat|openat2|creat)\((?:[^,]*, )?"([^"]+)", ([^)]*)\)')


def _env(tf_config: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if tf_config:
        env["TF_CONFIG"] = tf_config
    return env


def _start(
    task: int | None, workers: list[str], save_dir: Path, result_dir: Path, trace: Path
) -> subprocess.Popen:
    tf_config = (
        json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": task}})
        if workers
        else None
    )
    cmd = [sys.executable, str(TRAIN), str(save_dir), str(result_dir)]
    if STRACE:
        cmd = [
            STRACE,
            "-f",
            "-qq",
            "--seccomp-bpf",
            "-e",
            "trace=open,openat,openat2,creat",
            "-e",
            "signal=none",
            "-o",
            str(trace),
            *cmd,
        ]
    return subprocess.Popen(
        cmd,
        cwd=result_dir,
        env=_env(tf_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(procs: list[subprocess.Popen], timeout: float = 420) -> None:
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"


def _traced_writes(trace: Path, save_dir: Path) -> list[str]:
    """Paths under ``save_dir`` that the traced process opened for writing (O_WRONLY/O_RDWR/O_CREAT)."""
    root = str(save_dir)
    out = []
    for line in trace.read_text().splitlines():
        m = _OPEN_FOR_WRITE.search(line)
        if m and m.group(1).startswith(root) and re.search(r"O_WRONLY|O_RDWR|O_CREAT", m.group(2)):
            out.append(m.group(1))
    return out


def _check(*save_dirs: Path) -> list[dict]:
    """Load what each of ``save_dirs`` holds in one fresh process (not the one that wrote it)."""
    r = subprocess.run(
        [sys.executable, str(CHECK), *map(str, save_dirs)],
        env=_env(None),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.strip().splitlines()[-len(save_dirs) :]]


def _start_run(root: Path, tasks: list[int | None], workers: list[str]) -> list[subprocess.Popen]:
    """Start the save script as ``tasks`` (None: alone), saving into ROOT/user."""
    (root / "user").mkdir()
    (root / "results").mkdir()
    return [
        _start(t, workers, root / "user", root / "results", root / f"w{t or 0}.strace")
        for t in tasks
    ]


def _read_run(root: Path, tasks: int, loaded: dict) -> dict:
    out = {"save_dir": root / "user", "root": root, "loaded": loaded}
    for i in range(tasks):
        out[f"w{i}"] = json.loads((root / "results" / f"w{i}.json").read_text())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Two workers and one worker alone, all at once; then one process loads what both saved."""
    two, one = tmp_path_factory.mktemp("save2"), tmp_path_factory.mktemp("save1")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    _run(_start_run(two, [0, 1], workers) + _start_run(one, [None], []))
    loaded_two, loaded_one = _check(two / "user", one / "user")
    return {2: _read_run(two, 2, loaded_two), 1: _read_run(one, 1, loaded_one)}


@pytest.fixture(scope="module")
def two_workers(runs: dict[int, dict]) -> dict:
    return runs[2]


@pytest.fixture(scope="module")
def one_worker(runs: dict[int, dict]) -> dict:
    return runs[1]


def _close(a: object, b: object) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_non_chief_never_opens_the_users_paths_for_writing(two_workers: dict) -> None:
    w0, w1 = two_workers["w0"], two_workers["w1"]
    assert (w0["is_chief"], w1["is_chief"]) == (True, False) and w0["num_workers"] == 2
    assert w1["python_opens"] == [], w1["python_opens"]
    # The chief's record is the control: the same hook sees the writes it made.
    chief_opened = {os.path.basename(p) for p in w0["python_opens"]}
    assert {"best.keras", "final.keras", "explicit.keras"} <= chief_opened, chief_opened
    if STRACE:
        root = two_workers["root"]
        assert _traced_writes(root / "w1.strace", two_workers["save_dir"]) == []
        traced = {
            os.path.relpath(p, two_workers["save_dir"])
            for p in _traced_writes(root / "w0.strace", two_workers["save_dir"])
        }
        assert set(USER_FILES) <= traced, traced
        assert "keras_backup/latest.weights.h5" in traced, (
            traced
        )  # Keras' BackupAndRestore, chief only
    left = sorted(p.name for p in two_workers["save_dir"].iterdir())
    assert left == sorted(USER_FILES + USER_LOGS), (
        left
    )  # the backup was deleted at train end, no temporary file left


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensorboard_and_csv_logger_write_the_users_paths_on_the_chief_only(
    two_workers: dict,
) -> None:
    # Before: every worker wrote its own event files into tb/train and tb/validation (each point
    # shown twice) and both opened log.csv for writing.
    w0, w1, save_dir = two_workers["w0"], two_workers["w1"], two_workers["save_dir"]
    assert w0["callback_paths"] == {"tb": str(save_dir / "tb"), "csv": str(save_dir / "log.csv")}
    for path in w1["callback_paths"].values():  # a temporary place, deleted when fit ended
        assert not path.startswith(str(save_dir)) and saving.TEMP_PREFIX in path, path
    assert w1["callback_paths_left"] == {"tb": False, "csv": False}
    assert (
        str(save_dir / "log.csv") in w0["python_opens"]
    )  # the control: the hook sees the chief's writes
    events = {
        d: sorted(p.name for p in (save_dir / "tb" / d).iterdir()) for d in ("train", "validation")
    }
    assert all(
        len(files) == 1 and files[0].startswith("events.out.tfevents.") for files in events.values()
    ), events
    rows = (save_dir / "log.csv").read_text().splitlines()
    assert rows[0].split(",")[0] == "epoch" and len(rows) == 1 + EPOCHS, rows
    # A callback keras-sync does not know, guarded with sync.is_chief as the saving how-to shows.
    assert (two_workers["root"] / "results" / "scribble.txt").read_text() == "done by worker 0"
    if STRACE:  # C++ writes too (TensorBoard's event files): the other worker opened none under the user's dir
        assert _traced_writes(two_workers["root"] / "w1.strace", save_dir) == []
        traced = {
            os.path.relpath(p, save_dir).split(os.sep)[0]
            for p in _traced_writes(two_workers["root"] / "w0.strace", save_dir)
        }
        assert set(USER_LOGS) <= traced, traced


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_saved_files_load_and_predict_like_the_trained_model(two_workers: dict) -> None:
    w0, w1, loaded = two_workers["w0"], two_workers["w1"], two_workers["loaded"]
    assert _close(w0["final"], w1["final"]) <= 1e-6  # both workers hold the same model
    for name in ("final.keras", "final.weights.h5", "explicit.keras"):
        assert not isinstance(loaded[name], str), f"{name}: {loaded[name]}"
        assert _close(loaded[name], w0["final"]) <= 1e-6, name
    best_epoch = int(np.argmin(w0["loss"]))
    assert not isinstance(loaded["best.keras"], str), loaded["best.keras"]
    assert _close(loaded["best.keras"], w0["per_epoch"][best_epoch]) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_worker_writes_the_same_files(one_worker: dict, two_workers: dict) -> None:
    w0 = one_worker["w0"]
    assert w0["is_chief"] and w0["num_workers"] == 1
    assert sorted(p.name for p in one_worker["save_dir"].iterdir()) == sorted(
        USER_FILES + USER_LOGS
    )
    for name in USER_FILES:
        assert not isinstance(one_worker["loaded"][name], str), one_worker["loaded"][name]
    # Same global batch and rate: one worker trains the model two workers do.
    assert _close(one_worker["loaded"]["final.keras"], two_workers["loaded"]["final.keras"]) <= 1e-5


class _NotAModel:
    pass


def test_save_rejects_what_is_not_a_model() -> None:
    with pytest.raises(
        UsageError,
        match=r"argument `model` of sync.save. Received: _NotAModel. Expected a Keras model",
    ):
        saving.save(_NotAModel(), "m.keras")


class _Saveable:
    def save(self, path: str) -> None:  # pragma: no cover - never reached
        raise AssertionError

    save_weights = save


@pytest.mark.parametrize("bad", ["", None, 3])
def test_save_rejects_a_bad_path(bad: object) -> None:
    with pytest.raises(
        UsageError, match=r"argument `filepath` of sync.save. Received: filepath=.*Expected a path"
    ):
        saving.save(_Saveable(), bad)


def test_write_target_is_the_users_path_without_a_multi_worker_strategy(tmp_path: Path) -> None:
    with saving.write_target(tmp_path / "m.keras", None) as target:
        assert target == tmp_path / "m.keras"
