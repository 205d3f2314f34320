"""keras-sync inside Ray Train (ray 2.60, Train V2): the driver of tests/test_ray.py.

argv: OUT [SCENARIO ...]   scenarios: arrays, ray_data, kill (default: all three, in one Ray cluster)
      OUT reference         one process, no Ray: the weights the scenarios must equal
      OUT ray_data_reference  one process, no Ray: the weights the Ray Data scenario must equal (after it ran)
      OUT references        both references in one process (what tests/test_ray.py runs)

Every scenario is a real local Ray cluster (`ray.init(num_cpus=4)`) running `TensorflowTrainer`
with 2 CPU workers whose training function calls `keras_sync.load` and `sync.fit`:
  arrays    in-memory arrays given to sync.fit (Ray does not shard them: keras-sync must)
  ray_data  a Ray Data shard, `get_dataset_shard("train").to_tf(..., batch_size=8)` (already sharded,
            batch hidden from TensorFlow); each worker records the order of the example ids its
            shard yields, so the one-process reference can train on the same global batches
  kill      arrays with a keras-sync backup; the chief SIGKILLs itself mid-epoch on the first
            attempt and `FailureConfig(max_failures=1)` restarts the workers, which resume
Each worker writes OUT/<scenario>/w<rank>.json; the driver writes OUT/<scenario>/driver.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

N_ARRAYS, N_RAY_DATA, FEATURES = 512, 64, 8
EPOCHS = {"arrays": 2, "ray_data": 3, "kill": 2}
TO_TF_BATCH = 8  # what a Ray user passes to to_tf; keras-sync trains on the global batch regardless


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_ARRAYS, FEATURES)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return x[:n], y[:n]


def ks_config(scenario: str, out: str) -> dict:
    cfg = {
        "strategy": {"kind": "auto", "connect_timeout_s": 300},
        # base 0.05 tuned for 16, global 32: linear scaling gives 0.1, on 2 workers and on 1
        "batch": {"global": 32},
        "learning_rate": {"base": 0.05, "base_batch_size": 16},
        "mlflow": {
            "tracking_uri": f"sqlite:///{out}/mlflow.db",
            "experiment": f"ray-{scenario}",
            "log_every_n_steps": 1,
        },
    }
    if scenario == "kill":
        cfg["fault_tolerance"] = {"backup_dir": os.path.join(out, "kill", "backup"), "save_freq": 4}
    return cfg


def make_model(keras, lr, scope):
    keras.utils.set_random_seed(0)
    with scope:
        m = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        m.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    return m


def train_fn(config: dict) -> None:
    """The user's training function, as Ray Train runs it on every worker."""
    scenario, out = config["scenario"], config["out"]
    workdir = os.path.join(out, scenario)
    os.chdir(workdir)  # the MLflow spool lives here (.keras_sync_spool), so the test can look at it
    import keras_sync

    sync = keras_sync.load(ks_config(scenario, out))
    import keras

    rank = int(sync.task[1] or 0)
    model = make_model(keras, sync.lr_schedule(), sync.scope())
    callbacks = []
    if scenario == "kill":
        marker = os.path.join(workdir, "killed")

        class KillChiefOnce(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if (
                    rank == 0
                    and int(model.optimizer.iterations.numpy()) == 22
                    and not os.path.exists(marker)
                ):
                    open(marker, "w").close()
                    os.kill(
                        os.getpid(), signal.SIGKILL
                    )  # mid-epoch 2, 2 steps after the backup at step 20

        callbacks.append(KillChiefOnce())
    seen: list[int] = []
    if scenario == "ray_data":
        import ray.train
        import tensorflow as tf

        def note(ids):
            seen.extend(int(i) for i in ids.numpy())
            return ids

        def drop_id(features, y):  # the id only records the order this worker's shard yields
            noted = tf.py_function(note, [features["id"]], tf.int64)
            with tf.control_dependencies([noted]):
                return tf.identity(features["x"]), y

        shard = ray.train.get_dataset_shard("train")
        ds = shard.to_tf(
            feature_columns=["x", "id"], label_columns="y", batch_size=TO_TF_BATCH
        ).map(drop_id)
        history = sync.fit(model, ds, epochs=EPOCHS[scenario], verbose=0, callbacks=callbacks)
    else:
        x, y = data(N_ARRAYS)
        history = sync.fit(
            model, x, y, epochs=EPOCHS[scenario], shuffle=False, verbose=0, callbacks=callbacks
        )
    result = {
        "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist(),
        "steps": int(model.optimizer.iterations.numpy()),
        "loss": history.history["loss"],
        "workers": sync.num_workers,
        "replicas": sync.num_replicas,
        "is_chief": sync.is_chief,
        "global_batch": sync.global_batch_size,
        "learning_rate": sync.learning_rate,
        "seen": seen,
    }
    with open(os.path.join(workdir, f"w{rank}.json"), "w") as f:
        json.dump(result, f)


def run_scenarios(out: str, scenarios: list[str]) -> None:
    import ray
    from mlflow.tracking import MlflowClient
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    # The store and experiments exist before training, as in a real deployment: a fresh sqlite
    # store's migration on a machine this busy can outlast the delivery wait at the end of fit.
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    for scenario in scenarios:
        client.create_experiment(f"ray-{scenario}")
    t0 = time.monotonic()
    for attempt in range(4):
        try:
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}},
            )
            break
        except Exception as e:
            # Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py,
            # raylet_start_wait_time_s); a machine busy with other TensorFlow jobs can take longer.
            if "timed out during startup" not in str(e) or attempt == 3:
                raise
            print(f"ray.init attempt {attempt + 1} timed out; starting Ray again", flush=True)
            ray.shutdown()
    started = time.monotonic() - t0
    try:
        for scenario in scenarios:
            os.makedirs(os.path.join(out, scenario), exist_ok=True)
            datasets = {}
            if scenario == "ray_data":
                x, y = data(N_RAY_DATA)
                datasets["train"] = ray.data.from_items(
                    [{"x": x[i], "y": y[i], "id": i} for i in range(N_RAY_DATA)]
                )
            t = time.monotonic()
            trainer = TensorflowTrainer(
                train_fn,
                train_loop_config={"scenario": scenario, "out": out},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(
                    storage_path=os.path.join(out, "ray_results"),
                    name=scenario,
                    failure_config=FailureConfig(max_failures=1 if scenario == "kill" else 0),
                ),
                datasets=datasets,
            )
            result = trainer.fit()
            with open(os.path.join(out, scenario, "driver.json"), "w") as f:
                json.dump(
                    {
                        "error": repr(result.error) if result.error else None,
                        "seconds": time.monotonic() - t,
                        "ray_init_seconds": started,
                    },
                    f,
                )
    finally:
        ray.shutdown()


