"""The tags MLflow's fluent `start_run` sets on a run it creates: who ran what, from which commit.

keras-sync's runs are created by its courier process through `MlflowClient`, which sets none of
them; these are computed in the training process (its ``sys.argv[0]``, its user, its git
checkout) with the same names and values as MLflow's default and git run contexts. No MLflow
or TensorFlow import: git is asked through its command line, with a timeout.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from collections.abc import Sequence

from keras_sync.tracking.redact import redact_uri

USER = "mlflow.user"
SOURCE_NAME = "mlflow.source.name"
SOURCE_TYPE = "mlflow.source.type"
GIT_COMMIT = "mlflow.source.git.commit"
GIT_BRANCH = "mlflow.source.git.branch"
GIT_REPO_URL = "mlflow.source.git.repoURL"


def source_tags(argv: Sequence[str] | None = None, *, timeout_s: float = 5.0) -> dict[str, str]:
    """``mlflow.user``, ``mlflow.source.name``/``type`` and, in a git checkout, ``mlflow.source.git.*``.

    The source is ``argv[0]`` (the script, as MLflow records it), ``<console>`` without one.
    The git tags describe the checkout holding the script (else the working directory); a
    remote URL's credentials are replaced by ``***``.

    >>> tags = source_tags(["/nonexistent/train.py"])
    >>> tags["mlflow.source.name"], tags["mlflow.source.type"]
    ('/nonexistent/train.py', 'LOCAL')
    """
    argv = list(sys.argv if argv is None else argv)
    main = argv[0] if argv and argv[0] else None
    tags = {USER: _user(), SOURCE_NAME: main or "<console>", SOURCE_TYPE: "LOCAL"}
    where = os.path.dirname(os.path.abspath(main)) if main and os.path.isfile(main) else os.getcwd()
    commit = _git(where, ["rev-parse", "HEAD"], timeout_s)
    if commit:
        tags[GIT_COMMIT] = commit
        branch = _git(where, ["rev-parse", "--abbrev-ref", "HEAD"], timeout_s)
        if branch and branch != "HEAD":  # detached: MLflow records no branch either
            tags[GIT_BRANCH] = branch
        url = _git(where, ["config", "--get", "remote.origin.url"], timeout_s)
        if url:
            tags[GIT_REPO_URL] = redact_uri(url) or url
    return tags


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        return "unknown"


def _git(cwd: str, args: list[str], timeout_s: float) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", cwd, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
