"""A real TensorFlow worker for the launcher and Slurm tests: one MultiWorkerMirroredStrategy all-reduce.

argv[1] is "tf_config" (use the launcher's TF_CONFIG) or "slurm" (turn the launcher's task index
into a Slurm step on 127.0.0.1 with port base argv[2], as srun would, and use the Slurm resolver).
"""

import faulthandler
import json
import os
import sys

print("worker starting", flush=True)
faulthandler.dump_traceback_later(90, exit=True)  # a missing peer blocks forever otherwise

from keras_sync import cluster  # noqa: E402

mode = sys.argv[1]
if mode == "slurm":
    tf_config = json.loads(os.environ.pop("TF_CONFIG"))
    n = len(tf_config["cluster"]["worker"])
    os.environ.update(
        SLURM_JOB_ID="1",
        SLURM_PROCID=str(tf_config["task"]["index"]),
        SLURM_STEP_NUM_TASKS=str(n),
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_STEP_TASKS_PER_NODE=str(n),
    )
    info = cluster.parse_slurm_env(port_base=int(sys.argv[2]))
    import tensorflow as tf

    from keras_sync.config import load_config

    slurm = {"cluster": "slurm", "slurm": {"port_base": int(sys.argv[2])}}
    resolver = cluster.SlurmEnvironment(load_config({"strategy": slurm}).strategy).resolver()
else:
    info = cluster.parse_tf_config(os.environ["TF_CONFIG"])
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()

strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
value = strategy.run(lambda: tf.constant(float(info.task_id + 1)))
total = strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
print(
    json.dumps(
        {
            "task_id": info.task_id,
            "sum": float(total),
            "replicas": strategy.num_replicas_in_sync,
            "is_chief": info.is_chief,
            "tf_is_chief": strategy.extended._in_multi_worker_mode()
            and strategy.extended.should_checkpoint,
        }
    ),
    flush=True,
)
faulthandler.cancel_dump_traceback_later()
