"""How fast `keras-sync --help` starts, as a ratio to `python -c "import tensorflow"` (goal <= 0.1).

Both are measured in the same run, in fresh processes, alternating, and the medians compared:

    .venv/bin/python benchmarks/bench_cli_help.py [--repeats 5] [--quick]

``--quick``: one of each, no warm-up, no verdict in the exit code (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL = 0.1


def wall_time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    help_cmd = [str(Path(sys.executable).with_name("keras-sync")), "--help"]
    tf_cmd = [sys.executable, "-c", "import tensorflow"]
    if not args.quick:
        wall_time(help_cmd), wall_time(tf_cmd)  # warm the file cache
    helps, tfs = [], []
    for _ in range(args.repeats):
        helps.append(wall_time(help_cmd))
        tfs.append(wall_time(tf_cmd))
    h, t = statistics.median(helps), statistics.median(tfs)
    ratio = h / t
    print(f"keras-sync --help             median {h * 1000:8.1f} ms  (n={args.repeats})")
    print(f"python -c 'import tensorflow' median {t * 1000:8.1f} ms  (n={args.repeats})")
    print(f"ratio {ratio:.3f} (goal <= {GOAL}): {'OK' if ratio <= GOAL else 'TOO SLOW'}")
    return 0 if ratio <= GOAL or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
