"""The docs site stays true: it builds with `mkdocs build --strict`, its code blocks run, and the
troubleshooting page has an entry for every error class and exit code keras-sync has.

Code blocks in docs/ say how they are tested, on the line before the fence:

- `<!-- docs-test: fast -->`: a ```python block that runs as it is, in a fresh process, without TensorFlow;
- `<!-- docs-test: train -->`: a ```python block that trains; it runs (slow lane) as a script in an empty
  folder whose keras_sync.yaml gives 2 simulated CPU replicas (`mirrored`) and a sqlite store there;
- `<!-- docs-test: skip (why) -->`: a fragment that cannot run alone, with the reason.

Every ```python block carries one of them (a new block without one fails here), and every ```yaml block titled
`keras_sync.yaml` is loaded with `keras_sync.load_config`. `--8<-- "path"` lines (pymdownx.snippets) are read
from the repository, as the site shows them.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "reference" / "troubleshooting.md"
MARKER = re.compile(r"<!-- docs-test: (fast|train|skip)\b(.*?)-->")
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    title: str
    code: str
    marker: str | None  # fast, train, skip or None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _snippets(code: str) -> str:
    return re.sub(
        r'^--8<-- "([^"]+)"$', lambda m: (ROOT / m.group(1)).read_text(), code, flags=re.M
    )


def code_blocks() -> list[Block]:
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            title = re.search(r'title="([^"]+)"', m.group(2))
            blocks.append(
                Block(
                    str(page.relative_to(ROOT)),
                    text[: m.start()].count("\n") + 1,
                    m.group(1),
                    title.group(1) if title else "",
                    _snippets(m.group(3)),
                    marker.group(1) if marker else None,
                )
            )
    return blocks


BLOCKS = code_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


# -- the site ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mkdocs build --strict` into a temporary folder, in a process that reports whether it imported TensorFlow."""
    out = tmp_path_factory.mktemp("site")
    build = (
        "import sys\n"
        "from mkdocs.__main__ import cli\n"
        "try:\n"
        f"    cli.main(['build', '--strict', '-q', '-f', {str(ROOT / 'mkdocs.yml')!r}, '-d', {str(out)!r}],"
        " standalone_mode=False)\n"
        "finally:\n"
        "    print('imported:', sorted(m for m in ('tensorflow', 'keras', 'mlflow') if m in sys.modules))\n"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-c", build],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    )
    assert "imported: []" in result.stdout, (
        f"building the docs imported heavy modules: {result.stdout}"
    )
    return out


def test_the_site_builds_strict_and_imports_no_tensorflow(site: Path) -> None:
    assert (site / "index.html").is_file()


@pytest.mark.parametrize(
    "page, title",
    [
        ("getting-started/quickstart", "Quickstart"),
        ("how-to/kubernetes", "Kubernetes"),
        ("how-to/slurm", "Slurm"),
        ("how-to/ray-train", "Ray Train"),
        ("how-to/tpu", "TPU"),
        ("reference/troubleshooting", "Troubleshooting"),
        ("reference/config", "Config"),
        ("reference/cli", "CLI"),
        ("reference/api", "Python API"),
    ],
)
def test_the_pages_a_user_looks_for_exist_with_their_titles(
    site: Path, page: str, title: str
) -> None:
    html = (site / page / "index.html").read_text()
    assert re.search(rf"<title>{re.escape(title)}[^<]* - keras-sync</title>", html), page


def test_the_api_page_documents_sync_fit_and_the_cli_page_launch(site: Path) -> None:
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="keras_sync.Sync.fit"' in api and 'id="keras_sync.load"' in api
    cli = (site / "reference" / "cli" / "index.html").read_text()
    from keras_sync.cli import cli as group

    for name in group.commands:  # generated from the click group: every command, with its options
        assert f"keras-sync {name}" in cli, name
    assert "--max-restarts" in cli


def test_the_api_page_names_every_public_name() -> None:
    import keras_sync

    text = (DOCS / "reference" / "api.md").read_text()
    missing = [
        n
        for n in keras_sync.__all__
        if n != "__version__" and not re.search(rf"^::: [\w.]*\.{n}$", text, re.M)
    ]
    assert not missing, f"docs/reference/api.md has no `::: ...{{name}}` entry for: {missing}"


# -- code blocks ------------------------------------------------------------------------------------


def test_every_python_block_says_how_it_is_tested() -> None:
    unmarked = [b.id for b in PYTHON if b.marker is None]
    assert not unmarked, (
        "python blocks without a `<!-- docs-test: fast|train|skip (why) -->` line before them: "
        f"{unmarked}"
    )
    assert (
        len([b for b in PYTHON if b.marker == "train"]) >= 2
        and len([b for b in PYTHON if b.marker == "fast"]) >= 2
    )


@pytest.mark.parametrize("block", [b for b in PYTHON if b.marker == "fast"], ids=lambda b: b.id)
def test_fast_python_blocks_run_without_tensorflow(block: Block, tmp_path: Path) -> None:
    code = (
        block.code
        + "\nimport sys\nassert 'tensorflow' not in sys.modules, 'a fast docs block imported TensorFlow'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{block.id}:\n{result.stdout}\n{result.stderr}"


TRAIN_CONFIG = """\
strategy:
  kind: mirrored
  simulated_cpu_replicas: 2
mlflow:
  tracking_uri: sqlite:///{store}
  sync_report: "off"
"""


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if b.marker == "train"], ids=lambda b: b.id)
def test_training_blocks_run_on_two_simulated_replicas(block: Block, tmp_path: Path) -> None:
    (tmp_path / "keras_sync.yaml").write_text(TRAIN_CONFIG.format(store=tmp_path / "mlflow.db"))
    script = tmp_path / (block.title or "block.py")
    script.write_text(block.code)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI")
    }
    result = subprocess.run(
        [sys.executable, script.name, *(["--epochs", "2"] if "--epochs" in block.code else [])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, f"{block.id}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    import sqlite3

    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # the run's params, as MLflow stored them
        params = dict(
            db.execute("SELECT key, value FROM params WHERE key LIKE 'sync.num_%'").fetchall()
        )
    assert params.get("sync.num_replicas") == "2", f"{block.id}: {params}\n{result.stdout[-2000:]}"


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.lang == "yaml" and b.title == "keras_sync.yaml"],
    ids=lambda b: b.id,
)
def test_config_blocks_are_valid_configs(block: Block, tmp_path: Path) -> None:
    from keras_sync import load_config

    path = tmp_path / "keras_sync.yaml"
    path.write_text(block.code)
    load_config(path, environ={})


