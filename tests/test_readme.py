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


# The README's tables are the user's map of the code: each test below fails when a command, a
# strategy kind or a logged metric is added to the code and its README row is not.

def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_command_table_lists_exactly_the_cli_commands():
    from keras_sync.cli import cli

    table = _section("Command line")
    listed = set(re.findall(r"^\| `keras-sync ([\w-]+)", table, flags=re.M))
    assert listed == set(cli.commands), f"README command table {sorted(listed)} vs the CLI {sorted(cli.commands)}"


def test_feature_list_names_every_strategy_kind():
    from keras_sync.config.kinds import KINDS

    sentence = re.search(r"`strategy\.kind` picks (.*?)\s+with their real options", _section("What keras-sync does for you"), flags=re.S)
    assert sentence, "README 'What keras-sync does for you' lost its 'strategy.kind picks ...' sentence"
    listed = set(re.findall(r"`(\w+)`", sentence.group(1)))
    assert listed == set(KINDS), f"README names kinds {sorted(listed)}; the kinds table has {sorted(KINDS)}"


def _logged_metric_names(paths=None) -> set[str]:
    names: set[str] = set()
    for path in paths or (ROOT / "keras_sync").rglob("*.py"):
        for name in re.findall(r"""f?["'](sync/[\w{}/]+)["']""", path.read_text()):
            names.add(re.sub(r"(replica|worker)_\d+", r"\1_{i}", re.sub(r"\{\w+\}", "{i}", name)))
    return names


def test_metrics_table_has_a_row_for_every_metric_the_code_logs():
    table = _section("Sync metrics in MLflow")
    logged = _logged_metric_names()
    assert len(logged) >= 10, f"the metric-name scan found too few names to be right: {sorted(logged)}"
    missing = sorted(n for n in logged if f"`{n}`" not in table)
    assert not missing, f"metrics logged by keras_sync/ with no row in README's 'Sync metrics in MLflow' table: {missing}"


def test_sync_metrics_docstring_names_every_step_metric():
    # SyncMetrics's class docstring lists its metrics for `help()` readers: a per-step metric added to it (or
    # to the reductions it logs) without a line there fails here, as a README row does above.
    import ast

    source = ROOT / "keras_sync" / "callbacks" / "sync_metrics.py"
    tree = ast.parse(source.read_text())
    doc = next(ast.get_docstring(n) for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SyncMetrics")
    logged = _logged_metric_names([source, *(ROOT / "keras_sync" / "measures").glob("*.py")])
    assert len(logged) >= 10, f"the metric-name scan found too few names to be right: {sorted(logged)}"
    missing = sorted(n for n in logged if f"``{n}``" not in doc)
    assert not missing, f"metrics SyncMetrics logs that its docstring does not name: {missing}"


def test_metrics_table_names_only_metrics_the_code_logs():
    # The other direction: a metric renamed or removed in the code leaves no stale row behind.
    rows = [line.split("|")[1] for line in _section("Sync metrics in MLflow").splitlines() if line.startswith("| `")]
    listed = {n for cell in rows for n in re.findall(r"`(sync/[\w{}/]+)`", cell)}
    assert len(listed) >= 10, f"the README metric rows scan found too few names to be right: {sorted(listed)}"
    stale = sorted(listed - _logged_metric_names())
    assert not stale, f"README's 'Sync metrics in MLflow' table names metrics keras_sync/ does not log: {stale}"
