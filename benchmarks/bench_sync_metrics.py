"""What the sync metrics cost a user: whole `sync.fit` calls, as ratios to metrics off in the same run.

    .venv/bin/python benchmarks/bench_sync_metrics.py [--pairs 3] [--cases busy,every_step,default,down] [--quick]

Each figure is measured with process pairs: one process trains with metrics
off, the other with them on, each a fresh Python process with a fresh sqlite store, the model of
the issue (2 simulated CPU replicas, Dense 8-16-1, per-replica batch 16). A fit's time is what
the user waits for: from calling `sync.fit` to its return. After each process has exited, MLflow
is read: the run must be FINISHED and hold every step logged (the exit waits for what `fit` left
to deliver in the background; that wait is shown apart). A case's figure is the median over the
pairs of (fit with metrics) / (fit without).

The cases with a warm-up fit run the two processes of a pair side by side, fitting in turn
(off, on, on, off: 4 rounds), each fit started once the other process is quiet (its courier
done), so the two fits of a round are seconds apart and see the same machine (on a shared machine
the same fit's time drifts from process to process and within one). A pair's figure is the median of its rounds. ``cpu``: the same median of
CPU seconds (the training process's threads and its courier), each fit's counted from its start
until its process is quiet again, so delivery that goes on after `fit` returned is counted too.
The ``busy`` case runs its processes one after the other (its fit is the first of the process).

Cases (goals from the issue):

- ``busy``: two CPU-bound busy loops beside training, a fresh store, the first `fit` of the
  process (200 steps; store creation, MLflow's import and the run's creation all fall in it),
  every step logged; <= 1.3x and every step in MLflow when the process ends.
- ``every_step``: quiet machine, every step logged, 1500 steps per fit, after one untimed
  warm-up fit in the same process, 4 timed rounds (tf.data adds a wait to some fits' teardown
  under load, metrics or not, so one fit per process is no measure); <= 1.20x.
- ``default``: quiet machine, nothing set (``log_every_n_steps`` at its default), as
  ``every_step`` otherwise; <= 1.05x.
- ``down``: the tracking server is down (nothing listens at its address), default settings,
  as ``default`` otherwise; the issue keeps 0.95-1.10x.

The machine this runs on may be shared: the load average at the start and end is printed, with
every raw time. ``--quick`` is a smoke run of every code path (1 pair of busy, default and down,
`QUICK_STEPS` steps, 1 timed fit, no quiet spell): its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

#: The quiet spell `_wait_quiet` waits for (seconds).
QUIET_S = 3.0
QUICK_STEPS = 16
#: A CPU-bound loop that ends when its stdin closes: when the benchmark ends, however it ends.
BUSY_LOOP = (
    "import os, threading\n"
    "threading.Thread(target=lambda: (os.read(0, 1), os._exit(0)), daemon=True).start()\n"
    "while True: pass\n"
)

CASES = {
    # name: (busy loops, steps, warm-up fit, log_every_n_steps (None: default), store, goal, timed fits)
    "busy": (2, 200, False, 1, "sqlite", 1.3, 1),
    "every_step": (0, 1500, True, 1, "sqlite", 1.20, 4),
    "default": (0, 1500, True, None, "sqlite", 1.05, 4),
    "down": (0, 1500, True, None, "down", 1.10, 4),
}


def busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning a core each, until they are killed or this process ends."""
    return [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.PIPE) for _ in range(n)
    ]


