"""`keras-sync verify`'s recording: the first optimizer steps of `sync.fit`, written to a folder.

The chief writes ``record.json`` (per step the example-weighted loss, the update's norm, the
learning rate and the examples; the model's facts), ``initial.npz``/``final.npz`` (the weights by
path) and the one-device reference's config keys; then the script ends (exit 0).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from keras_sync.config import VERIFY_OVERRIDES_FILE
from keras_sync.config.kinds import KINDS
from keras_sync.errors import UsageError
from keras_sync.measures.verify_compare import precision_of
from keras_sync.training.context import RunContext
from keras_sync.training.runtime import all_layers

#: The seed `load` gives Python, NumPy and Keras in a verify run.
SEED = 1337
RECORD_FILE, INITIAL_FILE, FINAL_FILE = "record.json", "initial.npz", "final.npz"


def seed_everything() -> None:
    """Seed Python, NumPy and Keras, so a script gives the same batches on both runs."""
    import keras

    keras.utils.set_random_seed(SEED)


def callback(context: RunContext, *, input_source: str | None, base_batch_size: int) -> Any:
    """The Keras callback that records this fit (add it last: it reads what the others restored)."""
    import keras
    import numpy as np

    from keras_sync.training.instrument import probe_of

    request = context.config.verify

    def trainable(model: Any) -> list[Any]:
        return [np.array(v.numpy(), np.float64) for v in model.trainable_weights]

    def by_path(model: Any) -> dict[str, Any]:  # the index keeps the order and makes keys unique
        return {f"{i:04d}:{v.path}": np.array(v.numpy()) for i, v in enumerate(model.weights)}

    class VerifyRecorder(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            if request.replay_dir is not None:
                _load_weights(self.model, Path(request.replay_dir) / INITIAL_FILE)
            self.initial, self.previous = by_path(self.model), trainable(self.model)
            self.probe: Any = probe_of(self.model)
            self.iterations = int(self.model.optimizer.iterations.numpy())
            self.seen: list[float] | None = None  # each replica's examples so far
            self.count = 0  # the train steps read so far
            self.steps: list[dict[str, float]] = []
            self.sums = (0.0, 0.0)  # (loss x examples, examples) of this update's micro-batches
            self.lr = math.nan

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self.sums == (0.0, 0.0):  # an update's first micro-batch
                self.lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            p = self.probe
            rings = p.read()  # a collective under multi_worker_mirrored: every worker reads here
            count, (loss, examples) = p.count(rings), self.sums
            # Every step since the last call (several under steps_per_execution), each replica's
            # loss weighed by the examples it trained in that step.
            for step in range(self.count + 1, count + 1):
                row = p.row(rings, step) or []
                seen = [float(r[p.EXAMPLES]) for r in row] or [math.nan]
                shares = [a - b for a, b in zip(seen, self.seen or [0.0] * len(seen))]
                losses = [float(r[p.LOSS]) for r in row] or [math.nan]
                loss += sum(x * n for x, n in zip(losses, shares))
                examples, self.seen = examples + sum(shares), seen
            self.count, self.sums = count, (loss, examples)
            iterations = int(self.model.optimizer.iterations.numpy())
            if iterations == self.iterations:
                return  # accumulating: the update comes at a later micro-batch
            now = trainable(self.model)
            update = math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(now, self.previous)))
            loss, examples = self.sums
            loss = loss / examples if examples > 0 else math.nan
            self.steps.append({"loss": loss, "update": update, "lr": self.lr, "examples": examples})
            self.iterations, self.previous, self.sums = iterations, now, (0.0, 0.0)
            if len(self.steps) >= request.steps:
                self.model.stop_training = True

        def on_train_end(self, logs: Any = None) -> None:
            if not context.is_chief:
                return
            import resource

            folder, model = Path(request.record_dir), self.model
            folder.mkdir(parents=True, exist_ok=True)
            np.savez(folder / INITIAL_FILE, **self.initial)
            np.savez(folder / FINAL_FILE, **by_path(model))
            facts, mlflow = model_facts(context, model), context.config.mlflow
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, B on macOS
            record = {
                "replicas": context.num_replicas,
                "workers": context.num_workers,
                "kind": context.kind,
                "global_batch": context.global_batch_size,
                "steps": self.steps,
                "facts": facts,
                "mlflow": {
                    "enabled": request.mlflow,
                    "tracking_uri": mlflow.tracking_uri,
                    "experiment": mlflow.experiment,
                },
                "peak_rss_mb": round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1),
                "input": input_source,
                "arrays_as_dataset": KINDS[context.kind].multi_process,
            }
            (folder / RECORD_FILE).write_text(json.dumps(record, indent=1, default=float))
            if request.replay_dir is None:
                overrides = reference_overrides(context, facts, base_batch_size, self.steps)
                (folder / VERIFY_OVERRIDES_FILE).write_text(json.dumps(overrides, indent=1))

    return VerifyRecorder()


def end_script() -> None:
    """After the recorded fit the script ends here (exit 0), every worker alike."""
    sys.stdout.flush()
    raise SystemExit(0)


def arrays_as_dataset(config: Any) -> bool:
    """Whether the recording this reference replays made arrays a dataset (then the reference too)."""
    replay = config.verify.replay_dir if config.verify is not None else None
    record = json.loads((Path(replay) / RECORD_FILE).read_text()) if replay else {}
    return bool(record.get("arrays_as_dataset"))


def reference_overrides(
    context: RunContext, facts: dict[str, Any], base_batch_size: int, steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """The one-device reference's config: the global batch, as N accumulated micro-batches if it can."""
    n, batch = context.num_replicas, context.global_batch_size or 0
    micro = n if not whole_batch_reasons(facts, steps, batch) and batch % n == 0 else 1
    return {
        "strategy.kind": "default",
        "strategy.simulated_cpu_replicas": 0,
        "strategy.devices": [],
        "batch.per_replica": None,
        "batch.global": batch // micro,
        "runtime.gradient_accumulation_steps": context.gradient_accumulation_steps * micro,
        "learning_rate.base_batch_size": base_batch_size,
    }


