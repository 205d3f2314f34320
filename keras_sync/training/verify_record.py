"""`keras-sync verify`'s recording: the first optimizer steps of `sync.fit`, written to a folder.

Under ``$KERAS_SYNC_VERIFY_RECORD=FOLDER`` (read by `keras_sync.config` into ``config.verify``)
`sync.fit` records its first ``$KERAS_SYNC_VERIFY_STEPS`` optimizer steps (default 20), then the
script ends (exit 0). The folder holds:

- ``record.json``: per optimizer step the loss (the replicas' mean, weighted by examples), the
  update's norm ``|w_t+1 - w_t|``, the learning rate applied and the examples (summed over the
  replicas, from `keras_sync.training.instrument`); what the model contains (BatchNorm, random
  layers, add_loss terms, a custom `train_step`, the dtype policy); replicas, workers, batch;
- ``initial.npz`` and ``final.npz``: every weight of the model by its path;
- ``reference.json``: the config keys of the one-device reference (`keras_sync.config` applies
  them when ``$KERAS_SYNC_VERIFY_REPLAY`` names this folder): kind ``default``, the same global batch
  and base learning-rate batch, and, when no layer depends on the batch, the batch as N
  micro-batches with gradient accumulation (one replica's memory).

A reference run (``$KERAS_SYNC_VERIFY_REPLAY``) starts from the recorded initial weights and
records itself the same way. The data order is the script's: keras-sync's pipeline batches and
shuffles with fixed seeds, and `load` seeds Python, NumPy and Keras, so a script gives the same
batches twice; what it cannot fix (a generator with its own unseeded randomness) shows as a first
loss that differs before any update. Only the chief writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from keras_sync.config.kinds import KINDS

#: The seed `load` gives Python, NumPy and Keras in a verify run.
SEED = 1337
RECORD_FILE, INITIAL_FILE, FINAL_FILE = "record.json", "initial.npz", "final.npz"


def seed_everything() -> None:
    """Seed Python, NumPy and Keras (called by `load` in a verify run, before the model is built)."""
    import keras

    keras.utils.set_random_seed(SEED)


def callback(sync: Any) -> Any:
    """The Keras callback that records this fit (add it last: it reads what the others restored)."""
    import keras

    class VerifyRecorder(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self.rec = _Recording(sync, self.model)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.rec.batch_begin()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.rec.batch_end():
                self.model.stop_training = True

        def on_train_end(self, logs: Any = None) -> None:
            self.rec.write()

    return VerifyRecorder()


def end_script(sync: Any) -> None:
    """After the recorded fit: the script ends here (exit 0), every worker alike."""
    if sync.is_chief:
        print(
            f"keras-sync: verify: recorded {sync.config.verify.record_dir}; the script stops here",
            file=sys.stderr,
            flush=True,
        )
    sys.stdout.flush()
    raise SystemExit(0)


class _Recording:
    def __init__(self, sync: Any, model: Any):
        import numpy as np

        from keras_sync.training.instrument import probe_of

        self.sync, self.model, self.request = sync, model, sync.config.verify
        if self.request.replay_dir is not None:
            _load_weights(model, Path(self.request.replay_dir) / INITIAL_FILE)
        self.initial = {v.path: np.array(v.numpy()) for v in model.weights}
        self.previous = [np.array(v.numpy(), np.float64) for v in model.trainable_weights]
        self.probe = probe_of(model)
        self.iterations = int(model.optimizer.iterations.numpy())
        self.examples_seen: list[float] | None = None
        self.steps: list[dict[str, float]] = []
        self.micro: list[
            tuple[float, float]
        ] = []  # (loss, examples) of the micro-batches of this update
        self.lr = math.nan

    def batch_begin(self) -> None:
        if not self.micro:
            self.lr = _learning_rate(self.model.optimizer)

    def batch_end(self) -> bool:
        """Note a micro-batch; True when the requested steps are recorded."""
        import numpy as np

        rings = (
            self.probe.read()
        )  # a collective under multi_worker_mirrored: every worker reads here
        row = self.probe.row(rings, self.probe.count(rings))
        seen = [float(r[self.probe.EXAMPLES]) for r in row] if row else [math.nan]
        before = self.examples_seen or [0.0] * len(seen)
        shares = [a - b for a, b in zip(seen, before)]
        self.examples_seen = seen
        losses = [float(r[self.probe.LOSS]) for r in row] if row else [math.nan]
        total = sum(shares)
        loss = sum(l * s for l, s in zip(losses, shares)) / total if total > 0 else math.nan
        self.micro.append((loss, total))
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations == self.iterations:
            return False  # accumulating: the update comes at a later micro-batch
        self.iterations = iterations
        now = [np.array(v.numpy(), np.float64) for v in self.model.trainable_weights]
        update = math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(now, self.previous)))
        self.previous = now
        examples = sum(e for _, e in self.micro)
        mean_loss = sum(l * e for l, e in self.micro) / examples if examples > 0 else math.nan
        self.steps.append(
            {"loss": mean_loss, "update": update, "lr": self.lr, "examples": examples}
        )
        self.micro = []
        return len(self.steps) >= self.request.steps

    def write(self) -> None:
        if not self.sync.is_chief:
            return
        import numpy as np

        folder = Path(self.request.record_dir)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / INITIAL_FILE, **_keyed(self.initial))
        np.savez(
            folder / FINAL_FILE, **_keyed({v.path: np.array(v.numpy()) for v in self.model.weights})
        )
        facts = model_facts(self.sync, self.model)
        record = {
            "replicas": self.sync.num_replicas,
            "workers": self.sync.num_workers,
            "kind": self.sync.kind,
            "global_batch": self.sync.global_batch_size,
            "steps": self.steps,
            "facts": facts,
            "weights": [v.path for v in self.model.weights],
            "mlflow": _mlflow_settings(self.sync.config),
            "peak_rss_mb": _peak_rss_mb(),
            "input": getattr(self.sync.input_facts, "source", None),
            "arrays_as_dataset": KINDS[self.sync.kind].multi_process,
        }
        _write_json(folder / RECORD_FILE, record)
        if self.request.replay_dir is None:
            from keras_sync.config import VERIFY_OVERRIDES_FILE

            _write_json(folder / VERIFY_OVERRIDES_FILE, reference_overrides(self.sync, facts))


def arrays_as_dataset(config: Any) -> bool:
    """Whether this reference run replays a multi-worker recording, whose arrays became a tf.data dataset
    (shuffled by keras-sync with its seed): the reference's arrays then do too, for the same batches."""
    replay = config.verify.replay_dir if config.verify is not None else None
    if replay is None:
        return False
    try:
        return bool(json.loads((Path(replay) / RECORD_FILE).read_text()).get("arrays_as_dataset"))
    except (OSError, ValueError):
        return False


