"""What `keras-sync init` writes: a commented ``keras_sync.yaml`` and a ``train.py`` that runs as is,
from the templates shipped in the package. Every target is checked before any is written."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from keras_sync.config import DEFAULT_CONFIG_FILE, STRATEGY_KINDS
from keras_sync.config.kinds import KINDS, LAYOUT_LOCAL
from keras_sync.errors import UsageError

TRAIN_SCRIPT = "train.py"


def _template(name: str) -> str:
    return resources.files("keras_sync.templates").joinpath(name).read_text(encoding="utf-8")


def render_config(kind: str = "auto", per_replica_batch: int = 32) -> str:
    """The text of a commented ``keras_sync.yaml`` for strategy `kind`.

    >>> "kind: mirrored" in render_config("mirrored", 64)
    True
    """
    if kind not in STRATEGY_KINDS:
        raise UsageError(
            f"Invalid value for argument `kind`. Received: kind={kind!r}. "
            f"Expected one of {', '.join(STRATEGY_KINDS)}."
        )
    if type(per_replica_batch) is not int or per_replica_batch < 1:
        raise UsageError(
            f"Invalid value for argument `per_replica_batch`. Received: "
            f"per_replica_batch={per_replica_batch!r}. Expected an integer >= 1."
        )
    # Plain replacement, not string.Template: the comments mention $MLFLOW_TRACKING_URI and friends.
    text = _template(DEFAULT_CONFIG_FILE)
    return text.replace("${strategy}", _template(f"strategy_{kind}.yaml").rstrip("\n")).replace(
        "${per_replica}", str(per_replica_batch)
    )


def cpu_replicas_hint(kind: str, config_path: str | Path, *, gpus: int) -> str | None:
    """How to get several replicas on the CPU, for a machine without a GPU; None where it does not apply.

    >>> print(cpu_replicas_hint("auto", "keras_sync.yaml", gpus=0))
    no GPU here, so 1 replica per process; for 2 on the CPU, set strategy.simulated_cpu_replicas: 2 in keras_sync.yaml
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

    Raises:
        UsageError: a bad argument, a target exists without `force` (nothing is written), or the
            directory cannot be written.
    """
    root = Path(directory)
    contents = {
        root / DEFAULT_CONFIG_FILE: render_config(kind, per_replica_batch),
        root / TRAIN_SCRIPT: _template(TRAIN_SCRIPT),
    }
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"Invalid value for argument `directory`. Received: {str(root)!r}, which is a file. "
            "Expected a directory (it is created if missing)."
        )
    existing = [p for p in contents if p.exists()]
    if existing and not force:
        names = " and ".join(str(p) for p in existing)
        exist = "it exists" if len(existing) == 1 else "they exist"
        raise UsageError(
            f"Refusing to overwrite {names}: {exist}, so nothing was written. "
            "Pass --force to overwrite, or choose another directory."
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
