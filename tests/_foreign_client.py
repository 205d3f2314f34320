"""A TensorFlow client that is no worker of the job: runs ops on a worker's server, as any host could.

Usage: python _foreign_client.py HOST:PORT FILE. Writes FILE on the worker at HOST:PORT and prints
what it reads back (tests/test_launch.py runs it on 127.0.0.1 only).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

address, path = sys.argv[1:3]
tf.config.experimental_connect_to_host(address, job_name="worker")
with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    tf.io.write_file(path, tf.constant("written by a client that is not in the job"))
    print(tf.io.read_file(path).numpy().decode(), flush=True)
