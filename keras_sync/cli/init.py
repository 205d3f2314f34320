from __future__ import annotations

import shlex
import sys
from importlib import resources
from pathlib import Path

import click

from keras_sync.cli._base import UserError
from keras_sync.config import DEFAULT_CONFIG_FILE, STRATEGY_KINDS


def _template(name: str) -> str:
    return resources.files("keras_sync.templates").joinpath(name).read_text(encoding="utf-8")


def render_config(kind: str = "auto", per_replica_batch: int = 32) -> str:
    """The text of a commented ``keras_sync.yaml`` (not string.Template: it mentions $VARS)."""
    strategy = _template(f"strategy_{kind}.yaml").rstrip("\n")
    text = _template(DEFAULT_CONFIG_FILE).replace("${strategy}", strategy)
    return text.replace("${per_replica}", str(per_replica_batch))


@click.command("init")
@click.argument("directory", required=False, default=".", type=click.Path(file_okay=False))
@click.option(
    "--strategy",
    "kind",
    type=click.Choice(STRATEGY_KINDS, case_sensitive=False),
    help="Strategy kind (default: auto).",
)
@click.option(
    "--per-replica-batch",
    type=click.IntRange(min=1),
    help="Examples per replica per step (default: 32).",
)
@click.option("--force", is_flag=True, help="Overwrite keras_sync.yaml and train.py if they exist.")
@click.option(
    "--no-input", is_flag=True, help="Ask nothing; use the defaults for what is not given."
)
def command(
    directory: str, kind: str | None, per_replica_batch: int | None, force: bool, no_input: bool
) -> None:
    """Write keras_sync.yaml and train.py into DIRECTORY (default: here).

    On a terminal it asks for the strategy and the batch; with --no-input, or when not on a
    terminal, it uses the defaults. Never overwrites a file without --force.
    """
    from keras_sync.config.kinds import KINDS, LAYOUT_LOCAL
    from keras_sync.strategy import count_gpus_cheaply

    batch = per_replica_batch
    if not no_input and sys.stdin.isatty():
        kind = kind or click.prompt("Strategy kind", "auto", type=click.Choice(STRATEGY_KINDS))
        batch = batch or click.prompt("Per-replica batch size", 32, type=click.IntRange(min=1))
    root, kind, batch = Path(directory), (kind or "auto").lower(), batch or 32
    config = root / DEFAULT_CONFIG_FILE
    contents = {config: render_config(kind, batch), root / "train.py": _template("train.py")}
    # Every target is checked before any is written: without --force, nothing is overwritten.
    if (existing := [p for p in contents if p.exists()]) and not force:
        raise UserError(
            f"Refusing to overwrite {' and '.join(map(str, existing))}: "
            f"{'it exists' if len(existing) == 1 else 'they exist'}, so nothing was written. "
            "Pass --force to overwrite, or choose another directory."
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        for path, text in contents.items():
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        fix = "Expected a writable directory; choose another one."
        raise UserError(f"Cannot write into {str(root)!r}: {exc.strerror or exc}. {fix}") from None
    click.echo("\n".join(f"wrote {path}" for path in contents))
    spec = KINDS[kind]  # without a GPU, one replica per process unless the CPU is split
    if not count_gpus_cheaply() and spec.simulated_cpus and spec.layout == LAYOUT_LOCAL:
        click.echo(
            "no GPU here, so 1 replica per process; for 2 on the CPU, set "
            f"strategy.simulated_cpu_replicas: 2 in {config}"
        )
    click.echo(f"next: cd {shlex.quote(directory)} && keras-sync plan && python train.py")
