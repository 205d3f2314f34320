"""keras_sync.upstream.tf_import: TensorFlow's early absl INFO lines (which ignore TF_CPP_MIN_LOG_LEVEL on
AMX/AVX512-VNNI CPUs) are held back at import; everything else reaches stderr as it came.

A stand-in `tensorflow` package writes the lines TF 2.21 printed here straight to fd 2, so the
test does not depend on the CPU it runs on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from keras_sync.upstream.tf_import import quiet_lines

BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = (
    "I0000 00:00:1796123769.122809    8780 port.cc:153] oneDNN custom operations are on. You may see "
    "slightly different numerical results due to floating-point round-off errors from different computation "
    "orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`."
)
GUARD = (
    "I0000 00:00:1796123769.182773    8780 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations."
)
GUARD2 = "To enable the following instructions: AVX2 AVX512F AMX_TILE, in other operations, rebuild TensorFlow."
WARN = "W0000 00:00:1796123769.2    8780 gpu_device.cc:2342] Cannot dlopen some GPU libraries."
EARLY = [BANNER, ONEDNN, GUARD, GUARD2, WARN, "a line of the user's own", BANNER, ONEDNN]


def test_quiet_lines_drops_info_and_the_banner_keeps_the_rest() -> None:
    raw = "".join(line + "\n" for line in EARLY).encode()
    assert quiet_lines(raw).decode() == WARN + "\na line of the user's own\n"
    assert quiet_lines(b"") == b""
    assert quiet_lines(b"no newline at the end") == b"no newline at the end"


def _fake_tf(tmp: Path, *, fail: bool = False) -> Path:
    pkg = tmp / "tensorflow"
    pkg.mkdir()
    body = "import os\n" + "".join(
        f"os.write(2, {(line + chr(10)).encode()!r})\n" for line in EARLY
    )
    body += "import sys\nprint('python-level warning', file=sys.stderr)\n"
    if fail:
        body += (
            "raise ImportError('libtensorflow_framework.so.2: cannot open shared object file')\n"
        )
    (pkg / "__init__.py").write_text(body)
    return tmp


def _import(tmp: Path, level: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    code = textwrap.dedent("""
        import sys
        from keras_sync.upstream.tf_import import import_tensorflow
        print("before", file=sys.stderr, flush=True)
        import_tensorflow()
        print("after", file=sys.stderr)
    """)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_holds_back_info_lines_at_level_1(tmp_path: Path) -> None:
    r = _import(_fake_tf(tmp_path), "1")
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"before\n{WARN}\na line of the user's own\npython-level warning\nafter\n"


def test_level_0_or_unset_shows_everything(tmp_path: Path) -> None:
    _fake_tf(tmp_path)
    for level in ("0", None):
        r = _import(tmp_path, level)
        assert r.returncode == 0, r.stderr
        assert r.stderr.splitlines() == ["before", *EARLY, "python-level warning", "after"]


def test_failed_import_shows_everything_and_raises(tmp_path: Path) -> None:
    r = _import(_fake_tf(tmp_path, fail=True), "1")
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert lines[: len(EARLY) + 2] == ["before", *EARLY, "python-level warning"]
    assert "ImportError: libtensorflow_framework.so.2" in r.stderr and "after" not in lines


_FIT = textwrap.dedent("""
    import sys
    import numpy as np
    import keras_sync

    sync = keras_sync.load({"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
                            "mlflow": {"enabled": False}})
    import keras
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    history = sync.fit(model, x, x[:, :1], epochs=2, verbose=0)
    print("loss", history.history["loss"][-1], file=sys.stderr, flush=True)
    # A real warning of TensorFlow's C++ side, later in the run: it must still show.
    it = iter(tf.data.Dataset.range(10).cache())
    next(it)
    del it
""")
OPTIMIZED = (
    "will not be optimized because the dataset does not implement the AsGraphDefInternal() method"
)


@pytest.mark.slow
def test_the_per_device_dataset_warning_is_gone_and_real_warnings_stay(tmp_path: Path) -> None:
    def run(level: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        if level is not None:
            env["TF_CPP_MIN_LOG_LEVEL"] = level
        return subprocess.run(
            [sys.executable, "-c", _FIT],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )

    quiet, everything = run(None), run("0")
    for r in (quiet, everything):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "The calling iterator did not fully read the dataset being cached" in r.stderr
    # TensorFlow's MultiDeviceIterator feeds each device through a generator dataset that tf.data
    # cannot rewrite: it said so on every run. At level 0 it still does (a canary: when this fails,
    # TensorFlow stopped warning and keras_sync.upstream.tf_import.quiet_device_datasets can go).
    assert OPTIMIZED in everything.stderr
    assert OPTIMIZED not in quiet.stderr, quiet.stderr[-3000:]
    # Nothing the model computes changes.
    loss = [line for line in quiet.stderr.splitlines() if line.startswith("loss ")]
    assert loss and loss == [
        line for line in everything.stderr.splitlines() if line.startswith("loss ")
    ]
