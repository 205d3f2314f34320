"""The tags MLflow's fluent `start_run` sets (who ran what, from which commit), which
`MlflowClient` does not; git is asked through its command line. Not MLflow's own
`mlflow.tracking.context.registry.resolve_tags`: before its newest 3.x releases it records the
commit alone, without the branch and the remote URL."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from collections.abc import Sequence

from keras_sync.tracking.redact import redact_uri


def source_tags(argv: Sequence[str] | None = None, *, timeout_s: float = 5.0) -> dict[str, str]:
    """``mlflow.user``, ``mlflow.source.name``/``type`` (``argv[0]``) and, in a git checkout
    holding it (else the working directory), ``mlflow.source.git.*`` without credentials.

    >>> tags = source_tags(["/nonexistent/train.py"])
    >>> tags["mlflow.source.name"], tags["mlflow.source.type"]
    ('/nonexistent/train.py', 'LOCAL')
    """
    argv = list(sys.argv if argv is None else argv)
    main = argv[0] if argv and argv[0] else None
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        user = "unknown"
    tags = {
        "mlflow.user": user,
        "mlflow.source.name": main or "<console>",
        "mlflow.source.type": "LOCAL",
    }
    where = os.path.dirname(os.path.abspath(main)) if main and os.path.isfile(main) else os.getcwd()

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", where, *args],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            )
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return (out.stdout.strip() or None) if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        branch = git("rev-parse", "--abbrev-ref", "HEAD")
        if branch and branch != "HEAD":  # detached: MLflow records no branch either
            tags["mlflow.source.git.branch"] = branch
        url = git("config", "--get", "remote.origin.url")
        if url:
            tags["mlflow.source.git.repoURL"] = redact_uri(url) or url
    return tags
