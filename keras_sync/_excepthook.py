"""One line, not a traceback, when a keras-sync error ends a user's script.

`keras_sync.load()` installs this hook. A `KerasSyncError` that nobody caught is a
user's mistake or environment (a bad config, a missing peer): the script prints
``keras-sync: <message>`` on stderr and exits with code 2. Every other exception goes
to the previous hook unchanged. ``KERAS_SYNC_TRACEBACK=1`` shows the full traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

from keras_sync.errors import ConnectTimeoutError, KerasSyncError

_installed = False


def install() -> None:
    """Install the hook once per process (idempotent; keeps any hook set before)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, KerasSyncError) or os.environ.get("KERAS_SYNC_TRACEBACK") == "1":
            previous(kind, exc, tb)
            return
        for line in str(exc).splitlines() or [kind.__name__]:
            print(f"keras-sync: {line}", file=sys.stderr)
        if not isinstance(exc, ConnectTimeoutError):
            # Flush what the run logged (e.g. the MLflow writer) as a normal exit would. Not after a
            # connect timeout: nothing ran yet, and TensorFlow's cluster teardown would print pages
            # about the peers that never came.
            atexit._run_exitfuncs()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(2)  # an excepthook cannot set the exit code; 2 = bad usage, as the CLI

    sys.excepthook = hook
    _installed = True