def reference(out: str) -> None:
    """One process, no Ray, same global batch and learning rate: what each scenario must equal."""
    import keras_sync

    sync = keras_sync.load(
        {
            **ks_config("reference", out),
            "strategy": {"kind": "default"},
            "mlflow": {"enabled": False},
        }
    )
    import keras

    x, y = data(N_ARRAYS)
    model = make_model(keras, sync.lr_schedule(), sync.scope())
    sync.fit(model, x, y, epochs=EPOCHS["arrays"], shuffle=False, verbose=0)
    results = {"arrays": np.concatenate([w.ravel() for w in model.get_weights()]).tolist()}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(results, f)


def ray_data_reference(out: str) -> None:
    """One process trained on the global batches the 2 Ray workers formed: at every step each
    worker takes the next global/2 examples of its own shard (TensorFlow's rule under shard policy
    off), so step k is worker 0's k-th slice plus worker 1's. Also the same examples at the batch
    to_tf gave (what the workers trained on before), to show the comparison can tell them apart."""
    import keras_sync

    sync = keras_sync.load(
        {
            **ks_config("reference", out),
            "strategy": {"kind": "default"},
            "mlflow": {"enabled": False},
        }
    )
    import keras

    # The passes trained are the last EPOCHS ones: TensorFlow reads the generator once more
    # before training starts (to build the distributed iterator), and nothing of it is trained.
    keep = EPOCHS["ray_data"] * N_RAY_DATA // 2
    streams = [
        json.load(open(os.path.join(out, "ray_data", f"w{r}.json")))["seen"][-keep:] for r in (0, 1)
    ]
    half = sync.global_batch_size // 2
    order = [i for k in range(0, len(streams[0]), half) for s in streams for i in s[k : k + half]]
    x, y = data(N_RAY_DATA)
    results = {"order": order}
    for name, batch in (
        ("ray_data", sync.global_batch_size),
        ("ray_data_at_to_tf_batch", TO_TF_BATCH),
    ):
        model = make_model(keras, sync.lr_schedule(), sync.scope())
        model.fit(x[order], y[order], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        results[name] = np.concatenate([w.ravel() for w in model.get_weights()]).tolist()
    with open(os.path.join(out, "ray_data_reference.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    out_dir = os.path.abspath(sys.argv[1])
    if sys.argv[2:] == ["reference"]:
        reference(out_dir)
    elif sys.argv[2:] == ["ray_data_reference"]:
        ray_data_reference(out_dir)
    elif sys.argv[2:] == ["references"]:  # both, after the scenarios: one TensorFlow process less
        reference(out_dir)
        ray_data_reference(out_dir)
    else:
        run_scenarios(out_dir, sys.argv[2:] or ["arrays", "ray_data", "kill"])
