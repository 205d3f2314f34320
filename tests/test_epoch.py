"""An epoch trained as on one device: an uneven last batch, `batch_size` given to fit, run-time checks.

Logical CPU devices are fixed once per process, so one device and 2 mirrored replicas each run
tests/_epoch_scenarios.py in their own subprocess (both at once); the tests compare what they recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # starts TensorFlow processes; the fast lane is `pytest -m "not slow"`

HERE = Path(__file__).parent
COUNTS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("epoch")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    procs = {n: subprocess.Popen([sys.executable, str(HERE / "_epoch_scenarios.py"), str(n), str(out / f"{n}.json")],
                                 cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in COUNTS}
    results = {}
    for n, proc in procs.items():
        log, _ = proc.communicate(timeout=480)
        assert proc.returncode == 0, f"scenario process {n} failed:\n{log[-4000:]}"
        results[n] = json.loads((out / f"{n}.json").read_text())
    for n, r in results.items():
        bad = {k: v for k, v in r.items() if isinstance(v, dict) and "unexpected" in v}
        assert not bad, f"{n}: " + json.dumps(bad, indent=1)
    return results


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float((np.abs(a - b) / np.maximum(np.abs(a), 1e-12)).max())


def test_uneven_last_batch_equals_one_device(runs):
    """331 examples at global batch 32: the last batch of 11 splits 6/5 over 2 replicas (Keras alone:
    weights 1.8e-2 off one device, val_loss 0.28%, evaluate 0.067%)."""
    one, two = runs[1]["uneven_last_batch"], runs[2]["uneven_last_batch"]
    assert float(np.abs(np.array(one["weights"]) - np.array(two["weights"])).max()) <= 1e-5
    for key in ("loss", "val_loss", "mae"):
        assert rel(one[key], two[key]) <= 1e-5, (key, one[key], two[key])
    for key in ("loss", "mae"):
        assert rel(one["evaluate"][key], two["evaluate"][key]) <= 1e-5, (key, one["evaluate"], two["evaluate"])