def child(args: argparse.Namespace) -> int:
    """One process: load, build, (warm up), time one fit; the result goes to ``args.out``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import warnings

    warnings.simplefilter("ignore")  # server down: a warning, expected
    import numpy as np

    import keras_sync

    mlflow: dict = {
        "enabled": args.metrics == "on",
        "tracking_uri": args.uri,
        "experiment": "bench",
    }
    if args.every != "default":
        mlflow["log_every_n_steps"] = int(args.every)
    sync = keras_sync.load(
        {
            "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
            "batch": {"per_replica": 16},
            "learning_rate": {"base": 0.01, "scaling": "none"},
            "mlflow": mlflow,
        }
    )
    import keras

    rng = np.random.default_rng(0)
    n = 32 * args.steps
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
    if args.warm:
        sync.fit(model, x, y, epochs=1, shuffle=False, verbose=0)
    if args.lockstep:
        return _lockstep(sync, model, x, y)
    took, cpu = [], []
    for _ in range(args.repeat):
        c0 = _cpu_s()
        t0 = time.perf_counter()
        sync.fit(model, x, y, epochs=1, shuffle=False, verbose=0)
        took.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
    with open(args.out, "w") as fh:
        json.dump(
            {
                "fit_s": min(took),
                "fits_s": took,
                "cpu_s": min(cpu),
                "returned_at": time.time(),
                "run_id": sync.run_id,
            },
            fh,
        )
    return 0  # the exit waits for what is left to deliver (atexit)


def _lockstep(sync: object, model: object, x: object, y: object) -> int:
    """Fit once per ``go`` line on stdin, answering each with one JSON line; ``stop`` ends (see `run_lockstep`)."""
    print("@bench " + json.dumps({"pid": os.getpid()}), flush=True)  # ready
    for line in sys.stdin:
        if line.strip() != "go":
            break
        c0 = _cpu_s()
        t0 = time.perf_counter()
        sync.fit(model, x, y, epochs=1, shuffle=False, verbose=0)
        took = time.perf_counter() - t0
        print("@bench " + json.dumps({"fit_s": took, "cpu_s": _cpu_s() - c0}), flush=True)
    print("@bench " + json.dumps({"returned_at": time.time(), "run_id": sync.run_id}), flush=True)
    return 0  # the exit waits for what is left to deliver (atexit)


def _cpu_s() -> float:
    """CPU seconds used so far by this process (every thread) and its running children (the courier)."""
    return _tree_cpu(os.getpid())


def _child_cmd(case: str, metrics: str, uri: str, out: str, *extra: str) -> list[str]:
    """The command of one benchmark process of ``case``."""
    _, steps, warm, every, _, _, _ = CASES[case]
    return [
        sys.executable,
        __file__,
        "--child",
        "--metrics",
        metrics,
        "--uri",
        uri,
        "--steps",
        str(steps),
        "--every",
        "default" if every is None else str(every),
        "--out",
        out,
        *extra,
    ] + (["--warm"] if warm else [])


def _child_env() -> dict:
    """This environment without what would send a benchmark process's run elsewhere."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG", "TF_CONFIG")
    }


def run_child(case: str, metrics: str, uri: str, out: str) -> dict:
    cmd = _child_cmd(case, metrics, uri, out, "--repeat", str(CASES[case][6]))
    r = subprocess.run(
        cmd,
        env=_child_env(),
        capture_output=True,
        text=True,
        cwd=os.path.dirname(out),
        timeout=1800,
    )
    ended = time.time()
    if r.returncode != 0:
        raise RuntimeError(f"{case}/{metrics} failed ({r.returncode}): {r.stderr[-2000:]}")
    res = json.loads(open(out).read())
    res["exit_wait_s"] = ended - res["returned_at"]
    res["stderr"] = r.stderr
    return res


def _tree_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and its children (the courier), from /proc."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if p == str(pid) or stat[1] == str(pid):
            total += (int(stat[11]) + int(stat[12])) / tick
    return total


def _wait_quiet(pid: int, limit_s: float = 60.0) -> None:
    """Wait until ``pid``'s tree has used under 5% of a core for ``QUIET_S`` seconds.

    The courier draws a fit's report picture when the report reaches it: a shorter quiet spell
    could let that drawing fall into the other process's fit.
    """
    t0 = quiet_since = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        c0 = _tree_cpu(pid)
        time.sleep(0.3)
        now = time.perf_counter()
        if _tree_cpu(pid) - c0 >= 0.015:
            quiet_since = now
        elif now - quiet_since > QUIET_S:
            return


