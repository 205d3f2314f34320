"""TensorFlow checks for tests/test_cluster.py, in one process to pay the TF import once.

Reads a JSON request on argv[1]; prints one JSON line of results.
"""

import json
import os
import socket
import sys

import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util

from keras_sync import cluster
from keras_sync.config import load_config
from keras_sync.errors import ClusterError

request = json.loads(sys.argv[1])
out = {"tf_config": [], "slurm": None, "order": {}}

for raw in request["tf_configs"]:
    os.environ["TF_CONFIG"] = raw
    cluster.parse_tf_config(raw)  # what keras-sync accepts, TensorFlow's resolver reads alike
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    out["tf_config"].append(
        {
            "cluster": spec,
            "task_type": resolver.task_type,
            "task_id": resolver.task_id,
            "is_chief": multi_worker_util.is_chief(spec, resolver.task_type, resolver.task_id),
        }
    )
del os.environ["TF_CONFIG"]

saved = dict(os.environ)
os.environ.update(request["slurm_env"])
strategy_config = load_config(
    {"strategy": {"cluster": "slurm", "slurm": {"port_base": request["port_base"]}}}
).strategy
resolver = cluster.SlurmEnvironment(strategy_config).resolver()
out["slurm"] = {
    "cluster": resolver.cluster_spec().as_dict(),
    "task_type": resolver.task_type,
    "task_id": resolver.task_id,
    "num_accelerators": resolver.num_accelerators(),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}
os.environ.clear()
os.environ.update(saved)

# A one-worker cluster is enough to make TensorFlow join a cluster and start its server.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
first = json.dumps(
    {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}
)
os.environ["TF_CONFIG"] = first
strategy = tf.distribute.MultiWorkerMirroredStrategy()
cluster.record_strategy_tf_config(first)
cluster.check_tf_config_order()  # unchanged: fine
out["order"]["replicas"] = strategy.num_replicas_in_sync
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]},
        "task": {"type": "worker", "index": 0},
    }
)
for name in ("recorded", "tf_context"):
    if name == "tf_context":
        cluster._recorded.clear()  # the strategy was built by user code, not keras_sync
    try:
        cluster.check_tf_config_order()
        out["order"][name] = None
    except ClusterError as e:
        out["order"][name] = str(e)
print(json.dumps(out))
