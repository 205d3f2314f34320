"""Errors raised by keras-sync: all derive from `KerasSyncError`, a one-line message, no traceback."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass


class _QuietExit(Exception, SystemExit):
    """An exception that also ends the script as a `SystemExit` when nobody catches it."""


#: ``KERAS_SYNC_TRACEBACK=1`` (read at import): plain exceptions, with a traceback.
_BASE: type = Exception if os.environ.get("KERAS_SYNC_TRACEBACK") == "1" else _QuietExit


class KerasSyncError(_BASE):
    """Base class of every error keras-sync raises for a user's mistake or environment.

    Uncaught, it ends the script as a `SystemExit` that writes ``keras-sync: <message>`` on stderr
    and exits with `exit_code` (no hook is installed). ``KERAS_SYNC_TRACEBACK=1``: a plain exception.
    """

    exit_code = 2  # bad usage, as the CLI's

    @property
    def code(self) -> int:
        """What Python's exit reads: the message once on stderr, then `exit_code`; a cluster or an
        uncaught error ends with `os._exit` (TensorFlow's teardown would wait for missing peers)."""
        if not self.__dict__.get("_keras_sync_said"):
            self.__dict__["_keras_sync_said"] = True
            for line in str(self).splitlines() or [type(self).__name__]:
                print(f"keras-sync: {line}", file=sys.stderr)
        top_level = sys._getframe().f_back is None  # read by Python's exit handling, not code
        if top_level or isinstance(self, (ConnectTimeoutError, PeerLostError)):
            if not isinstance(self, ConnectTimeoutError):  # its atexit handlers would wait too
                import atexit

                atexit._run_exitfuncs()
            for stream in (sys.stderr, sys.stdout):
                with contextlib.suppress(Exception):  # a closed stream: nothing left to flush
                    stream.flush()
            os._exit(self.exit_code)
        return self.exit_code


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
    """The config (YAML file, dict or override) is invalid: every issue found (``issues``), one
    line each (``FILE:LINE: key.path: message``)."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue):
        self.issues = [issues] if isinstance(issues, ConfigIssue) else list(issues)
        first = self.issues[0]  # ``file``, ``line``, ``key_path``: the first issue's
        self.file, self.line, self.key_path = first.file, first.line, first.key_path
        super().__init__("\n".join(str(i) for i in self.issues))


class StrategyError(KerasSyncError):
    """A distribution strategy cannot be built as configured (devices, TPU, order of calls)."""


class ClusterError(KerasSyncError):
    """The cluster description (TF_CONFIG, Slurm variables) is missing, invalid or unsupported."""


class ConnectTimeoutError(ClusterError):
    """Peers did not join the cluster within ``strategy.connect_timeout_s``."""


class PeerLostError(ClusterError):
    """A worker lost contact with a peer mid-training; uncaught, exit code 75 (EX_TEMPFAIL: relaunch)."""

    exit_code = 75


class ScalingError(KerasSyncError):
    """Batch sizes or learning-rate settings are inconsistent (e.g. a global batch that does not divide)."""


class UsageError(KerasSyncError):
    """An API was called in a way that cannot work (model built outside the scope, bad argument)."""


class TrackingError(KerasSyncError):
    """MLflow tracking cannot be set up as configured."""


class CompatibilityError(KerasSyncError):
    """The installed Keras, TensorFlow or MLflow no longer has an internal a keras-sync feature needs."""