def run_lockstep(case: str, uris: dict, outs: dict) -> dict:
    """One off and one on process, started together, fitting in turn (off, on, on, off, ...).

    Each fit starts once the other process is quiet (its courier done), so neither fit shares the
    cores with the other process; the two fits of a round are seconds apart, so the machine's
    drift (the same fit took 4.5-10 s over a day here) falls on both. Each fit's CPU is counted
    from its start until its process is quiet again: what delivery does after `fit` returned
    is in the ``cpu`` figure, not hidden in the other process's turn.
    """
    repeat = CASES[case][6]
    procs = {}
    for metrics in ("off", "on"):
        cmd = _child_cmd(case, metrics, uris[metrics], outs[metrics], "--lockstep")
        err = open(outs[metrics] + ".stderr", "w")
        procs[metrics] = subprocess.Popen(
            cmd,
            env=_child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=os.path.dirname(outs[metrics]),
        )
        err.close()

    def answer(metrics: str) -> object:
        """The child's next protocol line (other stdout lines are the user's: skipped)."""
        for line in procs[metrics].stdout:
            if line.startswith("@bench "):
                return line[len("@bench ") :].strip()
        stderr = open(outs[metrics] + ".stderr").read()[-2000:]
        raise RuntimeError(f"{case}/{metrics} ended ({procs[metrics].wait()}): {stderr}")

    try:
        # "ready": imported, built, warmed up; its pid (not the Popen's under a wrapper: the test zygote)
        pids = {metrics: json.loads(answer(metrics))["pid"] for metrics in procs}
        fits: dict = {"off": [], "on": []}
        cycle_cpu: dict = {"off": [], "on": []}
        rounds = []
        for k in range(repeat):
            order = ("off", "on") if k % 2 == 0 else ("on", "off")
            got = {}
            for metrics in order:
                _wait_quiet(pids["on" if metrics == "off" else "off"])
                _wait_quiet(pids[metrics])
                c0 = _tree_cpu(pids[metrics])
                procs[metrics].stdin.write("go\n")
                procs[metrics].stdin.flush()
                res = json.loads(answer(metrics))
                _wait_quiet(pids[metrics])
                got[metrics] = res["fit_s"]
                fits[metrics].append(res["fit_s"])
                cycle_cpu[metrics].append(_tree_cpu(pids[metrics]) - c0)
            rounds.append(got["on"] / got["off"])
        result = {"rounds": rounds, "fits": fits, "cycle_cpu": cycle_cpu}
        for metrics, p in procs.items():
            p.stdin.write("stop\n")
            p.stdin.close()
            result[metrics] = json.loads(answer(metrics))
        for metrics, p in procs.items():
            if p.wait(timeout=1800) != 0:
                stderr = open(outs[metrics] + ".stderr").read()[-2000:]
                raise RuntimeError(f"{case}/{metrics} failed ({p.returncode}): {stderr}")
            result[metrics]["ended"] = time.time()
        return result
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def check_mlflow(uri: str, case: str) -> str:
    """After the process ended: FINISHED, and every step logged is there ('ok'), else what is missing."""
    from mlflow import MlflowClient

    _, steps, warm, every, _, _, repeat = CASES[case]
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("bench")
    runs = c.search_runs([exp.experiment_id]) if exp else []
    if len(runs) != 1:
        return f"{len(runs)} runs"
    run = runs[0]
    total = steps * (repeat + (1 if warm else 0))
    got = sorted(m.step for m in c.get_metric_history(run.info.run_id, "sync/loss/replica_0"))
    if every == 1 and got != list(range(1, total + 1)):
        return f"{len(got)}/{total} steps"
    if every is None and (not got or got[-1] != total):  # auto: each epoch's last step is logged
        return f"last step {got[-1] if got else None} of {total}"
    if run.info.status != "FINISHED":
        return run.info.status
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--cases", default=None, help="default: all (--quick: busy,default,down)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of every code path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--metrics", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--every", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally`s end the processes
    if args.quick:
        global QUIET_S
        QUIET_S, args.pairs = 0.0, 1
        args.cases = args.cases or "busy,default,down"
        for name, (busy_n, _, warm, every, store, goal, _) in CASES.items():
            CASES[name] = (busy_n, QUICK_STEPS, warm, every, store, goal, 1)

    tmp = tempfile.mkdtemp(prefix="bench_sync_metrics_")
    load0 = os.getloadavg()[0]
    rows = []
    for case in (args.cases or ",".join(CASES)).split(","):
        busy_n, steps, warm, every, store, goal, _ = CASES[case]
        busy = busy_loops(busy_n)
        ratios, on_s, off_s, waits, checks, raw, cpu_ratios = [], [], [], [], [], {}, []
        try:
            for i in range(args.pairs):
                uris, outs = {}, {}
                for metrics in ("off", "on"):
                    d = os.path.join(tmp, f"{case}-{i}-{metrics}")
                    os.makedirs(d)
                    if store == "down":
                        with socket.socket() as s:
                            s.bind(("127.0.0.1", 0))
                            uris[metrics] = (
                                f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
                            )
                    else:
                        uris[metrics] = f"sqlite:///{d}/mlflow.db"  # fresh: created by this process
                    outs[metrics] = os.path.join(d, "out.json")
                if warm:
                    res = run_lockstep(case, uris, outs)
                    ratios.append(statistics.median(res["rounds"]))
                    cpu_ratios.append(
                        statistics.median(
                            [a / b for a, b in zip(res["cycle_cpu"]["on"], res["cycle_cpu"]["off"])]
                        )
                    )
                    times = {m: min(res["fits"][m]) for m in ("off", "on")}
                    waits.append(res["on"]["ended"] - res["on"]["returned_at"])
                    for m in ("off", "on"):
                        raw.setdefault(m, []).append(res["fits"][m])
                    detail = (
                        f"rounds (on/off, fits seconds apart) {' '.join(f'{r:.3f}' for r in res['rounds'])}; "
                        f"CPU s per fit until its process was quiet again: off "
                        f"{' '.join(f'{c:.2f}' for c in res['cycle_cpu']['off'])}, on "
                        f"{' '.join(f'{c:.2f}' for c in res['cycle_cpu']['on'])}, ratio {cpu_ratios[-1]:.3f}"
                    )
                else:
                    times, cpus = {}, {}
                    for metrics in ("off", "on") if i % 2 == 0 else ("on", "off"):
                        one = run_child(case, metrics, uris[metrics], outs[metrics])
                        times[metrics], cpus[metrics] = one["fit_s"], one["cpu_s"]
                        raw.setdefault(metrics, []).append(one["fits_s"])
                        if metrics == "on":
                            waits.append(one["exit_wait_s"])
                    ratios.append(times["on"] / times["off"])
                    cpu_ratios.append(cpus["on"] / cpus["off"])
                    detail = (
                        f"CPU s (process + courier, the fit) off {cpus['off']:.2f}, on {cpus['on']:.2f}, "
                        f"ratio {cpu_ratios[-1]:.3f}"
                    )
                checks.append(check_mlflow(uris["on"], case) if store != "down" else "-")
                on_s.append(times["on"])
                off_s.append(times["off"])
                print(
                    f"{case} pair {i + 1}: off {times['off']:.2f}s, on {times['on']:.2f}s, ratio {ratios[-1]:.3f} "
                    f"(every fit: off {' '.join(f'{t:.2f}' for t in raw['off'][-1])}, "
                    f"on {' '.join(f'{t:.2f}' for t in raw['on'][-1])}), "
                    f"exit wait {waits[-1]:.2f}s, MLflow at exit: {checks[-1]}; {detail}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for p in busy:
                p.kill()
                p.wait()
        rows.append(
            (
                case,
                busy_n,
                steps,
                warm,
                every,
                goal,
                statistics.median(ratios),
                off_s,
                on_s,
                waits,
                checks,
                statistics.median(cpu_ratios),
            )
        )

    import keras_sync

    print(
        f"\nsync.fit, 2 simulated CPU replicas, Dense 8-16-1, per-replica batch 16; {args.pairs} process pairs "
        f"per case (fresh process and sqlite store each); load average {load0:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end (keras-sync {keras_sync.__version__})"
    )
    print(
        f"{'case':<12}{'busy':>5}{'steps':>6}{'warm':>5}{'every':>8}{'ratio':>8}{'goal':>7}  "
        f"{'cpu':>7}  {'off s (raw)':<22}{'on s (raw)':<22}{'exit wait s':<20}in MLflow at exit"
    )
    for (
        case,
        busy_n,
        steps,
        warm,
        every,
        goal,
        ratio,
        off_s,
        on_s,
        waits,
        checks,
        cpu_ratio,
    ) in rows:
        fmt = lambda v: " ".join(f"{t:.2f}" for t in v)  # noqa: E731
        print(
            f"{case:<12}{busy_n:>5}{steps:>6}{'yes' if warm else 'no':>5}{'default' if every is None else every:>8}"
            f"{ratio:>7.3f}x{'<=' + format(goal, 'g'):>7}{cpu_ratio:>6.3f}x  {fmt(off_s):<21} {fmt(on_s):<21} {fmt(waits):<19} "
            + (
                "- (no server to read)"
                if all(c == "-" for c in checks)
                else f"{sum(c == 'ok' for c in checks)}/{len(checks)} ok"
                + ("" if all(c == "ok" for c in checks) else f" ({', '.join(checks)})")
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
