"""The `keras-sync` console script, run for real in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from _cli_run import KERAS_SYNC, run
from _cli_run import cli_env as _env
from _ports import free_ports

from keras_sync.config.kinds import kinds_where

BAD_CONFIGS = Path(__file__).parent / "fixtures" / "bad_configs"


# -- validate -----------------------------------------------------------------------------------


def _expected(name: str) -> str:
    """A fixture's expected output; ``{kinds}`` is the kinds table's names (keras_sync.config.kinds), so a new kind
    added by the CONTRIBUTING recipe does not need the fixtures edited by hand."""
    from keras_sync.config.kinds import KINDS

    return (BAD_CONFIGS / f"{name}.expected").read_text().replace("{kinds}", ", ".join(KINDS))


@pytest.mark.parametrize("name", sorted(p.stem for p in BAD_CONFIGS.glob("*.yaml")))
def test_validate_bad_config_prints_exact_errors(name: str) -> None:
    result = run("validate", f"{name}.yaml", cwd=BAD_CONFIGS)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == _expected(name)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", sorted(p.stem for p in BAD_CONFIGS.glob("*.yaml")))
def test_load_config_raises_what_validate_prints(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keras_sync.config import load_config
    from keras_sync.errors import ConfigError

    monkeypatch.chdir(BAD_CONFIGS)
    with pytest.raises(ConfigError) as err:
        load_config(f"{name}.yaml", environ={})
    assert f"{err.value}\n" == _expected(name)


def test_validate_several_errors_reports_all_at_once() -> None:
    expected = _expected("several_errors").splitlines()
    assert len(expected) == 6
    assert all(line.startswith("several_errors.yaml:") for line in expected)


def test_validate_missing_file_says_so(tmp_path: Path) -> None:
    result = run("validate", "nope.yaml", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr
        == "nope.yaml: no such file; create one with 'keras-sync init' or pass the right path\n"
    )


def test_validate_directory_says_so(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    result = run("validate", "conf", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr == "conf: is a directory, expected a YAML file (e.g. conf/keras_sync.yaml)\n"
    )


def test_validate_non_utf8_names_line_and_byte(tmp_path: Path) -> None:
    (tmp_path / "latin1.yaml").write_bytes(b"strategy:\n  kind: mirrored\n# caf\xe9\n")
    result = run("validate", "latin1.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "latin1.yaml:3: not UTF-8 text (byte 0xe9 at offset 32); save the file as UTF-8 YAML\n"
    )


def test_validate_refuses_a_50_mb_value_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text("mlflow:\n  run_name: " + "r" * 50_000_000 + "\n")
    result = run("validate", "big.yaml", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "big.yaml: the file is 50,000,021 bytes, over the limit of 1,048,576 bytes (1 MiB) for a "
        "config file; a keras-sync config is a few kilobytes: check that this is the file you "
        "meant\n"
    )


def test_validate_without_any_config_file_says_how_to_make_one(tmp_path: Path) -> None:
    result = run("validate", cwd=tmp_path)
    assert result.returncode == 2
    assert "no config file" in result.stderr and "keras-sync init" in result.stderr


def test_validate_good_config_prints_summary(tmp_path: Path) -> None:
    (tmp_path / "keras_sync.yaml").write_text(
        "strategy:\n  kind: mirrored\nbatch:\n  global: 256\n"
    )
    result = run("validate", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "keras_sync.yaml: OK (strategy mirrored, global batch 256, learning rate 0.1 "
        "scaled linear, mlflow experiment 'keras-sync')\n"
    )


def test_validate_reads_config_from_env(tmp_path: Path) -> None:
    (tmp_path / "other.yaml").write_text("strategy:\n  kind: tpu\n")
    result = run("validate", cwd=tmp_path, KERAS_SYNC_CONFIG="other.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("other.yaml: OK (strategy tpu,")


# -- no heavy imports ---------------------------------------------------------------------------

_NO_TF_PROBE = """
import sys
from keras_sync.cli import main
assert main(["--help"], standalone_mode=False) == 0
main(["validate", sys.argv[1]], standalone_mode=False)
main(["schema"], standalone_mode=False)
heavy = [m for m in ("tensorflow", "keras", "mlflow") if m in sys.modules]
assert not heavy, heavy
print("clean")
"""


def test_help_lists_every_command_with_its_whole_first_sentence() -> None:
    from keras_sync.cli import cli

    result = run("--help", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    commands = result.stdout.split("Commands:")[1]
    assert "..." not in commands.replace("[ARGS...]", "")
    listing = " ".join(commands.split())
    for name, cmd in cli.commands.items():
        first = cmd.help.split("\n\n")[0]
        first = " ".join(first.split()).split(". ")[0].rstrip(".")
        assert f"{name} {first}" in listing, (name, first)


def test_help_validate_and_schema_import_no_tensorflow(tmp_path: Path) -> None:
    (tmp_path / "keras_sync.yaml").write_text("strategy:\n  kind: mirrored\n")
    result = subprocess.run(
        [sys.executable, "-c", _NO_TF_PROBE, str(tmp_path / "keras_sync.yaml")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("clean")


def test_version() -> None:
    from keras_sync import __version__

    result = run("--version")
    assert (result.returncode, result.stdout) == (0, f"keras-sync, version {__version__}\n")


def test_unknown_command_is_a_usage_error() -> None:
    result = run("trian")
    assert result.returncode == 2
    assert "No such command 'trian'" in result.stderr and "Traceback" not in result.stderr


# -- init ---------------------------------------------------------------------------------------


def test_init_refuses_to_overwrite_names_file_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("# mine\n")
    result = run("init", "--no-input", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "Refusing to overwrite train.py: it exists, so nothing was written. "
        "Pass --force to overwrite, or choose another directory.\n"
    )
    assert (tmp_path / "train.py").read_text() == "# mine\n"
    assert not (tmp_path / "keras_sync.yaml").exists()


def test_init_force_overwrites(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("# mine\n")
    (tmp_path / "keras_sync.yaml").write_text("strategy: {kind: tpu}\n")
    result = run(
        "init",
        "--no-input",
        "--force",
        "--strategy",
        "mirrored",
        "--per-replica-batch",
        "16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "import keras_sync" in (tmp_path / "train.py").read_text()
    text = (tmp_path / "keras_sync.yaml").read_text()
    assert "kind: mirrored" in text and "per_replica: 16" in text
    check = run("validate", cwd=tmp_path)
    assert check.returncode == 0, check.stderr


def test_init_without_tty_asks_nothing_and_uses_defaults(tmp_path: Path) -> None:
    result = subprocess.run(
        [KERAS_SYNC, "init", "proj"],
        cwd=tmp_path,
        env=_env(),
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [
        f"wrote {Path('proj', 'keras_sync.yaml')}",
        f"wrote {Path('proj', 'train.py')}",
    ]
    assert "kind: auto" in (tmp_path / "proj" / "keras_sync.yaml").read_text()


def test_init_into_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    result = run("init", "afile", "--no-input", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "afile" in result.stderr


@pytest.mark.slow
def test_init_then_train_script_trains_and_says_which_config(tmp_path: Path) -> None:
    assert run("init", "--no-input", cwd=tmp_path).returncode == 0
    env = {k: v for k, v in _env().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(
        [sys.executable, "train.py", "--epochs", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Sync(kind='default', replicas=1" in result.stdout
    assert "116/116" in result.stdout and "val_accuracy" in result.stdout  # 4096 x 0.9 / 32 steps
    assert (
        f"keras-sync: config: {tmp_path.resolve() / 'keras_sync.yaml'}; starting TensorFlow and the default "
        "strategy\n"
    ) in result.stderr


@pytest.mark.slow
def test_train_script_from_another_directory_says_it_uses_the_defaults(tmp_path: Path) -> None:
    assert run("init", "proj", "--no-input", cwd=tmp_path).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import keras_sync, sys; sys.argv = ['x']; keras_sync.load()"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"keras-sync: config: no keras_sync.yaml found in {elsewhere.resolve()} and $KERAS_SYNC_CONFIG is "
        "unset: built-in defaults (pass a path to keras_sync.load(), or run from the directory of the file); "
        "starting TensorFlow and the default strategy\n"
    ) in result.stderr


def test_train_script_with_a_bad_config_fails_before_importing_tensorflow(tmp_path: Path) -> None:
    assert run("init", "--no-input", cwd=tmp_path).returncode == 0
    config = tmp_path / "keras_sync.yaml"
    config.write_text(config.read_text().replace("per_replica: 32", "per_replica: 0"))
    # -X importtime lists every module the script imported, on stderr
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    imports = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    messages = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2
    assert messages == [
        f"keras-sync: keras_sync.yaml:{_line_of(config, 'per_replica:')}: batch.per_replica: "
        "received 0, expected an integer >= 1 or null"
    ]
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports}
    assert "yaml" in imported  # the listing works
    assert not {"tensorflow", "keras", "mlflow"} & imported


def test_train_script_with_a_300_deep_config_fails_in_one_line(tmp_path: Path) -> None:
    assert run("init", "--no-input", cwd=tmp_path).returncode == 0
    (tmp_path / "keras_sync.yaml").write_bytes((BAD_CONFIGS / "too_deep.yaml").read_bytes())
    result = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "keras-sync: "
        + _expected("too_deep").rstrip("\n").replace("too_deep.yaml", "keras_sync.yaml")
    ]


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# -- plan ---------------------------------------------------------------------------------------


def test_plan_json_has_values_and_sources(tmp_path: Path) -> None:
    (tmp_path / "keras_sync.yaml").write_text(
        "strategy:\n  kind: mirrored\nlearning_rate:\n  base: 0.05\n"
    )
    result = run(
        "plan",
        "--json",
        "--simulated-cpu-replicas",
        "4",
        "--per-replica-batch",
        "16",
        cwd=tmp_path,
        MLFLOW_TRACKING_URI="http://alice:s3cret@127.0.0.1:5999",
    )
    assert result.returncode == 0, result.stderr
    items = json.loads(result.stdout)["items"]
    assert items["strategy.kind"] == {"value": "mirrored", "source": "file", "note": ""}
    assert items["strategy.chosen"]["value"] == "mirrored"
    assert (items["replicas"]["value"], items["replicas"]["source"]) == (4, "derived")
    assert (items["batch.per_replica"]["value"], items["batch.per_replica"]["source"]) == (
        16,
        "flag",
    )
    assert items["batch.global"]["value"] == 64
    assert (items["learning_rate.base"]["value"], items["learning_rate.base"]["source"]) == (
        0.05,
        "file",
    )
    assert items["learning_rate.scaled"]["value"] == pytest.approx(0.2)  # 0.05 x 64/16
    assert items["learning_rate.scaling"]["source"] == "default"
    assert items["mlflow.tracking_uri"] == {
        "value": "http://127.0.0.1:5999",
        "source": "env",
        "note": "flag > $MLFLOW_TRACKING_URI > file > default",
    }
    assert "s3cret" not in result.stdout


def test_plan_says_a_null_base_batch_size_is_derived_not_from_the_file(tmp_path: Path) -> None:
    (tmp_path / "keras_sync.yaml").write_text("learning_rate:\n  base_batch_size: null\n")
    result = run("plan", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    item = json.loads(result.stdout)["items"]["learning_rate.base_batch_size"]
    assert item == {"value": 32, "source": "derived", "note": "null = the per-replica batch"}
    (tmp_path / "keras_sync.yaml").write_text("learning_rate:\n  base_batch_size: 256\n")
    item = json.loads(run("plan", "--json", cwd=tmp_path).stdout)["items"][
        "learning_rate.base_batch_size"
    ]
    assert (item["value"], item["source"]) == (256, "file")


def test_plan_text_shows_auto_choice_and_reason(tmp_path: Path) -> None:
    result = run("plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "strategy.chosen" in result.stdout and "auto: one worker" in result.stdout
    assert f"sqlite:///{tmp_path.resolve()}/mlflow.db" in result.stdout


def test_plan_counts_workers_from_tf_config(tmp_path: Path) -> None:
    tf_config = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    result = run("plan", "--json", cwd=tmp_path, TF_CONFIG=tf_config)
    assert result.returncode == 0, result.stderr
    items = json.loads(result.stdout)["items"]
    assert items["strategy.chosen"]["value"] == "multi_worker_mirrored"
    assert (items["workers"]["value"], items["workers"]["source"]) == (2, "env")
    assert items["batch.global"]["value"] == 64


def test_plan_global_batch_that_does_not_divide_is_one_line(tmp_path: Path) -> None:
    result = run(
        "plan",
        "--strategy",
        "mirrored",
        "--simulated-cpu-replicas",
        "3",
        "--global-batch",
        "100",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "Invalid value for batch.global. Received: global=100 with 3 replicas. Expected a "
        "multiple of 3 so that every replica gets the same batch; use 99 or 102, or set "
        "batch.per_replica instead.\n"
    )


def test_plan_bad_config_lists_issues(tmp_path: Path) -> None:
    result = run("plan", str(BAD_CONFIGS / "several_errors.yaml"), cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 6


# -- env, launch, sync-spool --------------------------------------------------------------------


@pytest.mark.slow
def test_env_report_redacts_and_lists_versions(tmp_path: Path) -> None:
    tf_config = json.dumps(
        {
            "cluster": {"worker": ["node-a.corp:2222", "node-b.corp:2222"]},
            "task": {"type": "worker", "index": 1},
        }
    )
    result = run(
        "env",
        "--no-devices",
        cwd=tmp_path,
        TF_CONFIG=tf_config,
        MLFLOW_TRACKING_URI="https://bob:hunter2@mlflow.example/?token=abc",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("keras-sync", "Python", "Platform", "TensorFlow", "Keras", "MLflow", "TF_CONFIG"):
        assert f"- {label}: " in out
    assert "hunter2" not in out and "token=abc" not in out and "node-a.corp" not in out
    assert "2 worker(s) [<host>:2222, <host>:2222], this task worker:1 (not chief)" in out


def test_launch_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    result = run("launch", "--workers", "2", "nope.py", "--epochs", "1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "Invalid value for argument `script`. Received: script='nope.py'"
    )


@pytest.mark.parametrize("kind", kinds_where(one_process=True))  # default, one_device, mirrored
def test_launch_refuses_a_one_process_kind_in_one_line_before_any_worker_starts(
    tmp_path: Path, kind: str
) -> None:
    (tmp_path / "train.py").write_text("open('started', 'a').write('x')\n")
    run("init", str(tmp_path / "p"), "--strategy", kind, "--no-input")
    (tmp_path / "p" / "train.py").write_text("open('started', 'a').write('x')\n")
    result = run(
        "launch", "-n", "2", "train.py", cwd=tmp_path / "p", PATH=_path_without_this_venv()
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"keras-sync launch --workers 2 starts 2 workers, but strategy.kind is '{kind}' in "
        f"{(tmp_path / 'p' / 'keras_sync.yaml').resolve()}, a kind that runs in one process: each worker would "
        "train on its own. Fix: set strategy.kind: auto or multi_worker_mirrored, or run it as one process: "
        "python train.py.\n"
    )
    assert not (tmp_path / "p" / "started").exists()
    # The same with --config and with $KERAS_SYNC_CONFIG, from another folder.
    for how in (("--config", "p/keras_sync.yaml"), ()):
        env = {} if how else {"KERAS_SYNC_CONFIG": str(tmp_path / "p" / "keras_sync.yaml")}
        result = run("launch", "-n", "2", *how, "train.py", cwd=tmp_path, **env)
        assert result.returncode == 2 and result.stderr.startswith(
            "keras-sync launch --workers 2 starts 2 workers, but strategy.kind is "
        ), result.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.slow
def test_launch_runs_script_with_its_args(tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text(
        "import os, sys; print('args', sys.argv[1:], 'tf_config' if "
        "os.environ.get('TF_CONFIG') else 'none')\n"
    )
    result = run("launch", "--workers", "2", "hello.py", "--epochs", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[w0] args ['--epochs', '1'] tf_config" in result.stdout
    assert "[w1] args ['--epochs', '1'] tf_config" in result.stdout


def test_sync_spool_bad_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.spool.jsonl").write_text("")
    result = run("sync-spool", "x.spool.jsonl", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "x.spool.jsonl" in result.stderr


# -- ui -----------------------------------------------------------------------------------------


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_ui_serves_http_on_localhost_and_stops_on_sigint(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    (tmp_path / "mlflow.db").touch()  # an empty sqlite file: mlflow server creates its tables
    # Started as a background job of a non-interactive shell is (SIGINT ignored, inherited):
    # Ctrl-C must still stop it.
    proc = subprocess.Popen(
        [KERAS_SYNC, "ui", "--port", str(port), "--no-browser"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        deadline, status = (
            time.monotonic() + 240,
            None,
        )  # mlflow server took 105 s on this loaded machine
        while time.monotonic() < deadline and proc.poll() is None and status != 200:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                    status = resp.status
            except OSError:
                time.sleep(0.5)
        assert status == 200, (
            proc.stderr.read() if proc.poll() is not None else "not ready in 240 s"
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    # Only its own lines: MLflow's (its advice to pass --host 0.0.0.0, which ui does not take, a
    # StarletteDeprecationWarning, uvicorn's log) go to the file it names.
    assert err == ""
    lines = [
        ln for ln in out.splitlines() if ln != "ready"
    ]  # "ready" once its own probe saw the server
    log = Path(lines[1].removeprefix("MLflow's own output goes to "))
    assert lines == [
        f"MLflow UI for sqlite:///{tmp_path / 'mlflow.db'} at http://127.0.0.1:{port} (Ctrl-C to stop)",
        f"MLflow's own output goes to {log}",
        "MLflow UI stopped.",
    ]
    assert log.parent == Path(tempfile.gettempdir()) and f"127.0.0.1:{port}" in log.read_text(), log
    assert (tmp_path / "mlflow.db").is_file()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)


def test_ui_without_a_store_refuses_and_creates_none(tmp_path: Path) -> None:
    result = run("ui", "--no-browser", cwd=tmp_path)
    assert result.returncode == 2
    store = tmp_path.resolve() / "mlflow.db"
    assert result.stderr == (
        f"No MLflow store at {store} (sqlite:///{store}): nothing has been logged there yet. "
        "Expected the store of a training run: run keras-sync ui in the directory you trained "
        "in, pass that run's config, or set MLFLOW_TRACKING_URI to its store.\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ui_port_in_use_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "mlflow.db").touch()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run("ui", "--port", str(port), "--no-browser", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"Invalid value for --port. Received: {port}, which is in use on 127.0.0.1. "
        "Fix: pass a free one, e.g. --port 5001.\n"
    )


def test_init_on_a_terminal_asks_with_defaults(tmp_path: Path) -> None:
    import pty

    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [KERAS_SYNC, "init"],
        cwd=tmp_path,
        env=_env(),
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        close_fds=True,
    )
    os.close(secondary)
    os.write(primary, b"mirrored\n\n")  # strategy kind; Enter keeps the default batch of 32
    output = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0, output
    assert b"Strategy kind" in output and b"Per-replica batch size [32]" in output
    text = (tmp_path / "keras_sync.yaml").read_text()
    assert "kind: mirrored" in text and "per_replica: 32" in text


@pytest.mark.parametrize("tracking_uri", [None, "sqlite:///runs/m.db"])
def test_ui_from_another_folder_finds_the_store_beside_the_config(
    tmp_path: Path, tracking_uri: str | None
) -> None:
    # Training ran in proj/ (the default store, or a relative one, resolves there); ui runs elsewhere.
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = proj / ("mlflow.db" if tracking_uri is None else "runs/m.db")
    store.parent.mkdir(parents=True)
    store.touch()
    (proj / "keras_sync.yaml").write_text("mlflow: {tracking_uri: %s}\n" % (tracking_uri or "null"))
    with (
        socket.socket() as sock
    ):  # a busy port: ui stops right after it found the store, before serving
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run(
            "ui", str(proj / "keras_sync.yaml"), "--port", str(port), "--no-browser", cwd=elsewhere
        )
    assert f"using the one beside {proj / 'keras_sync.yaml'}: {store}" in result.stdout, (
        result.stdout + result.stderr
    )
    assert "which is in use on 127.0.0.1" in result.stderr
    assert list(elsewhere.iterdir()) == []


def _path_without_this_venv() -> str:
    here = os.path.dirname(os.path.abspath(KERAS_SYNC))
    return os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.abspath(p) != here
    )


def test_init_next_line_names_the_next_commands(tmp_path: Path) -> None:
    bin_dir = Path(KERAS_SYNC).parent
    result = run(
        "init",
        "proj2",
        "--no-input",
        cwd=tmp_path,
        PATH=f"{bin_dir}{os.pathsep}{_path_without_this_venv()}",
    )
    assert result.stdout.splitlines()[-1] == "next: cd proj2 && keras-sync plan && python train.py"


def test_init_without_a_gpu_says_how_to_get_replicas_on_the_cpu(tmp_path: Path) -> None:
    result = run("init", "proj", "--no-input", cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2] == (
        f"no GPU here, so 1 replica per process; for 2 on the CPU, set strategy.simulated_cpu_replicas: 2 in "
        f"{Path('proj', 'keras_sync.yaml')}"
    )
    # one_device keeps one replica whatever the CPU split: no such line
    result = run(
        "init",
        "one",
        "--no-input",
        "--strategy",
        "one_device",
        cwd=tmp_path,
        CUDA_VISIBLE_DEVICES="",
    )
    assert [ln for ln in result.stdout.splitlines() if "GPU" in ln] == []
