"""Two network hosts for tests: two network namespaces joined by a veth link.

Host i (0 or 1) has the address ``10.203.<net>.<i + 1>`` on the link ``10.203.<net>.0/24``, its
own loopback and nothing else: a process started in it sees only the other host, as a worker on
another machine would. The test owns everything it creates (namespace and interface names carry
the test process's pid) and `TwoHosts.down` removes it all, killing whatever still runs inside.

    with two_hosts() as hosts:                   # pytest.skip with the reason if namespaces cannot be made
        w1 = hosts.start(1, [python, "train.py"], env={"TF_CONFIG": ...})
        hosts.cut_link()                         # both ends of the link go down
        assert hosts.pids(1) == []               # nothing left running on host 1

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` tool (iproute2).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"ksprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    """Two namespaces ``<tag>a``/``<tag>b`` joined by the veth pair of the same names."""

    def __init__(self) -> None:
        n = next(_counter)
        tag = f"ks{os.getpid() % 100000}x{n}"  # <= 15 characters with the suffix: a Linux interface name
        self.names = (f"{tag}a", f"{tag}b")
        self.net = (os.getpid() + n) % 250 + 1
        self.addresses = (f"10.203.{self.net}.1", f"10.203.{self.net}.2")
        self.procs: list[subprocess.Popen[str]] = []

    def up(self) -> None:
        a, b = self.names
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for name, address in zip(self.names, self.addresses):
            _ip("link", "set", name, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", name)
            _ip("-n", name, "link", "set", name, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def start(
        self, host: int, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None = None
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` (its pid is the program's: `ip netns exec` execs it)."""
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv],
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        return p

    def cut_link(self) -> None:
        """Take both ends of the link down: the hosts no longer reach each other (no RST, no FIN)."""
        for name in self.names:
            _ip("-n", name, "link", "set", name, "down")

    def pids(self, host: int) -> list[int]:
        """Processes still running on ``host`` (zombies waiting for their parent do not count)."""
        out = _ip("netns", "pids", self.names[host], check=False).stdout.split()
        return [int(p) for p in out if not _zombie(int(p))]

    def down(self) -> None:
        """Kill what still runs on either host and delete both namespaces (and so the link)."""
        for host in (0, 1):
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
                p.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while (self.pids(0) or self.pids(1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in self.names:
            _ip("netns", "del", name, check=False)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """`TwoHosts`, up for the block and torn down after it (also when the test fails)."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host tests need network namespaces: {reason}")
    hosts = TwoHosts()
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()
