"""One line, not a traceback, when a keras-sync error ends a user's script.

`keras_sync.load()` installs this hook. A `KerasSyncError` that nobody caught is a
user's mistake or environment (a bad config, a missing peer): the script prints
``keras-sync: <message>`` on stderr and exits with code 2 (75 for `PeerLostError`). A
TensorFlow error that says a peer is unreachable (raised outside `sync.fit`) gets the same
one-line treatment as `PeerLostError`. Every other exception goes to the previous hook unchanged. ``KERAS_SYNC_TRACEBACK=1`` shows the full traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

from keras_sync.errors import ConnectTimeoutError, KerasSyncError, PeerLostError

_installed = False


def install() -> None:
    """Install the hook once per process (idempotent; keeps any hook set before)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if os.environ.get("KERAS_SYNC_TRACEBACK") == "1":
            previous(kind, exc, tb)
            return
        if not isinstance(exc, KerasSyncError):
            exc = _as_peer_lost(exc)  # type: ignore[assignment]
            if not isinstance(exc, KerasSyncError):
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
        # An excepthook cannot set the exit code: 2 = bad usage, as the CLI; a lost peer has its own.
        os._exit(getattr(exc, "exit_code", 2))

    sys.excepthook = hook
    _installed = True


def _as_peer_lost(exc: BaseException) -> BaseException:
    """A TensorFlow lost-peer error raised outside `sync.fit` (evaluate, predict, a custom loop)
    as `PeerLostError`, with the peer named from ``$TF_CONFIG``; any other exception unchanged."""
    from keras_sync.cluster import lost_peer as _lost_peer

    if not _lost_peer.is_lost_peer_error(exc):
        return exc
    message = _lost_peer.from_tf_config(str(exc))
    return PeerLostError(message) if message else exc
