"""The suite's zygote (tests/_lean_site/_zygote.py) makes a script's process as Python would have made it.

A probe script (it names keras, so it is delegated) reports what a process is made of; the same
command runs once through a zygote and once as usual, and the reports must agree, apart from what a
zygote changes on purpose (TensorFlow already imported, the pid). Signals, exit codes and a proxy
killed with SIGKILL are checked the way the suite's kill-and-resume tests use them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LEAN_SITE = Path(__file__).resolve().parent / "_lean_site"
sys.path.insert(0, str(LEAN_SITE))
import _zygote  # noqa: E402

sys.path.remove(str(LEAN_SITE))

PROBE = r"""# a probe for tests/test_zygote.py (it names keras so that it is delegated)
import json, os, signal, sys, time
report = {
    "tf": "tensorflow" in sys.modules, "argv": sys.argv, "file": __file__, "name": __name__,
    "path0": sys.path[0], "path": sys.path[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VAR"),
    "env_keys": sorted(k for k in os.environ if k != "KERAS_SYNC_TEST_ZYGOTE"), "umask": os.umask(0),
    "stdin": sys.stdin.read(), "extra_fd": os.read(int(sys.argv[2]), 100).decode() if len(sys.argv) > 2 else None,
    "ignored_hup": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, "ppid": os.getppid(),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
}
print(json.dumps(report), flush=True)
mode = sys.argv[1]
if mode == "raise":
    raise ValueError("the probe's own error")
if mode == "exit":
    sys.exit(7)
if mode == "exit-text":
    sys.exit("a message")
if mode in ("term", "sleep"):
    def on_term(*_):
        print("TERM handled", flush=True)
        sys.exit(3)
    if mode == "term":
        signal.signal(signal.SIGTERM, on_term)
    with open(os.environ["PROBE_READY"], "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(120)
if mode == "killself":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("zygote")
    started = _zygote.start(str(where), TF_CPP_MIN_LOG_LEVEL="2")
    yield str(where)
    for _, control in started:
        os.close(control)
    for proc, _ in started:
        assert proc.wait(timeout=60) == 0, "".join(
            p.read_text()[-2000:] for p in where.glob("*.log")
        )


def _env(tmp: Path, sock: str, **extra: str) -> dict[str, str]:
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="2", PROBE_VAR="value", PROBE_READY=str(tmp / "ready")
    )
    env.update(extra)
    env["KERAS_SYNC_TEST_ZYGOTE"] = sock
    return env


def _run(
    tmp: Path, env: dict[str, str], *args: str, **kw: object
) -> subprocess.CompletedProcess[str]:
    (tmp / "probe.py").write_text(PROBE)
    return subprocess.run(
        [sys.executable, "probe.py", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def _report(out: str) -> dict:
    return json.loads(out.splitlines()[0])


@pytest.mark.slow
def test_a_delegated_script_sees_what_a_plain_process_sees(zygote: str, tmp_path: Path) -> None:
    plain_env = _env(tmp_path, "")
    through_env = _env(tmp_path, zygote)
    for mode in ("plain", "exit", "exit-text", "raise"):
        plain = _run(tmp_path, plain_env, mode, input="from stdin", preexec_fn=lambda: os.nice(3))
        through = _run(
            tmp_path, through_env, mode, input="from stdin", preexec_fn=lambda: os.nice(3)
        )
        a, b = _report(plain.stdout), _report(through.stdout)
        assert (a.pop("tf"), b.pop("tf")) == (False, True), (
            "the second run did not go through the zygote"
        )
        assert a == b
        assert plain.returncode == through.returncode, mode
        assert plain.stderr == through.stderr, (
            mode
        )  # the traceback starts at the script's frame, as Python's
    assert (
        b["stdin"] == "from stdin"
        and b["env"] == "value"
        and b["file"] == str(tmp_path / "probe.py")
    )
    assert b["ppid"] == os.getpid() and b["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 3


@pytest.mark.slow
def test_inherited_descriptors_and_ignored_signals_reach_the_script(
    zygote: str, tmp_path: Path
) -> None:
    r, w = os.pipe()
    os.write(w, b"through the pipe")
    os.close(w)
    (tmp_path / "probe.py").write_text(PROBE)
    res = subprocess.run(
        [sys.executable, "probe.py", "plain", str(r)],
        cwd=tmp_path,
        env=_env(tmp_path, zygote),
        pass_fds=(r,),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    os.close(r)
    report = _report(res.stdout)
    assert report["tf"] and report["extra_fd"] == "through the pipe" and report["ignored_hup"]


def _wait_ready(tmp: Path, proc: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 300
    while not (tmp / "ready").exists() or not (tmp / "ready").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return int((tmp / "ready").read_text())


@pytest.mark.slow
def test_signals_reach_the_script_and_the_proxy_ends_as_it_does(
    zygote: str, tmp_path: Path
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    env = _env(tmp_path, zygote)
    # SIGTERM to the group of a proxy that leads its own session, as `keras-sync launch` stops workers
    proc = subprocess.Popen(
        [sys.executable, "probe.py", "term"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = _wait_ready(tmp_path, proc)
    assert child != proc.pid
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "TERM handled" in out
    # a script that kills itself: the proxy dies of the same signal
    res = _run(tmp_path, env, "killself")
    assert res.returncode == -signal.SIGKILL and _report(res.stdout)["tf"]
    # a proxy killed with SIGKILL takes its child with it
    (tmp_path / "ready").unlink()
    proc = subprocess.Popen(
        [sys.executable, "probe.py", "sleep"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = _wait_ready(tmp_path, proc)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while (
        Path(f"/proc/{child}").exists()
        and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
    ):
        assert time.monotonic() < deadline, "the child outlived its proxy"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_process_whose_start_up_differs_runs_as_usual(zygote: str, tmp_path: Path) -> None:
    for env in (
        _env(tmp_path, zygote, TF_CPP_MIN_LOG_LEVEL="0"),
        _env(tmp_path, zygote, KERAS_BACKEND="jax"),
    ):
        assert not _report(_run(tmp_path, env, "plain").stdout)["tf"]
    (tmp_path / "probe.py").write_text(PROBE)
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "probe.py", "plain"],
        cwd=tmp_path,
        env=_env(tmp_path, zygote),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not _report(res.stdout)["tf"]
    assert "refused (env differs)" in "".join(p.read_text() for p in Path(zygote).glob("tf*.log"))
