"""A network namespace of its own for `keras-sync launch --private-network`: workers no other host can reach.

TensorFlow's gRPC server binds ``0.0.0.0:<port>`` whatever address the cluster spec gives it
(``grpc_server_lib.cc``: ``AddListeningPort("0.0.0.0:" + port)``; no `ServerDef`, `ConfigProto`
or ``TF_GRPC_*`` variable changes the address), and it runs any op a client sends, without
authentication. On one machine the launcher can still keep every other host out: it starts a
holder process in a new network namespace (``unshare --net``, Linux, root or CAP_SYS_ADMIN) that
brings its loopback up and lives while the launcher does (it exits when its stdin, a pipe from the
launcher, closes), and starts each worker inside it (``nsenter --net=/proc/<holder>/ns/net``).
The workers then listen and talk on that namespace's 127.0.0.1 only; the host's interfaces, its
loopback included, have no socket of theirs. The price: inside, no network but that loopback (a
tracking server over HTTP or a dataset download is out of reach; a sqlite or file store works).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from keras_sync.errors import UsageError

# Brings `lo` up with SIOCGIFFLAGS/SIOCSIFFLAGS (no `ip` binary needed), says so, then holds the
# namespace until its stdin (the launcher's pipe) closes: a launcher killed with SIGKILL leaves nothing.
_HOLDER = (
    "import fcntl, socket, struct, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "flags = struct.unpack('16sH14x', fcntl.ioctl(s, 0x8913, struct.pack('16sH14x', b'lo', 0)))[1]\n"
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', flags | 1))\n"
    "print('ready', flush=True)\n"
    "sys.stdin.buffer.read()\n"
)


def refuse_unless_possible() -> None:
    """Say in one line why ``--private-network`` cannot work here (not Linux, not root, no util-linux)."""
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    why = None
    if not sys.platform.startswith("linux"):
        why = f"network namespaces are Linux only (this is {sys.platform})"
    elif os.geteuid() != 0:
        why = f"creating a network namespace needs root or CAP_SYS_ADMIN (running as uid {os.geteuid()})"
    elif missing:
        why = f"{' and '.join(missing)} (util-linux) not found on the PATH"
    if why:
        raise UsageError(
            f"Invalid value for argument `private_network`. Received: private_network=True, but {why}. Fix: run "
            "launch as root on Linux, or drop --private-network and keep the workers' ports behind a firewall or "
            "on a trusted network."
        )


class PrivateNetwork:
    """The holder of one launch's network namespace; `wrap` turns a worker's command into one that runs inside."""

    def __init__(self) -> None:
        refuse_unless_possible()
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--", sys.executable, "-c", _HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != b"ready":
            code = self._holder.wait()
            raise UsageError(
                f"Invalid value for argument `private_network`. Received: private_network=True, but `unshare --net` "
                f"failed (exit code {code}; said above). Fix: drop --private-network, or allow network namespaces "
                "here (a container needs CAP_SYS_ADMIN)."
            )

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the namespace."""
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *command]

    def close(self) -> None:
        """End the holder; the namespace goes with the last process in it."""
        if self._holder.poll() is None:
            assert self._holder.stdin is not None
            self._holder.stdin.close()
            try:
                self._holder.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a holder that ignores its stdin
                self._holder.kill()
                self._holder.wait()
