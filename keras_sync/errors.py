"""Errors raised by keras-sync.

Every error a user can cause derives from `KerasSyncError`; the CLI turns it
into a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class KerasSyncError(Exception):
    """Base class of every error keras-sync raises for a user's mistake or environment."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem found in a config: where it is and what is wrong."""

    file: str
    line: int | None
    key_path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        key = f" {self.key_path}:" if self.key_path else ""
        return f"{where}:{key} {self.message}"


class ConfigError(KerasSyncError):
    """The config (YAML file, dict or override) is invalid.

    Carries every issue found (``issues``), so `keras-sync validate` can print
    them all at once; ``str()`` gives one line per issue, as
    ``FILE:LINE: key.path: message``.
    """

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue):
        if isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

    @property
    def file(self) -> str:
        return self.issues[0].file

    @property
    def line(self) -> int | None:
        return self.issues[0].line

    @property
    def key_path(self) -> str:
        return self.issues[0].key_path


class StrategyError(KerasSyncError):
    """A distribution strategy cannot be built as configured (devices, TPU, order of calls)."""


class ClusterError(KerasSyncError):
    """The cluster description (TF_CONFIG, Slurm variables) is missing, invalid or unsupported."""


class ConnectTimeoutError(ClusterError):
    """Peers did not join the cluster within ``strategy.connect_timeout_s``."""


class PeerLostError(ClusterError):
    """A worker lost contact with a peer mid-training (it stopped, or its host or the network failed).

    A script that does not catch it ends with exit code `exit_code` (75, EX_TEMPFAIL: relaunch).
    """

    exit_code = 75


class ScalingError(KerasSyncError):
    """Batch sizes or learning-rate settings are inconsistent (e.g. a global batch that does not divide)."""


class UsageError(KerasSyncError):
    """An API was called in a way that cannot work (model built outside the scope, bad argument)."""


class TrackingError(KerasSyncError):
    """MLflow tracking cannot be set up as configured."""


class CompatibilityError(KerasSyncError):
    """The installed Keras, TensorFlow or MLflow no longer has an internal a keras-sync feature needs."""
