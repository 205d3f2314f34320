"""Every example runs as a user would run it (short settings), in its own process."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = (
    pytest.mark.slow
)  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Start every example at once (2 cores; each is mostly TensorFlow start-up), then collect."""
    root = tmp_path_factory.mktemp("examples")
    project = root / "existing_project"
    shutil.copytree(EXAMPLES / "existing_project", project)
    runs = {
        "quickstart": ([str(EXAMPLES / "quickstart.py"), "--epochs", "2"], root / "q"),
        "tfdata": (
            [
                str(EXAMPLES / "tfdata_pipeline.py"),
                "--epochs",
                "2",
                "--data-dir",
                str(root / "data"),
            ],
            root / "t",
        ),
        "plain": ([str(project / "plain_keras.py"), "--epochs", "2"], project),
        "synced": ([str(project / "keras_sync_version.py"), "--epochs", "2"], project),
    }
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for var in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    procs = {}
    for name, (args, cwd) in runs.items():
        cwd.mkdir(exist_ok=True)
        procs[name] = subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{text[-3000:]}"
        out[name] = text
    out["root"] = root
    return out


def test_quickstart_prints_replicas_batch_and_scaled_lr(outputs):
    text = outputs["quickstart"]
    assert "strategy=mirrored replicas=2 workers=1" in text
    assert "per-replica batch=32 global batch=64" in text
    assert "learning rate: base=0.05 scaled=0.1 (linear) warmup_steps=20" in text
    loss = float(re.search(r"final: loss=([0-9.]+)", text).group(1))
    assert loss < 0.69, "two epochs should beat chance (ln 2) on the spirals"
    assert (outputs["root"] / "q" / "mlflow.db").exists(), (
        "mlflow.enabled: the default sqlite store is used"
    )


def test_tfdata_example_trains_from_tfrecord_shards(outputs):
    text = outputs["tfdata"]
    assert "files=4 replicas=2 global batch=64" in text
    assert len(list((outputs["root"] / "data").glob("*.tfrecord"))) == 4
    assert float(re.search(r"final: accuracy=([0-9.]+)", text).group(1)) > 0.7


def test_existing_project_both_versions_train(outputs):
    plain = float(re.search(r"final val_loss=([0-9.]+)", outputs["plain"]).group(1))
    synced = float(re.search(r"final val_loss=([0-9.]+)", outputs["synced"]).group(1))
    assert plain < 1.0 and synced < 1.0


def test_existing_project_diff_is_the_promised_lines():
    plain = (EXAMPLES / "existing_project" / "plain_keras.py").read_text().splitlines()
    synced = (EXAMPLES / "existing_project" / "keras_sync_version.py").read_text().splitlines()
    added = [l for l in difflib.ndiff(plain, synced) if l.startswith("+ ")]
    marked = [l for l in added if l.rstrip().endswith("# keras-sync") or "# keras-sync:" in l]
    # load, scope, compile with the scaled LR, fit, and the import: five marked lines ...
    assert len(marked) == 5, marked
    # ... the rest of the difference is the model block indented under `with sync.scope():`.
    unmarked = [l[2:] for l in added if "# keras-sync" not in l and l[2:].strip()]
    indented = {l.strip() for l in unmarked}
    assert indented <= {l.strip() for l in plain} | {
        "Compare with plain_keras.py: the difference is the few lines marked `# keras-sync` here."
    }, unmarked
