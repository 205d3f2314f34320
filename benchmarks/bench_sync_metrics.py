"""What the sync metrics cost a user: whole `sync.fit` calls, the wait at their end included.

    .venv/bin/python benchmarks/bench_sync_metrics.py [--rounds 3] [--steps 1500] [--busy 0|2]
        [--store sqlite|http|down] [--deliver process|thread]

The model is the issue's: 2 simulated CPU replicas, Dense 8-16-1, per-replica batch 16, one
epoch of ``--steps`` steps per fit. One process runs every variant, each with its own `Sync` and
model: metrics off (the baseline, measured in the same process), our metrics every step, every
50 steps, ``auto``, and with ``log_every_n_steps`` left at its default. One untimed warm-up fit per variant
takes tracing, run creation and the courier's start out of the timing. Then each round runs every
variant once in a fresh random order. A fit's time is what the user waits for: from calling
`sync.fit` to its return, the end-of-fit wait for delivery included. After each fit an untimed
check records whether MLflow had every metric point when `fit` returned (the sync report, drawn
by the courier, follows just after).

Reported per variant: fastest fit, median fit, and the ratios to the baseline (fastest over
fastest; median of the per-round ratios). The issue's goals: every step <= 1.10x, every 50 steps
<= 1.03x on a quiet machine; <= 1.3x with both cores busy (``--busy 2`` starts two busy-loop
processes) and every step in MLflow at the end; <= 1.5x with the server down (``--store down``).

``--store http`` starts a real ``mlflow server`` (sqlite behind it, one worker); ``--deliver
thread`` runs the courier's delivery loop in a thread of the training process instead of a child
process (the alternative the courier's docstring argues against), to measure both.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def start_server(root: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/srv.db",
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=1):
                return proc, uri
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("mlflow server did not start")


class _ThreadCourier:
    """Stands in for the courier process: the same delivery loop, in a thread of this process."""

    def __init__(self, spool, uri):
        from keras_sync._courier import Delivery

        self._stop = False
        spool.wait_lock("deliver")
        self._delivery = Delivery(spool, uri)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.returncode = None

    def _serve(self):
        from keras_sync import _courier

        d = self._delivery
        while not self._stop and not d.ended:
            try:
                d.deliver_available()
                d.report(None)
            except Exception as e:  # noqa: BLE001
                d.report(e)
                time.sleep(1.0)
            time.sleep(_courier.POLL_S)
        self.returncode = 0

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._thread.join(timeout)
        return self.returncode

    def terminate(self):
        self._stop = True

    kill = terminate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes to start beside training")
    ap.add_argument("--store", choices=("sqlite", "http", "down"), default="sqlite")
    ap.add_argument("--deliver", choices=("process", "thread"), default="process")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench_sync_metrics_")
    os.chdir(tmp)  # spools and stores stay out of the checkout
    server = None
    if args.store == "http":
        server, uri = start_server(tmp)
    elif args.store == "down":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            uri = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    else:
        uri = f"sqlite:///{tmp}/ours.db"
    if args.deliver == "thread":
        from keras_sync import _courier

        _courier.spawn = lambda spool, u: _ThreadCourier(spool, u)
    import numpy as np

    import keras_sync

    def config(enabled: bool, every: int | str | None, report: str | None = None) -> dict:
        mlflow = {"enabled": enabled, "tracking_uri": uri, "experiment": "bench"}
        if every is not None:
            mlflow["log_every_n_steps"] = every
        if report is not None:
            mlflow["sync_report"] = report
        return {"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "batch": {"per_replica": 16},
                "learning_rate": {"base": 0.01, "scaling": "none"}, "mlflow": mlflow}

    variants = {"off": config(False, None), "every_step": config(True, 1), "every_50": config(True, 50),
                "auto": config(True, "auto"), "default": config(True, None),
                # the train-end sync_report.png (matplotlib) is a cost per fit, not per step: shown apart
                "every_50_no_report": config(True, 50, report="off")}
    syncs = {name: keras_sync.load(cfg) for name, cfg in variants.items()}
    import keras

    rng = np.random.default_rng(0)
    n = 32 * args.steps
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")

    def model_for(sync):
        keras.utils.set_random_seed(0)
        with sync.scope():
            m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
            m.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
        return m

    models = {name: model_for(sync) for name, sync in syncs.items()}
    from keras_sync.callbacks._run import _writers

    complete: dict[str, list[bool]] = {name: [] for name in variants}

    def fit(name: str) -> float:
        sync = syncs[name]
        t0 = time.perf_counter()
        sync.fit(models[name], x, y, epochs=1, shuffle=False, verbose=0)
        took = time.perf_counter() - t0
        writer = _writers.get(sync)
        if writer is not None:  # untimed: did MLflow have every metric point when fit returned?
            from keras_sync._spool import SpoolDir

            spool = SpoolDir(writer.spool_path)
            left = [rec["k"] for _, rec in spool.read(spool.delivered(), max_records=10**6)]
            # The sync report's data follows the run's end: the courier draws it after fit returns.
            complete[name].append(not writer._queue and set(left) <= {"report"})
        return took

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        import warnings

        warnings.simplefilter("ignore")  # server down: one warning per variant, expected
        for name in variants:  # warm-up: tracing, run creation, store migration, courier start
            fit(name)
        for v in complete.values():
            v.clear()
        times: dict[str, list[float]] = {name: [] for name in variants}
        order_rng = random.Random(0)
        for r in range(args.rounds):
            order = list(variants)
            order_rng.shuffle(order)
            for name in order:
                times[name].append(fit(name))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.kill()
        if server is not None:
            server.kill()

    load = os.getloadavg()
    med = statistics.median
    paired = {k: med(a / b for a, b in zip(v, times["off"])) for k, v in times.items()}
    print(f"\nsync.fit, 2 simulated CPU replicas, Dense 8-16-1, per-replica batch 16, {args.steps} steps per fit, "
          f"{args.rounds} rounds; store {args.store}, delivery in a {args.deliver}, {args.busy} busy-loop "
          f"process(es); load average {load[0]:.1f} (keras {keras.version()})")
    print(f"{'variant':<20}{'fastest s':>10}{'median s':>10}{'ratio fastest':>15}{'ratio paired':>14}"
          f"{'in MLflow at fit end':>22}")
    for k in variants:
        done = complete[k]
        at_end = "-" if not done else f"{sum(done)}/{len(done)}"
        print(f"{k:<20}{min(times[k]):>10.3f}{med(times[k]):>10.3f}{min(times[k]) / min(times['off']):>15.3f}"
              f"{paired[k]:>14.3f}{at_end:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
