"""The `runtime:` section applied to a run, with the user's own `model.compile(...)` line unchanged.

``mixed_precision`` sets the Keras dtype policy in `keras_sync.load()`; ``jit_compile`` and
``steps_per_execution`` written in the config win over compile's; XLA over several CPU replicas
is refused or turned off.
"""

from __future__ import annotations

import sys
from typing import Any

from keras_sync.errors import UsageError
from keras_sync.training.context import RunContext


def given(config: Any, key: str) -> bool:
    """Whether ``runtime.<key>`` was written in the config (file, dict or flag)."""
    return config.source_of(f"runtime.{key}") != "default"


def set_dtype_policy(config: Any) -> None:
    """Set the Keras dtype policy of ``runtime.mixed_precision`` when the config gives it."""
    if given(config, "mixed_precision"):
        import keras

        name = config.runtime.mixed_precision
        keras.mixed_precision.set_dtype_policy("float32" if name == "none" else name)


def prepare_model(context: RunContext, model: Any) -> None:
    """Apply jit_compile, steps_per_execution and sync_batch_norm to ``model`` (before `fit`)."""
    import keras

    rt, n = context.config.runtime, context.num_replicas
    before = (model.steps_per_execution, model.jit_compile)
    if given(context.config, "steps_per_execution"):
        model.steps_per_execution = rt.steps_per_execution
    # Keras compiles strategy.run as one XLA cluster: over logical CPUs XLA reads variables of CPU:1
    # from CPU:0; across CPU workers it has no collectives and aborts.
    devices = getattr(model.distribute_strategy.extended, "worker_devices", ()) if n > 1 else ()
    xla_fails = bool(devices) and all("CPU" in str(d).upper() for d in devices)
    if rt.jit_compile is True and xla_fails:
        raise UsageError(
            f"Invalid value for runtime.jit_compile. Received: true with {n} replicas on CPU "
            "devices, where XLA cannot compile a distributed step. Expected false or auto."
        )
    if rt.jit_compile != "auto":
        model.jit_compile = rt.jit_compile
    elif xla_fails:  # compile's own jit_compile=True cannot run here either
        model.jit_compile = False
    changed = before != (model.steps_per_execution, model.jit_compile)
    norms = [x for x in all_layers(model) if isinstance(x, keras.layers.BatchNormalization)]
    if rt.sync_batch_norm:
        changed = changed or not all(x.synchronized for x in norms)
        for layer in norms:
            layer.synchronized = True  # read in BatchNormalization.call: the traced step uses it
    elif n > 1 and any(not x.synchronized for x in norms) and "_keras_sync_told" not in vars(model):
        vars(model)["_keras_sync_told"] = True  # once per model
        if context.is_chief:
            print(
                f"keras-sync: {type(model).__name__} has {len(norms)} BatchNormalization layer(s) "
                f"with per-replica statistics over the {context.per_replica_batch_size} examples "
                f"of a replica, not the global batch of {context.global_batch_size}. For "
                "statistics over all replicas set runtime.sync_batch_norm: true.",
                file=sys.stderr,
                flush=True,
            )
    if changed:
        model.train_function = None  # Keras builds it again with the new settings


def all_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested ones included, each once."""
    found: dict[int, Any] = {}
    for layer in getattr(model, "layers", None) or []:
        found.update({id(x): x for x in [layer, *all_layers(layer)]})
    return list(found.values())


def setup_callback(runtime: Any) -> Any:
    """A Keras callback that sets up accumulation and the replica probe once `fit` built the model."""
    import keras

    from keras_sync.training import instrument
    from keras_sync.training.accumulate import GradientAccumulator

    class RuntimeSetup(keras.callbacks.Callback):
        def set_model(self, model: Any) -> None:
            super().set_model(model)
            steps = runtime.gradient_accumulation_steps
            accumulator = getattr(instrument.probe_of(model), "accumulator", None)
            if steps > 1 and (accumulator is None or accumulator.steps != steps):
                accumulator = GradientAccumulator(model, steps)
            instrument.instrument(
                model, runtime.train_step_gradients, accumulator if steps > 1 else None
            )

    return RuntimeSetup()
