"""Per-call cost of `MlflowWriter.log_metrics` against `mlflow.log_metric`, on a sqlite store.

Run: ``.venv/bin/python benchmarks/bench_tracking_writer.py [--calls N] [--tracking-uri URI] [--quick]``

Both sides log one metric per call to a store that is already migrated. The writer's calls only
queue; the time until its background thread has delivered everything (``flush``) is printed
too, so the comparison hides nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _percentile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls of mlflow.log_metric (slow side)")
    ap.add_argument(
        "--writer-calls", type=int, default=20_000, help="calls of MlflowWriter.log_metrics"
    )
    ap.add_argument(
        "--tracking-uri", default=None, help="default: a fresh sqlite file in a temp dir"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 and 200 calls")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.writer_calls = 20, 200

    tmp = tempfile.mkdtemp(prefix="bench_tracking_")
    os.chdir(tmp)
    uri = args.tracking_uri or f"sqlite:///{tmp}/mlflow.db"

    import mlflow
    from mlflow import MlflowClient

    from keras_sync.tracking import MlflowWriter

    MlflowClient(uri).search_experiments()  # migrate the store outside the timings
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bench")

    with mlflow.start_run():
        mlflow.log_metric("loss", 0.0, step=0)  # warm-up
        fluent = []
        for i in range(args.calls):
            t0 = time.perf_counter()
            mlflow.log_metric("loss", 1.0 / (i + 1), step=i)
            fluent.append(time.perf_counter() - t0)

    w = MlflowWriter(tracking_uri=uri, experiment="bench", spool_dir=tmp)
    w.start()
    w.log_metrics({"loss": 0.0}, step=0)
    assert w.flush(60), "warm-up not delivered"
    ours = []
    t_all = time.perf_counter()
    for i in range(args.writer_calls):
        t0 = time.perf_counter()
        w.log_metrics({"loss": 1.0 / (i + 1)}, step=i)
        ours.append(time.perf_counter() - t0)
    t_logged = time.perf_counter()
    delivered = w.flush(120)
    t_flushed = time.perf_counter()
    w.close()

    f_mean, o_mean = statistics.mean(fluent), statistics.mean(ours)
    print(f"store: {uri.split('://')[0]}   (mlflow {mlflow.__version__})")
    print(
        f"mlflow.log_metric        : {args.calls:6d} calls  mean {f_mean * 1e6:9.1f} us  "
        f"p99 {_percentile(fluent, 0.99) * 1e6:9.1f} us  max {max(fluent) * 1e3:7.2f} ms"
    )
    print(
        f"MlflowWriter.log_metrics : {args.writer_calls:6d} calls  mean {o_mean * 1e6:9.1f} us  "
        f"p99 {_percentile(ours, 0.99) * 1e6:9.1f} us  max {max(ours) * 1e3:7.2f} ms"
    )
    print(
        f"ratio (log_metric / MlflowWriter.log_metrics, mean per call): {f_mean / o_mean:,.0f}x; "
        f"median per call: {statistics.median(fluent) / statistics.median(ours):,.0f}x"
    )
    print(
        "note: a writer call's max is a full gc collection of the MLflow-sized heap landing in "
        "the caller, not the writer; gc.freeze() after imports removes it"
    )
    print(
        f"writer: {args.writer_calls} points queued in {t_logged - t_all:.3f} s, all delivered "
        f"{t_flushed - t_logged:.3f} s later (delivered={delivered}); "
        f"end-to-end {(t_flushed - t_all) / args.writer_calls * 1e6:.1f} us/point vs "
        f"{f_mean * 1e6:.1f} us/point synchronous"
    )


if __name__ == "__main__":
    main()
