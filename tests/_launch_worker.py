"""A tiny worker for tests/test_launch.py: `MODE [DIR]`, no TensorFlow.

print: prints its TF_CONFIG, KERAS_SYNC_CONFIG, PYTHONUNBUFFERED and argv as JSON, one line on stderr.
fail-or-hang DIR: w1 exits 3 once w0 is ready; w0 ignores SIGTERM/SIGINT and sleeps.
hang DIR: both sleep; w1 ignores SIGTERM/SIGINT.
fail-once DIR / fail-always DIR: print `job <KERAS_SYNC_JOB_ID> try <KERAS_SYNC_RESTART_COUNT>`; w1 exits 3 (fail-once: only on its
first try, KERAS_SYNC_RESTART_COUNT=0); in a failing try w0 runs until the launcher stops it, else exits 0.
In DIR, each worker writes wI.pid and wI.child (the pid of a child it started).
"""

import json
import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if mode == "print":
    print(
        json.dumps(
            {
                "tf_config": json.loads(os.environ["TF_CONFIG"]),
                "config": os.environ.get("KERAS_SYNC_CONFIG"),
                "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
                "argv": sys.argv[2:],
            }
        )
    )
    print(f"stderr of {index}", file=sys.stderr)
    sys.exit(0)

folder = sys.argv[2]
if mode in ("fail-once", "fail-always"):
    # The launcher numbers the tries: every worker of a try agrees on it, however late it starts
    # (a worker that counted its own starts could be stopped before it counted: seen in CI).
    restart = os.environ["KERAS_SYNC_RESTART_COUNT"]
    print(f"job {os.environ.get('KERAS_SYNC_JOB_ID')} try {restart}", flush=True)
    failing_try = mode == "fail-always" or restart == "0"
    if index == 1 and failing_try:
        sys.exit(3)
    while (
        index == 0 and failing_try
    ):  # stays until the launcher stops it (no race with w1's failure)
        time.sleep(0.05)
    sys.exit(0)
stubborn = (mode == "fail-or-hang" and index == 0) or (mode == "hang" and index == 1)
if stubborn:  # like a worker blocked in a collective: deaf to SIGTERM and SIGINT
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def publish(name, value):
    tmp = os.path.join(folder, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, os.path.join(folder, name))


publish(f"w{index}.child", child.pid)
publish(f"w{index}.pid", os.getpid())
print(f"worker {index} ready", flush=True)
if mode == "fail-or-hang" and index == 1:
    while not os.path.exists(os.path.join(folder, "w0.pid")):
        time.sleep(0.02)
    sys.exit(3)
while True:
    time.sleep(1)
