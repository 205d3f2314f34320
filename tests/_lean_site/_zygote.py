"""Test processes only: start a script's process from one that has already imported TensorFlow.

Each TensorFlow process of the suite spends ~4.6 CPU-s importing TensorFlow and Keras before its first
line runs, and the suite starts ~200 of them on 2 cores (about a third of the whole CI's CPU). A
*zygote* (a process started once per test session, tests/conftest.py) imports both and then waits on a
Unix socket. When a test process starts `python SCRIPT.py ARGS` and the script names keras or
tensorflow, `delegate()` (called from sitecustomize.py, before the script's first line) hands the
zygote everything a process is made of: its argv, working directory, environment, umask, open file
descriptors (stdin/stdout/stderr and any others it inherited, as themselves), ignored and blocked
signals. The zygote forks; the child takes all of that on, execs the script as `__main__` and exits
as Python would (an uncaught exception through `sys.excepthook`, `SystemExit` codes, atexit handlers).
The process the test started (the *proxy*) stays as the child's stand-in for its parent:

- a signal sent to the proxy (TERM, INT, HUP, QUIT, USR1, USR2, ALRM) is sent on to the child, to its
  process group when the proxy leads its own group (`start_new_session`, `os.killpg` as
  `keras-sync launch` does);
- a proxy killed with SIGKILL takes the child with it (the child sees the proxy's end of the socket
  close and kills itself with SIGKILL);
- the proxy exits with the child's exit code, or dies of the signal that killed the child.

The child is not the proxy: `os.getpid()` differs from the Popen's pid (a script that writes its own
pid, and a test that signals that pid, reach the child directly), and SIGSTOP to the proxy stops only
the proxy. `os.getppid()` in the child answers the proxy's parent (what a plain process would see,
the courier's orphan check included), and the child runs at the proxy's nice value. What runs inside
the child is the real script with the real TensorFlow.

keras-sync's courier (`python -m keras_sync.tracking.courier_main`, ~80 per run, ~4 CPU-s each) is
started the same way from a third zygote, which has imported MLflow's client and SQL store and the
report's matplotlib (~2.5 of those CPU-s).

A process runs as usual (no zygote) whenever anything that matters before a script's first line
differs from the zygote's: the interpreter or its options (`-X importtime`, `-I`, ...), `-c`/`-m`, the
environment variables read while TensorFlow and Keras import (`TF_*` but `TF_CONFIG`, `KERAS_*` but
`KERAS_SYNC_*`, `PYTHON*`, `XLA_*`, `CUDA*`, `OMP_*`, `MKL*`, `OPENBLAS*`, `GRPC_*`, `LD_*`, `HOME`,
`LANG`, `LC_*`), the user and groups, the network, mount or PID namespace (`ip netns exec`), the
cgroup, or a file descriptor number the zygote itself holds. `KERAS_SYNC_TEST_ZYGOTE=` (empty) turns it
off for a process and everything it starts.

Two zygotes run, and a process goes to one by its pid's parity: each has its own string hash seed, so
the workers of one job do not all iterate sets of strings in the same order (as separate processes
would not).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

ENV_VAR = "KERAS_SYNC_TEST_ZYGOTE"
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
#: The zygotes, by kind: what each imports before it forks, and the environment variables read then.
#: `tf` serves scripts that name keras or tensorflow (two of them: see the docstring); `mlflow` serves
#: keras-sync's courier (`python -m keras_sync.tracking.courier_main`, MLflow's client and SQL store).
_COMMON = ("PYTHON", "OMP_", "MKL", "OPENBLAS", "LD_", "LANG", "LC_", "HOME")
KINDS = {"tf": 2, "mlflow": 1}
_ENV_PREFIXES = {
    "tf": _COMMON + ("TF_", "KERAS_", "XLA_", "CUDA", "GRPC_"),
    "mlflow": _COMMON + ("MLFLOW_LOGGING", "MLFLOW_CONFIGURE_LOGGING", "SQLALCHEMY", "MPL"),
}
_ENV_RUNTIME = ("TF_CONFIG", "KERAS_SYNC_")  # read when the script asks, after the zygote's imports
COURIER = "keras_sync.tracking.courier_main"
_HIGH_FD = 900


def _import_env(env: dict[str, str], kind: str) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()  # PYTHONPATH: compared as the sys.path it makes
        if k.startswith(_ENV_PREFIXES[kind])
        and not k.startswith(_ENV_RUNTIME)
        and k not in (ENV_VAR, "PYTHONPATH")
    }


def _where(path: list[str], kind: str) -> dict[str, object]:
    """What a process is that the zygote cannot change in its child (`path`: sys.path without the script's folder)."""

    def link(p: str) -> str:
        try:
            return os.readlink(p)
        except OSError:
            return ""

    with open("/proc/self/cgroup") as fh:
        cgroup = fh.read()
    return {
        "executable": os.path.realpath(sys.executable),
        "prefix": sys.prefix,
        "path": path,
        "flags": repr(sys.flags),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "euid": os.geteuid(),
        "groups": sorted(os.getgroups()),
        "cgroup": cgroup,
        "ns": {n: link(f"/proc/self/ns/{n}") for n in ("net", "mnt", "pid", "ipc", "uts", "user")},
        "env": _import_env(dict(os.environ), kind),
    }


def _send(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(data)
    else:
        sock.sendall(head + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[object, list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, 4, 512)
        if len(head) < 4:
            head += _recv_exact(sock, 4 - len(head))
    else:
        head = _recv_exact(sock, 4)
    (size,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(sock, size)), fds


# --- the proxy: the process a test started ---------------------------------------------------------


def delegate() -> None:
    """Run this process's script in a child of a zygote, or return (run as usual)."""
    where = os.environ.get(ENV_VAR, "")
    argv = list(getattr(sys, "orig_argv", ()))
    if not where or len(argv) < 2:
        return
    if argv[1:3] == ["-m", COURIER]:
        kind = "mlflow"
    elif (
        argv[1].startswith("-")
        or not argv[1].endswith(".py")
        or "site-packages" in os.path.realpath(argv[1])
    ):
        return  # interpreter options, -c, or a library's own process (Ray's workers): as usual
    else:
        try:
            with open(argv[1], "rb") as fh:
                source = fh.read()
        except OSError:
            return
        if b"keras" not in source and b"tensorflow" not in source:
            return
        kind = "tf"
    with open("/proc/self/status") as fh:  # under strace (ptrace): the child would not be traced
        if any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in fh):
            return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(where, f"{kind}{os.getpid() % KINDS[kind]}"))
    except OSError:
        sock.close()
        return
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == sock.fileno():
            continue
        try:
            os.fstat(fd)
        except OSError:  # listdir's own descriptor, closed by now
            continue
        fds.append(fd)
    umask = os.umask(0)
    os.umask(umask)
    pending: list[int] = []
    child: list[int] = []
    lead = os.getpgrp() == os.getpid()

    def forward(signum: int, _frame: object) -> None:
        if not child:
            pending.append(signum)
            return
        try:
            if lead:
                os.killpg(child[0], signum)
            else:
                os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    ignored = []
    for name in _FORWARDED:
        sig = getattr(signal, name)
        if signal.getsignal(sig) == signal.SIG_IGN:
            ignored.append(int(sig))
        else:
            signal.signal(sig, forward)
    ignored += [
        int(s) for s in (signal.SIGPIPE, signal.SIGXFSZ) if signal.getsignal(s) == signal.SIG_IGN
    ]
    # sitecustomize runs before Python puts a script's folder first on sys.path (with -m: after)
    module = argv[1] == "-m"
    request = dict(
        _where(sys.path[1:] if module else sys.path, kind),
        path0=sys.path[0] if module else None,
        argv=argv[1:],
        cwd=os.getcwd(),
        environ=dict(os.environ),
        umask=umask,
        proxy=os.getpid(),
        nice=os.getpriority(os.PRIO_PROCESS, 0),
        fds=[[fd, os.get_inheritable(fd)] for fd in fds],
        ignored=ignored,
        blocked=sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    )
    try:
        _send(sock, request, fds)
        reply, _ = _recv(sock)
    except (OSError, EOFError):
        reply = {"no": "the zygote went away"}
    if "pid" not in reply:  # run as usual
        sock.close()
        for name in _FORWARDED:
            sig = getattr(signal, name)
            if int(sig) not in ignored:
                signal.signal(
                    sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                )
        for signum in pending:
            os.kill(os.getpid(), signum)
        return
    child.append(int(reply["pid"]))
    try:  # from here on this process only stands in for the child: it never runs the script itself
        for signum in pending:
            forward(signum, None)
        _end_as(sock, child[0])
    finally:
        os._exit(70)


def _end_as(sock: socket.socket, child: int) -> None:
    """Wait for the child's end and end the same way (its exit code, or killed by the same signal)."""
    try:
        status, _ = _recv(sock)
        code = int(status["status"])
    except (OSError, EOFError, KeyError, ValueError, TypeError):
        os.write(
            2,
            b"keras-sync tests: the zygote went away before its child ended (tests/_lean_site/_zygote.py)\n",
        )
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os._exit(70)
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(code) if os.WIFEXITED(code) else 70)


