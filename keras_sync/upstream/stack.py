"""The Keras backend (keras-sync needs ``tensorflow``) and the installed TensorFlow distributions
(two of them write over each other's files), read without importing either."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Mapping
from importlib import metadata

from keras_sync.errors import UsageError

#: Distributions that install the ``tensorflow`` package (the names pip and PyPI use).
_TF_DIST = re.compile(
    r"^(tensorflow|tensorflow[-_](cpu|gpu|intel|macos|aarch64|rocm)|tf[-_]nightly([-_](cpu|gpu))?|"
    r"intel[-_]tensorflow)$",
    re.IGNORECASE,
)


def keras_backend(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(backend, where it comes from): what Keras uses or will use in this process."""
    env = os.environ if environ is None else environ
    keras = sys.modules.get("keras")
    if keras is not None and environ is None:
        with contextlib.suppress(Exception):  # a half-imported Keras: what decides it, below
            return str(keras.backend.backend()), "keras.backend.backend()"
    if env.get("KERAS_BACKEND"):
        return env["KERAS_BACKEND"], "$KERAS_BACKEND"
    home = env.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path) as fh:
            backend = json.load(fh).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if backend:
        return str(backend), path
    return "tensorflow", "default"


def tensorflow_distributions() -> list[tuple[str, str]]:
    """Every installed distribution of the ``tensorflow`` package, as (name, version), sorted."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if _TF_DIST.match(name):
            found[name.lower().replace("_", "-")] = dist.version
    return sorted(found.items())


def describe_tensorflow(dists: list[tuple[str, str]] | None = None) -> str:
    """``tensorflow-cpu 2.21.0``, or every one and a warning when there are several."""
    dists = tensorflow_distributions() if dists is None else dists
    if not dists:
        return "not installed"
    text = ", ".join(f"{name} {version}" for name, version in dists)
    if len(dists) > 1:
        text += (
            f" ({len(dists)} distributions of one `tensorflow` package: they overwrite each other's files; "
            f"keep one, e.g. pip uninstall {' '.join(n for n, _ in dists[1:])})"
        )
    return text


def check_backend(environ: Mapping[str, str] | None = None) -> None:
    """Raise `UsageError` (one line) unless Keras uses, or will use, the tensorflow backend."""
    backend, source = keras_backend(environ)
    if backend == "tensorflow":
        return
    where = {
        "$KERAS_BACKEND": f"KERAS_BACKEND={backend}",
        "keras.backend.backend()": f"keras.backend.backend() is {backend!r}",
        "default": backend,
    }.get(source, f'"backend": "{backend}" in {source}')
    raise UsageError(
        f"Keras uses the {backend} backend ({where}), and keras-sync distributes training with TensorFlow "
        "strategies, which need Keras's tensorflow backend. Fix: set KERAS_BACKEND=tensorflow (or unset it) before "
        "Keras is imported."
    )
