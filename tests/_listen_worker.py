"""A MultiWorkerMirroredStrategy worker that starts its server, says so, and waits: for tests/test_launch.py.

Usage: python _listen_worker.py RELEASE_FILE. Prints ``listening <pid>`` once the strategy is built
(TensorFlow's gRPC server is up), then waits until RELEASE_FILE exists and exits 0.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

tf.distribute.MultiWorkerMirroredStrategy()
print(f"listening {os.getpid()}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
