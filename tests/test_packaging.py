"""keras-sync installs into a project's environment without bringing a second TensorFlow.

`tensorflow` and `tensorflow-cpu` are two distributions of one `tensorflow` package: a resolver
that installs both silently replaces one build with the other. These tests read the declared
dependencies, resolve a real install into this environment with pip (`--dry-run`, nothing is
written) and check what a user without TensorFlow is told.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every distribution that writes the `tensorflow` package (pip sees them as unrelated projects).
TENSORFLOW_DISTRIBUTIONS = {
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tf-nightly",
    "tf-nightly-cpu",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the main suite runs there
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_core_dependencies_name_no_tensorflow_distribution():
    deps = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    assert deps, "no dependencies parsed: the check would be vacuous"
    assert not deps & TENSORFLOW_DISTRIBUTIONS


def test_each_tensorflow_extra_names_exactly_one_distribution():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {_name(r) for r in extras["cpu"]} == {"tensorflow-cpu"}
    assert {_name(r) for r in extras["tensorflow"]} == {"tensorflow"}
    assert {_name(r) for r in extras["and-cuda"]} == {"tensorflow"}


def _dry_run(tmp_path: Path, *requirements: str) -> list[str]:
    """Names of the distributions pip would install, as its JSON report lists them."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--report",
        str(report),
        *requirements,
    ]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [
        item["metadata"]["name"].lower().replace("_", "-")
        for item in json.loads(report.read_text())["install"]
    ]


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.timeout(600)
def test_install_into_an_environment_with_tensorflow_adds_none(tmp_path):
    # Run in the main venv (tensorflow-cpu) and in the CI lanes (tensorflow-cpu 2.17 on Python 3.10,
    # the standard `tensorflow` 2.21 on Python 3.13): pip resolves keras-sync against what is there.
    from importlib import metadata

    installed = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()}
    installed &= TENSORFLOW_DISTRIBUTIONS
    assert len(installed) == 1, f"this test needs one TensorFlow installed, found {installed}"
    names = _dry_run(tmp_path, str(ROOT))
    assert "keras-sync" in names
    assert not set(names) & TENSORFLOW_DISTRIBUTIONS


@pytest.mark.compat
def test_without_tensorflow_load_says_how_to_install_it_in_one_line():
    # `None` in sys.modules makes `import tensorflow` fail exactly as in an environment without it.
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "import keras_sync\n"
        "keras_sync.load({'mlflow': {'enabled': False}})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "keras-sync: config: a dict passed to keras_sync.load() (no file); starting TensorFlow and the default "
        "strategy",  # the first line comes before TensorFlow is imported
        f"keras-sync: TensorFlow is not installed in this environment ({sys.executable}); keras-sync uses the "
        'TensorFlow of your project and installs none itself. Fix: pip install "keras-sync[cpu]" '
        '(tensorflow-cpu), "keras-sync[tensorflow]" (the standard build; GPU with a system CUDA) or '
        '"keras-sync[and-cuda]" (GPU with CUDA from pip).',
    ]


def test_every_subpackage_is_in_the_wheel():
    # An editable install finds any subpackage; a wheel has only those listed (keras_sync.cli was not).
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "keras_sync").rglob("__init__.py")
    }
    assert found, "no package found: the check would be vacuous"
    assert found <= listed, f"not in [tool.setuptools] packages: {sorted(found - listed)}"