def stale_diff_lines(diff: str) -> list[str]:
    """The lines of a hand-written diff of examples/existing_project/ that its files no longer hold (code before a
    two-space comment; `[...]` stands for the rest of a line)."""
    example = ROOT / "examples" / "existing_project"
    plain, ours = (
        (example / "plain_keras.py").read_text(),
        (example / "keras_sync_version.py").read_text(),
    )
    files = {"+": ours, "-": plain, " ": plain}
    stale = []
    for line in diff.splitlines():
        sign, code = line[:1], line[1:].split("  #")[0].strip().split("[...]")[0]
        if code and code not in files[sign]:
            stale.append(line)
    return stale


def test_the_existing_script_diff_shows_lines_of_the_two_example_files() -> None:
    # The diff on the "existing script" page is written by hand: each of its lines must still be in the file it
    # comes from (a line renamed in examples/existing_project/ fails here until the page says so).
    (diff,) = [b for b in BLOCKS if b.lang == "diff" and b.page.endswith("existing-script.md")]
    stale = stale_diff_lines(diff.code)
    assert not stale, (
        f"lines of the diff in docs/getting-started/existing-script.md not in the examples: {stale}"
    )
    assert stale_diff_lines("+import keras_sync\n+sync = keras_sync.load_it()") == [
        "+sync = keras_sync.load_it()"
    ]


# -- troubleshooting --------------------------------------------------------------------------------


def error_classes(source: str) -> list[str]:
    """The classes of keras_sync/errors.py that derive from KerasSyncError, and KerasSyncError itself."""
    ours = {"KerasSyncError"}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in ours for b in node.bases
        ):
            ours.add(node.name)
    return sorted(ours)


def exit_codes(package: Path = ROOT / "keras_sync") -> set[int]:
    """Every exit code the package sets: a constant named `*EXIT`/`*EXIT_CODE`/`exit_code` (also in a tuple
    assignment), `exit(N)`/`_exit(N)`, and the codes the launcher documents for a signal (`130 after Ctrl-C`)."""
    codes: set[int] = set()
    for path in package.rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    pairs = (
                        zip(target.elts, node.value.elts)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)]
                    )
                    for name, value in pairs:
                        name = name.id if isinstance(name, ast.Name) else getattr(name, "attr", "")
                        if (
                            (re.search(r"EXIT(_CODE)?$", name) or name == "exit_code")
                            and isinstance(value, ast.Constant)
                            and type(value.value) is int
                        ):
                            codes.add(value.value)
            elif isinstance(node, ast.Call) and getattr(
                node.func, "attr", getattr(node.func, "id", "")
            ) in ("exit", "_exit"):
                codes |= {
                    a.value
                    for a in node.args[:1]
                    if isinstance(a, ast.Constant) and type(a.value) is int
                }
        codes |= {int(c) for c in re.findall(r"\b(\d{3}) after (?:Ctrl-C|SIG[A-Z]+)", text)}
    return codes - {0}


def missing_entries(errors_source: str, codes: set[int], page: str) -> list[str]:
    headings = re.findall(r"^#{2,3} (.+)$", page, re.M)
    missing = [
        f"## `{name}`" for name in error_classes(errors_source) if f"`{name}`" not in headings
    ]
    missing += [
        f"### Exit code {code}" for code in sorted(codes) if f"Exit code {code}" not in headings
    ]
    return missing


def test_every_error_class_and_exit_code_has_its_troubleshooting_entry() -> None:
    source = (ROOT / "keras_sync" / "errors.py").read_text()
    codes = exit_codes()
    assert {2, 75, 130, 143} <= codes, (
        f"the exit-code scan found {sorted(codes)}: too few to be right"
    )
    assert len(error_classes(source)) >= 10
    missing = missing_entries(source, codes, TROUBLESHOOTING.read_text())
    assert not missing, f"docs/reference/troubleshooting.md has no heading for: {missing}"


def test_the_troubleshooting_check_fails_for_a_new_error_class_or_exit_code() -> None:
    source = (ROOT / "keras_sync" / "errors.py").read_text() + (
        '\n\nclass QuotaError(TrackingError):\n    """New."""\n'
    )
    page = TROUBLESHOOTING.read_text()
    assert missing_entries(source, exit_codes() | {76}, page) == [
        "## `QuotaError`",
        "### Exit code 76",
    ]


def test_each_message_heading_is_under_its_error_class() -> None:
    # The page's message headings (### `...`) sit under a `## `Class`` heading that keras_sync/errors.py defines.
    classes = set(error_classes((ROOT / "keras_sync" / "errors.py").read_text()))
    section = None
    for level, title in re.findall(r"^(#{2,3}) (.+)$", TROUBLESHOOTING.read_text(), re.M):
        if level == "##":
            section = title.strip("`")
        elif title.startswith("`"):
            assert section in classes, (
                f"message heading {title} is under {section!r}, not an error class"
            )
