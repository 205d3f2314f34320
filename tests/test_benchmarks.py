"""Every benchmark's ``--quick`` run (each code path once, its table printed), as a real process.

The full benchmarks are not run here (minutes each on a shared machine); a refactor that breaks one
fails here. Their figures under the test zygote mean nothing (its proxies are not the processes).
bench_sync_metrics, stopped mid-run however it is stopped, leaves no busy loop behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# benchmark: (seconds it may take under load, lines of its table that must be printed)
QUICK = {
    "bench_sync_metrics.py": (
        600,
        ["in MLflow at exit", "busy", "default", "down"],
    ),
    "bench_models.py": (
        600,
        ["goal (issue 39)", "transformer   metrics_off", "transformer   every_step"],
    ),
    "bench_delivery.py": (600, ["in MLflow/logged per round", "quiet_sqlite", "outage", "kill"]),
    "bench_cli_help.py": (300, ["keras-sync --help", "python -c 'import tensorflow'", "ratio"]),
    "bench_steps_per_execution.py": (300, ["steps_per_execution 8:", "ratio spe 8 / spe 1"]),
    "bench_tracking_writer.py": (300, ["MlflowWriter.log_metrics :", "all delivered"]),
    "bench_weight_divergence.py": (300, ["fingerprints", "ratio fingerprints / numpy f64"]),
}


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """TF_CPP_MIN_LOG_LEVEL=2 as the test zygotes have it; temporary files under ``tmp_path``."""
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmp_path), **extra)


def test_every_benchmark_has_a_quick_run_here() -> None:
    assert sorted(p.name for p in BENCHMARKS.glob("bench_*.py")) == sorted(QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_run_ends_well_and_prints_its_table(name: str, tmp_path: Path) -> None:
    timeout, table = QUICK[name]
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), "--quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(tmp_path),
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    missing = [line for line in table if line not in r.stdout]
    assert not missing, f"not printed: {missing}\n{r.stdout}\n{r.stderr[-3000:]}"
    if name == "bench_sync_metrics.py":  # every step logged is in MLflow when the process ended
        assert r.stdout.count("1/1 ok") == 2, r.stdout
    if name == "bench_delivery.py":  # 40 steps of 11 points, and 2 at the fit's end
        assert "442/442, FINISHED" in r.stdout.split("quiet_sqlite courier")[1], r.stdout


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    found = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[1] != str(pid):
                    continue
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                found[int(p)] = fh.read().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name
)
def test_bench_sync_metrics_stopped_mid_run_leaves_no_busy_loop(sig: int, tmp_path: Path) -> None:
    # Without the test zygote: the benchmark is the process started here, the busy loops its children.
    bench = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "bench_sync_metrics.py"), "--quick", "--cases", "busy"],
        cwd=tmp_path,
        env=_env(tmp_path, KERAS_SYNC_TEST_ZYGOTE=""),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pidfds: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(children := _children(bench.pid)) < 3:  # 2 busy loops, then the first training
            assert bench.poll() is None and time.monotonic() < deadline, children
            time.sleep(0.05)
        pidfds = {pid: os.pidfd_open(pid) for pid in children}
        loops = [pid for pid, cmd in children.items() if "while True: pass" in cmd]
        assert len(loops) == 2, children
        bench.send_signal(sig)
        bench.wait(timeout=60)
        if sig == signal.SIGKILL:  # the training process is not the benchmark's to end then
            for pid in set(pidfds) - set(loops):
                signal.pidfd_send_signal(pidfds[pid], signal.SIGKILL)
        for pid in loops if sig == signal.SIGKILL else pidfds:  # ended: its pidfd reads
            assert select.select([pidfds[pid]], [], [], 30)[0], f"{children[pid]} still runs"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for fd in pidfds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fd)