def whole_batch_reasons(
    facts: dict[str, Any], steps: list[dict[str, Any]], batch: int
) -> list[str]:
    """Why the reference trains each global batch whole: what in the model computes over the batch a
    step sees, or what would make accumulated micro-batches no longer line up with the recorded
    steps: several steps per execution, or a recorded step that is not whole batches of ``batch``."""
    reasons = [
        f"{what} depends on the batch"
        for key, what in (
            ("batch_norm", "BatchNorm"),
            ("add_loss", "add_loss"),
            ("masked_loss", "a masked loss"),
        )
        if facts.get(key)
    ]
    if facts.get("steps_per_execution", 1) > 1:
        reasons.append(f"{facts['steps_per_execution']} steps per execution")
    uneven = [int(s["examples"]) % batch for s in steps if batch and s["examples"] % batch]
    if uneven:
        reasons.append(f"a batch of {uneven[0]} examples, not {batch}")
    return reasons


def model_facts(context: RunContext, model: Any) -> dict[str, Any]:
    """What in the model makes replicas differ from one device (`keras_sync.measures.verify_compare`)."""
    import keras

    from keras_sync.training.instrument import has_default_train_step, probe_of

    layers, kinds = all_layers(model), keras.layers
    norms = [x for x in layers if isinstance(x, kinds.BatchNormalization) and x.trainable]
    random_types = (kinds.Dropout, kinds.GaussianNoise, kinds.GaussianDropout, kinds.AlphaDropout)
    return {
        "batch_norm": len(norms),
        "sync_batch_norm": bool(norms) and all(x.synchronized for x in norms),
        "random_layers": [
            x.name
            for x in layers
            if isinstance(x, random_types) or type(x).__name__.startswith("Random")
        ],
        "add_loss": len(getattr(model, "losses", None) or []),  # the last call's add_loss terms
        "custom_train_step": not has_default_train_step(model),
        "train_step_gradients": context.config.runtime.train_step_gradients,
        "precision": precision_of(keras.config.dtype_policy().name),
        "accumulation": context.gradient_accumulation_steps,
        "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        "masked_loss": bool(getattr(probe_of(model), "masked_loss", False)),
    }


def _load_weights(model: Any, path: Path) -> None:
    import numpy as np

    with np.load(path) as saved:
        values = [saved[k] for k in sorted(saved.files)]
    weights = model.weights
    if [tuple(v.shape) for v in weights] != [a.shape for a in values]:
        raise UsageError(
            f"verify: the reference's model ({len(weights)} weights) is not the recorded one "
            f"({len(values)} weights in {path}). Run the same script and model on both runs."
        )
    for v, a in zip(weights, values):
        v.assign(a)
