"""What `keras-sync init` writes, from the templates shipped in the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from keras_sync.config import DEFAULT_CONFIG_FILE
from keras_sync.config.kinds import KINDS, LAYOUT_LOCAL
from keras_sync.errors import UsageError


def _template(name: str) -> str:
    return resources.files("keras_sync.templates").joinpath(name).read_text(encoding="utf-8")


def render_config(kind: str = "auto", per_replica_batch: int = 32) -> str:
    """The text of a commented ``keras_sync.yaml`` for strategy `kind` (one of `KINDS`).

    >>> "kind: mirrored" in render_config("mirrored", 64)
    True
    """
    # Plain replacement, not string.Template: the comments mention $MLFLOW_TRACKING_URI and friends.
    strategy = _template(f"strategy_{kind}.yaml").rstrip("\n")
    text = _template(DEFAULT_CONFIG_FILE).replace("${strategy}", strategy)
    return text.replace("${per_replica}", str(per_replica_batch))


def cpu_replicas_hint(kind: str, config_path: str | Path, *, gpus: int) -> str | None:
    """How to get several replicas on a machine without a GPU; None where it does not apply.

    >>> cpu_replicas_hint("one_device", "keras_sync.yaml", gpus=0) is None
    True
    """
    spec = KINDS[kind]
    if gpus or not spec.simulated_cpus or spec.layout != LAYOUT_LOCAL:  # one_device: one replica
        return None
    return (
        "no GPU here, so 1 replica per process; for 2 on the CPU, set "
        f"strategy.simulated_cpu_replicas: 2 in {config_path}"
    )


def init_project(
    directory: str | Path = ".",
    *,
    kind: str = "auto",
    per_replica_batch: int = 32,
    force: bool = False,
) -> list[Path]:
    """Write ``keras_sync.yaml`` and ``train.py`` into `directory` (created if needed); their paths.

    Every target is checked before any is written: without `force`, nothing is overwritten.
    """
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"Invalid value for argument `directory`. Received: {str(root)!r}, which is a file. "
            "Expected a directory (it is created if missing)."
        )
    contents = {
        root / DEFAULT_CONFIG_FILE: render_config(kind, per_replica_batch),
        root / "train.py": _template("train.py"),
    }
    existing = [p for p in contents if p.exists()]
    if existing and not force:
        names = " and ".join(str(p) for p in existing)
        raise UsageError(
            f"Refusing to overwrite {names}: {'it exists' if len(existing) == 1 else 'they exist'}, "
            "so nothing was written. Pass --force to overwrite, or choose another directory."
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        for path, text in contents.items():
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"Cannot write into {str(root)!r}: {exc.strerror or exc}. "
            "Expected a writable directory; choose another one."
        ) from None
    return list(contents)