def reference_overrides(sync: Any, facts: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the one-device reference of this run (see the module docstring)."""
    n, acc = sync.num_replicas, sync.gradient_accumulation_steps
    # BatchNorm (training) and add_loss terms see the whole batch a step computes on: no micro-batches then.
    micro = n if not depends_on_batch(facts) and sync.global_batch_size % n == 0 else 1
    return {
        "strategy.kind": "default",
        "strategy.simulated_cpu_replicas": 0,
        "strategy.devices": [],
        "batch.per_replica": None,
        "batch.global": sync.global_batch_size // micro,
        "runtime.gradient_accumulation_steps": acc * micro,
        "learning_rate.base_batch_size": sync.base_batch_size,
    }


def depends_on_batch(facts: dict[str, Any]) -> list[str]:
    """What in the model computes over the batch a step sees (then the reference trains the full batch)."""
    return [
        what
        for what, key in (("BatchNorm", "batch_norm"), ("add_loss", "add_loss"))
        if facts.get(key)
    ]


def model_facts(sync: Any, model: Any) -> dict[str, Any]:
    """What in the model makes replicas differ from one device, for `keras_sync.measures.verify_compare`."""
    import keras

    from keras_sync.measures.verify_compare import precision_of
    from keras_sync.training.instrument import has_default_train_step
    from keras_sync.training.runtime import _all_layers

    layers = _all_layers(model)
    norms = [
        layer
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    random_types = (
        keras.layers.Dropout,
        keras.layers.GaussianNoise,
        keras.layers.GaussianDropout,
        keras.layers.AlphaDropout,
    )
    randoms = [
        layer.name
        for layer in layers
        if isinstance(layer, random_types) or type(layer).__name__.startswith("Random")
    ]
    return {
        "batch_norm": len(norms),
        "sync_batch_norm": bool(norms) and all(l.synchronized for l in norms),
        "random_layers": randoms,
        "add_loss": _add_loss_terms(model),
        "custom_train_step": not has_default_train_step(model),
        "train_step_gradients": sync.config.runtime.train_step_gradients,
        "precision": precision_of(keras.config.dtype_policy().name),
        "accumulation": sync.gradient_accumulation_steps,
    }


def _add_loss_terms(model: Any) -> int:
    """How many `add_loss` terms the model's last call added (`model.losses`, public Keras)."""
    return len(getattr(model, "losses", None) or [])


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far (MB; Linux counts ru_maxrss in KiB, macOS in bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def _learning_rate(optimizer: Any) -> float:
    try:
        return float(
            optimizer.learning_rate.numpy()
            if hasattr(optimizer.learning_rate, "numpy")
            else optimizer.learning_rate
        )
    except Exception:
        return math.nan


def _load_weights(model: Any, path: Path) -> None:
    import numpy as np

    from keras_sync.errors import UsageError

    with np.load(path) as saved:
        values = [saved[k] for k in sorted(saved.files)]
    weights = model.weights
    if len(values) != len(weights) or any(
        tuple(v.shape) != a.shape for v, a in zip(weights, values)
    ):
        raise UsageError(
            f"verify: the reference's model ({len(weights)} weights) is not the recorded one "
            f"({len(values)} weights in {path}); expected the same script and model on both runs"
        )
    for v, a in zip(weights, values):
        v.assign(a)


def _keyed(weights: dict[str, Any]) -> dict[str, Any]:
    """npz keys in model order (a path's '/' is kept; the index keeps the order and makes keys unique)."""
    return {f"{i:04d}:{path}": value for i, (path, value) in enumerate(weights.items())}


def _mlflow_settings(config: Any) -> dict[str, Any]:
    m = config.mlflow
    return {
        "enabled": config.verify.mlflow,
        "tracking_uri": m.tracking_uri,
        "experiment": m.experiment,
    }


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    os.replace(tmp, path)
