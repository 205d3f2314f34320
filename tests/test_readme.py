"""The README's first two commands are the ones CI and a new user run: keep them true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_starts_with_install_and_test_commands():
    install, tests = bash_blocks()[:2]
    # A fresh venv has no TensorFlow: the install command brings one with the `cpu` extra.
    assert 'pip install -e ".[cpu]"' in install and "examples/quickstart.py" in install
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    # .ci/run notes the main suite's exit code (the compatibility lanes run beside it) and ends with both.
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert f"{bash_blocks()[1].strip()} || main=$?" in ci


def test_readme_names_every_public_api_entry():
    import keras_sync

    text = (ROOT / "README.md").read_text()
    missing = [n for n in keras_sync.__all__ if n != "__version__" and n not in text]
    assert not missing, f"README does not mention: {missing}"
