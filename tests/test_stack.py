"""The Keras backend and the TensorFlow distributions (`keras_sync.upstream.stack`): read without importing
them, refused at `keras_sync.load()` in one line (exit code 2, no MLflow run), shown by
`keras-sync env` and `keras-sync plan`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_sync.errors import UsageError
from keras_sync.upstream import stack

KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "KERAS_BACKEND",
            "KERAS_HOME",
            "TF_CONFIG",
            "KERAS_SYNC_CONFIG",
            "MLFLOW_TRACKING_URI",
        )
    }
    env.update(extra)
    return env


def test_the_backend_comes_from_the_variable_then_keras_json_then_the_default(
    tmp_path: Path,
) -> None:
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch", "floatx": "float32"}))
    assert stack.keras_backend({"KERAS_BACKEND": "jax", "KERAS_HOME": str(tmp_path)}) == (
        "jax",
        "$KERAS_BACKEND",
    )
    assert stack.keras_backend({"KERAS_HOME": str(tmp_path)}) == (
        "torch",
        str(tmp_path / "keras.json"),
    )
    assert stack.keras_backend({"KERAS_HOME": str(tmp_path / "none")}) == ("tensorflow", "default")


def test_another_backend_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as e:
        stack.check_backend({"KERAS_BACKEND": "jax"})
    assert str(e.value) == (
        "Keras uses the jax backend (KERAS_BACKEND=jax), and keras-sync distributes training with TensorFlow "
        "strategies, which need Keras's tensorflow backend. Fix: set KERAS_BACKEND=tensorflow (or unset it) before "
        "Keras is imported."
    )
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
    with pytest.raises(
        UsageError, match=r'^Keras uses the torch backend \("backend": "torch" in .*keras.json\)'
    ):
        stack.check_backend({"KERAS_HOME": str(tmp_path)})
    stack.check_backend({"KERAS_BACKEND": "tensorflow"})


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_load_stops_on_another_backend_with_exit_code_2_and_no_run(
    tmp_path: Path, backend: str
) -> None:
    # Before: load went on, and sync.fit said "The model was built outside sync.scope()", which is false.
    script = (
        "import keras_sync\nkeras_sync.load({'mlflow': {'tracking_uri': 'sqlite:///ks.db'}})\n"
        "print('not reached')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr == (
        f"keras-sync: Keras uses the {backend} backend (KERAS_BACKEND={backend}), and keras-sync "
        "distributes training with TensorFlow strategies, which need Keras's tensorflow backend. Fix: set "
        "KERAS_BACKEND=tensorflow (or unset it) before Keras is imported.\n"
    )
    assert not (tmp_path / "ks.db").exists() and not (tmp_path / "mlflow.db").exists()


def test_two_tensorflow_distributions_are_named_with_the_fix() -> None:
    text = stack.describe_tensorflow([("tensorflow", "2.21.0"), ("tensorflow-cpu", "2.21.0")])
    assert text == (
        "tensorflow 2.21.0, tensorflow-cpu 2.21.0 (2 distributions of one `tensorflow` package: they "
        "overwrite each other's files; keep one, e.g. pip uninstall tensorflow-cpu)"
    )
    assert stack.describe_tensorflow([]) == "not installed"


def _second_tensorflow(tmp_path: Path) -> Path:
    """A directory with the metadata of a second TensorFlow distribution (what pip leaves)."""
    info = tmp_path / "site" / "tf_nightly-2.22.0.dev20261201.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tf-nightly\nVersion: 2.22.0.dev20261201\n"
    )
    return tmp_path / "site"


def test_env_and_plan_show_the_backend_and_every_tensorflow_distribution(tmp_path: Path) -> None:
    installed = stack.tensorflow_distributions()
    assert len(installed) == 1, installed  # this venv: tensorflow-cpu alone
    site = _second_tensorflow(tmp_path)
    env = _env(PYTHONPATH=str(site), KERAS_BACKEND="jax")
    report = subprocess.run(
        [KERAS_SYNC, "env", "--no-devices"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    name, version = installed[0]
    both = sorted([(name, version), ("tf-nightly", "2.22.0.dev20261201")])
    assert f"- TensorFlow: {stack.describe_tensorflow(both)}\n" in report.stdout
    assert "(2 distributions of one `tensorflow` package" in report.stdout
    assert "- Keras backend: jax (from $KERAS_BACKEND)\n" in report.stdout
    plan = subprocess.run(
        [KERAS_SYNC, "plan"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert plan.returncode == 0, plan.stderr
    lines = {line.split()[0]: line for line in plan.stdout.splitlines()[1:]}
    assert (
        "jax" in lines["keras.backend"]
        and "keras_sync.load() refuses this" in lines["keras.backend"]
    )
    assert "2 distributions of one `tensorflow` package" in lines["tensorflow"]


_EARLY_COURIER = r"""
import os, sys
import keras_sync.strategy as strategy_module

built = strategy_module.build_strategy


def couriers():
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"keras_sync.tracking.courier_main" in argv:
            out.append(int(pid))
    return out


def watched(cfg, *args, **kwargs):
    import time

    tf_before = "tensorflow" in sys.modules
    deadline = time.monotonic() + 60  # the writer's thread starts it: give it time on a busy machine
    while not couriers() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("courier before the strategy:", bool(couriers()), "tensorflow imported:", tf_before, flush=True)
    return built(cfg, *args, **kwargs)


strategy_module.build_strategy = watched
import keras_sync
devices = sys.argv[1:]
config = {"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "mlflow": {"tracking_uri": "sqlite:///ks.db"}}
if devices:
    config["strategy"] = {"kind": "mirrored", "devices": devices}
keras_sync.load(config)
print("loaded", flush=True)
"""


def test_a_one_process_job_starts_its_courier_before_tensorflow_and_a_failed_load_leaves_nothing(
    tmp_path: Path,
) -> None:
    """The courier imports MLflow (~2 s of a core) while TensorFlow is imported, not during the first fit
    (measured with two busy loops beside a 200-step fit: the import competed with training). A load that
    fails after it started leaves no store, no spool folder and no run."""
    ok = subprocess.run(
        [sys.executable, "-c", _EARLY_COURIER],
        cwd=tmp_path,
        env=_env(TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.splitlines() == [
        "courier before the strategy: True tensorflow imported: False",
        "loaded",
    ]
    assert not (tmp_path / "ks.db").exists()  # nothing logged yet: the store is made with the run

    failed = tmp_path / "failed"
    failed.mkdir()
    bad = subprocess.run(
        [sys.executable, "-c", _EARLY_COURIER, "/gpu:7"],
        cwd=failed,
        env=_env(TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stdout.splitlines() == [
        "courier before the strategy: True tensorflow imported: False"
    ]
    # The first line comes before TensorFlow starts; the refusal is keras-sync's next line.
    # TensorFlow's own C++ log lines (absl's banner and "I0000 00:00:..." lines) are not keras-sync's.
    lines = [
        line
        for line in bad.stderr.splitlines()
        if not line.startswith("WARNING:") and not re.match(r"[IWEF]\d{4} \d\d:\d\d:", line)
    ]
    assert lines[0].startswith("keras-sync: config: "), bad.stderr
    assert lines[1].startswith(
        "keras-sync: Invalid value for strategy.devices. Received: '/gpu:7'."
    ), bad.stderr
    assert len(lines) == 2, bad.stderr
    assert sorted(p.name for p in failed.iterdir()) == []
