"""Next-step hints name commands that run as printed, whether this environment's bin is on the PATH or not."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from keras_sync.tracking.shell_hint import console_command, python_command
from keras_sync.training.job_run import how_to_open

BIN = Path(sys.executable).parent  # this venv's scripts: keras-sync, mlflow, python


def _without_bin() -> str:
    return os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != str(BIN.absolute())
    )


def _stand_ins(source: str, uri: str = "sqlite:////tmp/x/mlflow.db") -> tuple[object, object]:
    writer = types.SimpleNamespace(run_url=lambda: None, shown_uri=uri)
    return writer, types.SimpleNamespace(source=source)  # a config


def test_the_ui_hint_names_the_full_path_when_the_venv_is_not_on_the_path(monkeypatch, tmp_path):
    # The quickstart's last line, printed by `.venv/bin/python examples/quickstart.py` in a shell
    # that never activated the venv: "view it with: keras-sync ui ..." was not found there.
    cfg = tmp_path / "quickstart.yaml"
    monkeypatch.setenv("PATH", _without_bin())
    assert (
        how_to_open(*_stand_ins(str(cfg)), "r1") == f"view it with: {BIN / 'keras-sync'} ui {cfg}"
    )
    # MLflow's own script where this environment has one, else its module (an environment that reaches
    # another's packages by a .pth file has no script beside its python)
    mlflow = BIN / "mlflow" if (BIN / "mlflow").is_file() else f"{BIN / 'python'} -m mlflow"
    assert how_to_open(*_stand_ins("<dict>"), "r1") == (
        f"view it with: {mlflow} ui --backend-store-uri sqlite:////tmp/x/mlflow.db"
    )
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{_without_bin()}")
    assert how_to_open(*_stand_ins(str(cfg)), "r1") == f"view it with: keras-sync ui {cfg}"
    assert console_command() == "keras-sync" and python_command() == "python"


def test_a_path_with_a_space_is_quoted(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{_without_bin()}")
    cfg = tmp_path / "my runs" / "k.yaml"
    assert how_to_open(*_stand_ins(str(cfg)), "r1") == f"view it with: keras-sync ui '{cfg}'"


def test_without_a_console_script_beside_the_interpreter_it_is_python_m_keras_sync(
    monkeypatch, tmp_path
):
    # e.g. a source checkout on PYTHONPATH: no keras-sync script beside the interpreter.
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setenv("PATH", _without_bin())
    assert console_command() == f"{python} -m keras_sync"
    help_text = subprocess.run(
        [str(BIN / "python"), "-m", "keras_sync", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_text.returncode == 0 and help_text.stdout.startswith(
        "Usage: python -m keras_sync "
    ), help_text.stderr


@pytest.mark.parametrize("activated", [True, False])
def test_the_printed_python_runs_this_environment(monkeypatch, activated):
    monkeypatch.setenv(
        "PATH", f"{BIN}{os.pathsep}{_without_bin()}" if activated else _without_bin()
    )
    words = python_command()
    assert words == ("python" if activated else str(BIN / "python"))
    r = subprocess.run(
        ["bash", "-c", f"{words} -c 'import keras_sync, sys; print(sys.prefix)'"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip() == sys.prefix, r.stderr
