"""The README's first two commands are the ones CI and a new user run: keep them true. The README stays short (a
user's first page; the rest is the docs site), and its tables and the docs' follow the code."""

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


# The README's command table and the docs' kinds sentence and metrics table are the user's map of the code: each
# test below fails when a command, a strategy kind or a logged metric is added to the code and its row is not.
KINDS_PAGE = "docs/concepts/scaling.md"
METRICS_PAGE = "docs/reference/metrics.md"


def _section(title: str, page: str = "README.md") -> str:
    text = (ROOT / page).read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_command_table_lists_exactly_the_cli_commands():
    from keras_sync.cli import cli

    table = _section("Command line")
    listed = set(re.findall(r"^\| `keras-sync ([\w-]+)", table, flags=re.M))
    assert listed == set(cli.commands), (
        f"README command table {sorted(listed)} vs the CLI {sorted(cli.commands)}"
    )


def test_feature_list_names_every_strategy_kind():
    from keras_sync.config.kinds import KINDS

    sentence = re.search(
        r"`strategy\.kind` picks (.*?)\s+with their real options",
        _section("Strategy kinds", KINDS_PAGE),
        flags=re.S,
    )
    assert sentence, f"{KINDS_PAGE} 'Strategy kinds' lost its 'strategy.kind picks ...' sentence"
    listed = set(re.findall(r"`(\w+)`", sentence.group(1)))
    assert listed == set(KINDS), (
        f"{KINDS_PAGE} names kinds {sorted(listed)}; the kinds table has {sorted(KINDS)}"
    )


def _logged_metric_names(paths=None) -> set[str]:
    names: set[str] = set()
    for path in paths or (ROOT / "keras_sync").rglob("*.py"):
        for name in re.findall(r"""f?["'](sync/[\w{}/]+)["']""", path.read_text()):
            names.add(re.sub(r"(replica|worker)_\d+", r"\1_{i}", re.sub(r"\{\w+\}", "{i}", name)))
    return names


def test_metrics_table_has_a_row_for_every_metric_the_code_logs():
    table = _section("Sync metrics in MLflow", METRICS_PAGE)
    logged = _logged_metric_names()
    assert len(logged) >= 10, (
        f"the metric-name scan found too few names to be right: {sorted(logged)}"
    )
    missing = sorted(n for n in logged if f"`{n}`" not in table)
    assert not missing, (
        f"metrics logged by keras_sync/ with no row in {METRICS_PAGE}'s 'Sync metrics in MLflow' table: {missing}"
    )


def test_sync_metrics_docstring_names_every_step_metric():
    # SyncMetrics's class docstring lists its metrics for `help()` readers: a per-step metric added to it (or
    # to the reductions it logs) without a line there fails here, as a metrics-page row does above.
    import ast

    source = ROOT / "keras_sync" / "callbacks" / "sync_metrics.py"
    tree = ast.parse(source.read_text())
    doc = next(
        ast.get_docstring(n)
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "SyncMetrics"
    )
    logged = _logged_metric_names([source, *(ROOT / "keras_sync" / "measures").glob("*.py")])
    assert len(logged) >= 10, (
        f"the metric-name scan found too few names to be right: {sorted(logged)}"
    )
    missing = sorted(n for n in logged if f"``{n}``" not in doc)
    assert not missing, f"metrics SyncMetrics logs that its docstring does not name: {missing}"


def test_metrics_table_names_only_metrics_the_code_logs():
    # The other direction: a metric renamed or removed in the code leaves no stale row behind.
    rows = [
        line.split("|")[1]
        for line in _section("Sync metrics in MLflow", METRICS_PAGE).splitlines()
        if line.startswith("| `")
    ]
    listed = {n for cell in rows for n in re.findall(r"`(sync/[\w{}/]+)`", cell)}
    assert len(listed) >= 10, (
        f"the {METRICS_PAGE} metric rows scan found too few names to be right: {sorted(listed)}"
    )
    stale = sorted(listed - _logged_metric_names())
    assert not stale, (
        f"{METRICS_PAGE}'s 'Sync metrics in MLflow' table names metrics keras_sync/ does not log: {stale}"
    )


def test_readme_is_short_and_reads_as_documentation():
    # What a user reads first: at most 250 lines of at most 160 characters, without measured figures, timings
    # or issue numbers (those go to the docs' benchmarks, the changelog and commit messages).
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines; move detail to docs/ (at most 250)"
    )
    long = [f"{i}: {len(line)}" for i, line in enumerate(lines, 1) if len(line) > 160]
    assert not long, f"README.md lines over 160 characters (line: length): {long}"
    text = re.sub(
        r"```.*?```", "", "\n".join(lines), flags=re.S
    )  # prose: code (`Adam(1e-3)`) is no figure
    figures = re.findall(
        r"\b\d+(?:\.\d+)?e-\d+\b|\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)?\s?(?:ms|us|%)(?!\w)"
        r"|\b\d+\.\d+\s?s\b",
        text,
    )
    assert not figures, (
        f"README.md has measured figures (say it, and name the test, in docs/): {figures}"
    )
    assert not re.search(r"\bmeasured\b", text, re.I), (
        "README.md says 'measured': the figure belongs in docs/benchmarks.md"
    )
    issues = re.findall(r"(?i)\bissue\s+\d+|[\w/-]*#\d+", text)
    assert not issues, f"README.md names issue numbers: {issues}"


def test_readme_change_to_a_plain_script_matches_the_example():
    # The three lines are shown as a diff of examples/existing_project/: each line must be in the file it comes from.
    from test_docs import stale_diff_lines

    (diff,) = re.findall(r"```diff\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    assert not stale_diff_lines(diff), (
        f"README's diff has lines not in the examples: {stale_diff_lines(diff)}"
    )


def test_readme_config_is_a_valid_config(tmp_path):
    from keras_sync import load_config

    blocks = re.findall(r"```yaml\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "README.md lost its YAML example"
    for block in blocks:
        (tmp_path / "keras_sync.yaml").write_text(block)
        load_config(tmp_path / "keras_sync.yaml", environ={})
