"""What keras-sync's spool and courier buy against MLflow's own asynchronous logging plus a local file.

    .venv/bin/python benchmarks/bench_delivery.py [--rounds 2] [--cases quiet_sqlite,quiet_http,busy,outage,kill] [--quick]

Three variants train the same model (2 simulated CPU replicas under MirroredStrategy, Dense
8-16-1, per-replica batch 16, as bench_sync_metrics), each a fresh Python process:

- ``keras``: plain `model.fit`, no logging: the baseline of each ratio.
- ``courier``: keras-sync's `sync.fit` with ``log_every_n_steps: 1`` (the training process
  appends records to a spool file; a courier process delivers them with `log_batch`).
- ``async``: plain `model.fit` plus `SpoolAndAsyncLog` below, what an engineer would write as
  "MLflow's asynchronous logging plus a local spool file": each step appends its metrics as a
  JSON line to a local file, then `MlflowClient().log_batch(..., synchronous=False)`; at train
  end it waits for every returned future and sets the run FINISHED (FAILED if one raised). It logs `POINTS_PER_STEP`
  points per step, as many as keras-sync's every-step setting (counted in its MLflow data; the
  benchmark checks that count again), but computes nothing per replica.

Cases (each round runs every case, its variants in an order that rotates from round to round):

- ``quiet_sqlite`` / ``quiet_http``: a local sqlite store / a real `mlflow server` on 127.0.0.1.
- ``busy``: two CPU-bound busy loops beside training, sqlite store.
- ``outage``: the `mlflow server` is stopped (SIGKILL) once a quarter of the steps ran, restarted
  `OUTAGE_S` later on the same port and store; each step sleeps `SLOW_STEP_S` (a heavier
  model's step) so the outage falls inside the fit. ``keras`` sees the same stop and restart.
- ``kill``: the training process is SIGKILLed once half the steps ran (it writes its step to a
  file); then up to `AFTER_KILL_S` for anything left (keras-sync's courier) to deliver.

A row gives, per variant: fit seconds; the exit (from `fit`'s return to the process's end); CPU
seconds of the process and its children from the fit's start to the process's end; the fit and
CPU as ratios to ``keras`` of the same round; the points in MLflow at the end against the points
logged (``kill``: against the steps reached times `POINTS_PER_STEP`, and for ``async`` the points
its local file holds); the run's status. Raw values of every round are printed. The load average
at the start and end is printed: the machine may be shared. Traffic goes to 127.0.0.1 only.
``--quick`` is a smoke run of every code path (`QUICK_CASES`): its figures mean nothing.
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
import threading
import time
import urllib.request

from bench_sync_metrics import _tree_cpu as tree_cpu  # the same /proc reading
from bench_sync_metrics import busy_loops

#: Points keras-sync logs per step with ``log_every_n_steps: 1`` (loss and 10 ``sync/`` metrics).
POINTS_PER_STEP = 11
#: Points keras-sync logs once at a fit's end (``sync/weight_divergence``, ``sync/diverged_variables``).
END_POINTS = 2
OUTAGE_S = 20.0
SLOW_STEP_S = 0.02
AFTER_KILL_S = 60.0

CASES = {
    # name: (store, busy loops, steps, event, variants)
    "quiet_sqlite": ("sqlite", 0, 400, None, ("keras", "courier", "async")),
    "quiet_http": ("http", 0, 400, None, ("keras", "courier", "async")),
    "busy": ("sqlite", 2, 400, None, ("keras", "courier", "async")),
    "outage": ("http", 0, 600, "outage", ("keras", "courier", "async")),
    "kill": ("http", 0, 600, "kill", ("courier", "async")),
}
#: --quick: 1 round of `QUICK_CASES` (quiet_http and busy take no path of their own), few steps, a
#: short outage; outage and kill with keras-sync's variant only.
QUICK_CASES = {
    "quiet_sqlite": CASES["quiet_sqlite"][4],
    "outage": ("courier",),
    "kill": ("courier",),
}
QUICK_STEPS, QUICK_OUTAGE_S = 40, 1.0


def make_callbacks(a: argparse.Namespace) -> list:
    """The callbacks of a training process: `Progress` if asked, `SpoolAndAsyncLog` for ``async``."""
    import keras

    class SpoolAndAsyncLog(keras.callbacks.Callback):
        """Each step: its metrics as a JSON line in a local file, then an asynchronous `log_batch`."""

        def __init__(self, uri: str, experiment: str, spool: str) -> None:
            super().__init__()
            from mlflow import MlflowClient

            self.client = MlflowClient(uri)
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id).info.run_id
            self.spool = open(spool, "a")
            self.futures: list = []
            self.step = 0

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            from mlflow.entities import Metric

            self.step += 1
            ms = (time.perf_counter() - self.t0) * 1000
            loss = float((logs or {})["loss"])
            values = {"loss": loss, "step_time_ms": ms, "examples_per_sec": 32e3 / ms}
            values.update({f"extra_{i}": loss for i in range(POINTS_PER_STEP - len(values))})
            ts = int(time.time() * 1000)
            self.spool.write(json.dumps({"step": self.step, "ts": ts, "metrics": values}) + "\n")
            self.spool.flush()
            metrics = [Metric(k, v, ts, self.step) for k, v in values.items()]
            self.futures.append(
                self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)
            )

        def on_train_end(self, logs: dict | None = None) -> None:
            failed = 0
            for f in self.futures:
                try:
                    f.wait()
                except Exception:  # a lost batch is what the benchmark counts
                    failed += 1
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.spool.close()

    class Progress(keras.callbacks.Callback):
        """Writes the step reached to a file (the parent's clock for an outage or a kill); sleeps if asked."""

        def __init__(self, path: str, sleep_s: float) -> None:
            super().__init__()
            self.fh, self.sleep_s, self.step = open(path, "w"), sleep_s, 0

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.step += 1
            if self.sleep_s:
                time.sleep(self.sleep_s)
            self.fh.seek(0)
            self.fh.write(f"{self.step:09d}")
            self.fh.flush()

    callbacks: list = []
    if a.progress:
        callbacks.append(Progress(os.path.join(a.dir, "progress"), a.sleep))
    if a.variant == "async":
        callbacks.append(SpoolAndAsyncLog(a.uri, a.experiment, os.path.join(a.dir, "spool.jsonl")))
    return callbacks


def child(a: argparse.Namespace) -> int:
    """One training process: build, fit once with ``a.variant``; the timings go to ``out.json``."""
    with open(
        os.path.join(a.dir, "pid"), "w"
    ) as fh:  # not the Popen's under a wrapper (test zygote)
        fh.write(str(os.getpid()))
    import keras
    import numpy as np

    if a.variant == "courier":
        import keras_sync

        sync = keras_sync.load(
            {
                "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
                "batch": {"per_replica": 16},
                "learning_rate": {"base": 0.01, "scaling": "none"},
                "mlflow": {
                    "tracking_uri": a.uri,
                    "experiment": a.experiment,
                    "log_every_n_steps": 1,
                },
            }
        )
        scope, lr = sync.scope(), sync.lr_schedule()
    else:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
        scope, lr = strategy.scope(), 0.01
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * a.steps, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with scope:
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    # The timed fit starts before the callbacks: `sync.fit` imports MLflow and creates its run too.
    c0, t0 = tree_cpu(os.getpid()), time.perf_counter()
    fit_args = {"epochs": 1, "shuffle": False, "verbose": 0, "callbacks": make_callbacks(a)}
    if a.variant == "courier":
        sync.fit(model, x, y, **fit_args)
    else:
        model.fit(x, y, batch_size=32, **fit_args)
    took = time.perf_counter() - t0
    with open(os.path.join(a.dir, "out.json"), "w") as fh:
        json.dump({"fit_s": took, "cpu_at_fit_s": c0, "returned_at": time.time()}, fh)
    return 0  # keras-sync's exit waits for what is left to deliver


def children_of(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                out.append(int(p))
        except OSError:
            continue
    return out


class Server:
    """A real `mlflow server` on 127.0.0.1 over one sqlite store; `stop` and `start` keep port and store."""

    def __init__(self, d: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri, self.d, self.proc = f"http://127.0.0.1:{self.port}", d, None

    def start(self) -> float:
        """Start and wait until it answers; returns the seconds that took."""
        t0 = time.perf_counter()
        mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
        cmd = [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(self.port), "-w", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.d}/server.db"]
        cmd += ["--default-artifact-root", f"{self.d}/artifacts"]
        log = open(os.path.join(self.d, "server.log"), "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        while time.perf_counter() - t0 < 180:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"mlflow server did not answer at {self.uri}; see {self.d}/server.log")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session, started above
            self.proc.wait()
        self.proc = None


def read_mlflow(uri: str, experiment: str) -> dict:
    """The experiment's one run: its status and how many metric points it holds."""
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    runs = c.search_runs([exp.experiment_id]) if exp else []
    if len(runs) != 1:
        return {"status": f"{len(runs)} runs", "points": 0, "per_step": 0}
    run = runs[0]
    histories = [c.get_metric_history(run.info.run_id, k) for k in run.data.metrics]
    max_step = max((m.step for h in histories for m in h), default=0)
    per_step = sum(1 for h in histories if len(h) > 1 or (h and h[0].step != max_step))
    return {"status": run.info.status, "points": sum(map(len, histories)), "per_step": per_step}


def run_one(case: str, variant: str, rnd: int, tmp: str, server: Server) -> dict:
    store, _, steps, event, _ = CASES[case]
    d = os.path.join(tmp, f"{case}-{variant}-{rnd}")
    os.makedirs(d)
    experiment = f"{case}-{variant}-{rnd}"
    uri = f"sqlite:///{d}/mlflow.db" if store == "sqlite" else server.uri
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--uri", uri, "--dir", d]
    cmd += ["--steps", str(steps), "--experiment", experiment]
    if event:
        cmd += ["--progress", "--sleep", str(SLOW_STEP_S if event == "outage" else 0.0)]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG", "TF_CONFIG")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    err = open(os.path.join(d, "stderr"), "w")
    p = subprocess.Popen(cmd, env=env, cwd=d, stdout=err, stderr=err)
    res: dict = {"case": case, "variant": variant, "round": rnd}
    progress = os.path.join(d, "progress")

    def reached() -> int:
        try:
            return int(open(progress).read() or 0)
        except (OSError, ValueError):
            return 0

    def outage() -> None:
        server.stop()
        time.sleep(OUTAGE_S)
        res["restart_s"] = server.start()

    outage_thread = threading.Thread(target=outage)  # the process's exit is timed meanwhile
    if event == "outage":
        while p.poll() is None and reached() < steps // 4:
            time.sleep(0.05)
        outage_thread.start()
    if event == "kill":
        while p.poll() is None and reached() < steps // 2:
            time.sleep(0.005)
        couriers = children_of(int(open(os.path.join(d, "pid")).read()))
        p.kill()
        p.wait()
        killed_at = time.perf_counter()
        res["steps_reached"] = reached()
        while any(os.path.exists(f"/proc/{c}") for c in couriers):
            if time.perf_counter() - killed_at > AFTER_KILL_S:
                break
            time.sleep(0.2)
        res["after_kill_s"] = time.perf_counter() - killed_at
    else:
        _, status, usage = os.wait4(p.pid, 0)  # its CPU, with the children it reaped (the courier)
        ended = time.time()
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            raise RuntimeError(
                f"{experiment} failed: {open(os.path.join(d, 'stderr')).read()[-2000:]}"
            )
        out = json.load(open(os.path.join(d, "out.json")))
        res.update(
            fit_s=out["fit_s"],
            cpu_s=usage.ru_utime + usage.ru_stime - out["cpu_at_fit_s"],
            exit_s=ended - out["returned_at"],
            done_s=out["fit_s"] + ended - out["returned_at"],
        )
    err.close()
    if outage_thread.is_alive():
        outage_thread.join()
    res.update(read_mlflow(uri, experiment))
    if variant != "keras":
        ends = END_POINTS if variant == "courier" and event != "kill" else 0
        res["logged"] = res.get("steps_reached", steps) * POINTS_PER_STEP + ends
    spool = os.path.join(d, "spool.jsonl")
    if os.path.exists(spool):
        res["in_file"] = sum(1 for _ in open(spool)) * POINTS_PER_STEP
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=None, help="default: all")
    ap.add_argument("--quick", action="store_true", help="a smoke run of every code path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--variant", "--uri", "--dir", "--experiment"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--progress", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally`s end the processes
    if args.quick:
        global OUTAGE_S
        OUTAGE_S, args.rounds = QUICK_OUTAGE_S, 1
        args.cases = args.cases or ",".join(QUICK_CASES)
        for name, (store, busy_n, _, event, variants) in CASES.items():
            CASES[name] = (store, busy_n, QUICK_STEPS, event, QUICK_CASES.get(name, variants))

    tmp = tempfile.mkdtemp(prefix="bench_delivery_")
    load0 = os.getloadavg()
    print(
        f"load average at start: {' '.join(f'{v:.2f}' for v in load0)}; files in {tmp}", flush=True
    )
    server = Server(tmp)
    server.start()
    results = []
    try:
        for rnd in range(args.rounds):
            for k, case in enumerate((args.cases or ",".join(CASES)).split(",")):
                variants = CASES[case][4]
                shift = (rnd + k) % len(variants)
                busy = busy_loops(CASES[case][1])
                try:
                    for variant in variants[shift:] + variants[:shift]:
                        res = run_one(case, variant, rnd, tmp, server)
                        results.append(res)
                        print(json.dumps(res), flush=True)
                finally:
                    for b in busy:
                        b.kill()
                        b.wait()
    finally:
        server.stop()
    report(results, args.rounds, load0)
    return 0


def report(results: list[dict], rounds: int, load0: tuple) -> None:
    """One row per case and variant: medians over the rounds, ratios to ``keras`` of the same round."""
    by = {(r["case"], r["variant"], r["round"]): r for r in results}
    print(
        f"\n2 simulated CPU replicas, Dense 8-16-1, per-replica batch 16; {rounds} round(s); "
        f"{POINTS_PER_STEP} points per step; load average {' '.join(f'{v:.2f}' for v in load0)} at "
        f"start, {' '.join(f'{v:.2f}' for v in os.getloadavg())} at end"
    )
    print(
        f"{'case':<13}{'variant':<9}{'fit s':>7}{'/keras':>8}{'+exit s':>9}{'/keras':>8}"
        f"{'cpu s':>7}{'/keras':>8}  in MLflow/logged per round, status, raw values"
    )
    for case in dict.fromkeys(r["case"] for r in results):
        for variant in CASES[case][4]:
            rows = [r for r in results if (r["case"], r["variant"]) == (case, variant)]
            cells = []
            for key in ("fit_s", "done_s", "cpu_s"):
                vals = [r[key] for r in rows if key in r]
                ratios = [
                    r[key] / by[(case, "keras", r["round"])][key]
                    for r in rows
                    if key in r and (case, "keras", r["round"]) in by
                ]
                cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
                cells.append(f"{statistics.median(ratios):.3f}" if ratios else "-")
            points = " ".join(
                f"{r['points']}/{r.get('logged', 0)}"
                + (f" (file {r['in_file']})" if "in_file" in r else "")
                for r in rows
            )
            raw = {
                k: [round(r[k], 2) for r in rows if k in r]
                for k in ("fit_s", "exit_s", "cpu_s", "restart_s", "steps_reached", "after_kill_s")
            }
            print(
                f"{case:<13}{variant:<9}{cells[0]:>7}{cells[1]:>8}{cells[2]:>9}{cells[3]:>8}"
                f"{cells[4]:>7}{cells[5]:>8}  {points}, "
                f"{' '.join(sorted({r['status'] for r in rows}))}, "
                f"points per step {sorted({r['per_step'] for r in rows})}; "
                + ", ".join(f"{k} {v}" for k, v in raw.items() if v)
            )


if __name__ == "__main__":
    sys.exit(main())