# --- the zygote ------------------------------------------------------------------------------------


def _preload(kind: str) -> None:
    """What makes a zygote worth having: imports paid once instead of once per process."""
    if kind == "tf":  # ~4.6 CPU-s
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        return
    # the courier's start (~2.5 of its ~4 CPU-s): MLflow's client and SQL store, the report's matplotlib
    import importlib

    for name in (
        "mlflow",
        "mlflow.store.tracking.sqlalchemy_store",
        "mlflow.store.db.utils",
        "matplotlib.figure",
        "matplotlib.backends.backend_agg",
        "keras_sync.tracking.courier",
        "keras_sync.tracking.sqlite_store",
        "keras_sync.tracking.sql_metrics",
        "keras_sync.tracking.report_plot",
        "keras_sync.tracking.artifacts",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # another MLflow's layout: that part is imported by the courier itself
            pass
    try:
        from sqlalchemy.orm import configure_mappers

        configure_mappers()
    except Exception:
        pass


def _serve(path: str, control_fd: int, kind: str) -> dict | None:
    """Accept requests until the control pipe closes; in a forked child, return its request."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    listener.listen(64)
    _preload(kind)
    import gc

    gc.collect()
    gc.freeze()  # the imported objects stay out of every child's garbage collections (and copy-on-write)
    mine = _where(sys.path[1:], kind)  # without the "" of `-c`
    held = {int(n) for n in os.listdir("/proc/self/fd")} - {listener.fileno(), control_fd}
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(control_fd, selectors.EVENT_READ, "control")
    sel.register(rfd, selectors.EVENT_READ, "child")
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "control":
                if not os.read(control_fd, 64):
                    os.unlink(path)
                    sys.exit(0)
            elif key.data == "child":
                os.read(rfd, 512)
                while waiting:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is not None:
                        try:
                            _send(conn, {"status": status})
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv(conn, with_fds=True)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                why = _refuse(request, mine, held)
                if why:
                    print(
                        f"refused ({why}): {request.get('argv')} {_diff(request, mine)}", flush=True
                    )
                    for fd in fds:
                        os.close(fd)
                    try:
                        _send(conn, {"no": why})
                    except OSError:
                        pass
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    listener.close()
                    for other in waiting.values():
                        other.close()
                    for fd in (rfd, wfd, control_fd):
                        os.close(fd)
                    request["_fds"] = fds
                    request["_conn"] = conn.detach()
                    return request
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                print(f"forked {pid}: {request['argv'][:3]}", flush=True)
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    pass


def _refuse(request: dict, mine: dict, held: set[int]) -> str:
    for key in (
        "executable",
        "prefix",
        "path",
        "flags",
        "uid",
        "gid",
        "euid",
        "groups",
        "cgroup",
        "ns",
        "env",
    ):
        if request.get(key) != mine[key]:
            return f"{key} differs"
    if any(fd in held or fd >= _HIGH_FD - 1 for fd, _ in request["fds"] if fd > 2):
        return "a descriptor number the zygote holds"
    return ""


def _diff(request: dict, mine: dict) -> str:
    env, own = request.get("env", {}), mine["env"]
    keys = sorted(k for k in set(env) | set(own) if env.get(k) != own.get(k))
    path = (
        ""
        if request.get("path") == mine["path"]
        else f" sys.path {request.get('path')} / {mine['path']}"
    )
    return " ".join(f"{k}={env.get(k)!r}/{own.get(k)!r}" for k in keys) + path


def _become(request: dict) -> int:
    """In the forked child: become the proxy's process, run its script, return the exit code."""
    import fcntl
    import threading

    os.setsid()
    conn_fd = fcntl.fcntl(
        request["_conn"], fcntl.F_DUPFD_CLOEXEC, _HIGH_FD - 1
    )  # out of the way of the fds below
    os.close(request["_conn"])
    received = request["_fds"]
    high = [os.dup2(fd, _HIGH_FD + i, inheritable=False) for i, fd in enumerate(received)]
    for fd in received:
        if fd not in high:
            os.close(fd)
    for (target, inheritable), fd in zip(request["fds"], high):
        os.dup2(fd, target, inheritable=inheritable)
        os.close(fd)
    conn = socket.socket(fileno=conn_fd)

    def watch() -> None:  # the proxy's end closes when the proxy dies (SIGKILL included)
        try:
            conn.recv(1)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    for sig in request["ignored"]:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    os.environ.clear()
    os.environ.update(request["environ"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))
        except (OSError, ValueError):
            pass
    import numpy

    numpy.random.seed()  # fresh entropy, as a new process would have (Python's random reseeds at fork)
    threading.Thread(target=watch, name="zygote-proxy-watch", daemon=True).start()

    proxy = int(request["proxy"])

    def getppid() -> (
        int
    ):  # the proxy's parent: the process that started it (1 once that one has died)
        try:
            with open(f"/proc/{proxy}/stat") as fh:
                return int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return 1

    os.getppid = getppid
    try:
        os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    except OSError:
        pass

    argv = request["argv"]
    try:
        if argv[0] == "-m":  # python -m MODULE ARGS: sys.path[0] is the working directory
            import runpy

            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = request["path0"]
            runpy._run_module_as_main(
                argv[1]
            )  # sets sys.argv[0] to the module's file, as `-m` does
        else:
            _run_script(argv, request["cwd"])
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # from the script's frame on, as Python prints it
        if value is not None:
            value.__traceback__ = tb
        sys.excepthook(kind, value, tb)
        return 130 if kind is KeyboardInterrupt else 1
    return 0


def _run_script(argv: list[str], cwd: str) -> None:
    import builtins
    import importlib.machinery

    script = argv[0]
    path = script if os.path.isabs(script) else cwd.rstrip("/") + "/" + script
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __spec__=None,
        __file__=path,
        __cached__=None,
        __builtins__=builtins,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    with open(script, "rb") as fh:
        code = compile(fh.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def main() -> None:
    path, control_fd, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    request = _serve(path, control_fd, kind)
    if request is not None:
        code = _become(request)
        sys.exit(code)


def start(where: str, **env_overrides: str) -> list[tuple[object, int]]:
    """Start the zygotes of every kind, listening in the folder `where` (the value of KERAS_SYNC_TEST_ZYGOTE).

    Each exits when its returned descriptor is closed (or the process that holds it ends); its log
    (`where`/KIND.log: TensorFlow's start-up lines, one line per child started or process refused).
    """
    import subprocess

    started = []
    for kind, count in KINDS.items():
        for i in range(count):
            rfd, wfd = os.pipe()
            os.set_inheritable(wfd, False)
            env = dict(os.environ, **env_overrides)
            env.pop("PYTHONHASHSEED", None)  # each its own string hash seed
            env[ENV_VAR] = ""
            path = os.path.join(where, f"{kind}{i}")
            with open(path + ".log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "import _zygote; _zygote.main()", path, str(rfd), kind],
                    pass_fds=(rfd,),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    cwd="/",
                    env=env,
                    start_new_session=True,
                )
            os.close(rfd)
            started.append((proc, wfd))
    return started


if __name__ == "__main__":
    main()
