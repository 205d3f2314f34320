"""The `runtime:` section applied to a run, with the user's own `model.compile(...)` line unchanged.

``mixed_precision`` sets the Keras dtype policy in `keras_sync.load()`; ``jit_compile`` and
``steps_per_execution`` written in the config win over compile's; XLA over several CPU replicas
is refused or turned off.
"""

from __future__ import annotations

import sys
from typing import Any

from keras_sync.training.context import RunContext


def given(config: Any, key: str) -> bool:
    """Whether ``runtime.<key>`` was written in the config (file, dict or flag)."""
    return config.source_of(f"runtime.{key}") != "default"


def set_dtype_policy(config: Any, *, is_chief: bool) -> None:
    """Set the Keras dtype policy of ``runtime.mixed_precision`` (when given); warn about slow float16."""
    if not given(config, "mixed_precision"):
        return
    import keras
    import tensorflow as tf

    name = config.runtime.mixed_precision
    keras.mixed_precision.set_dtype_policy("float32" if name == "none" else name)
    if name != "mixed_float16" or not is_chief:
        return
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details
    # Tensor cores (Volta, compute capability 7.0) and later are fast in float16.
    old = [g.name for g in gpus if tuple(details(g).get("compute_capability") or (0, 0)) < (7, 0)]
    if old or not gpus:
        _say(
            f"runtime.mixed_precision: mixed_float16 on {old[0] if old else 'CPU'}, which has no fast "
            "float16, may train slower than float32. Use mixed_bfloat16 on CPU and TPU."
        )


def prepare_model(context: RunContext, model: Any) -> None:
    """Apply jit_compile, steps_per_execution and sync_batch_norm to ``model`` (before `fit`)."""
    import keras

    rt, n, name = context.config.runtime, context.num_replicas, type(model).__name__
    told = vars(model).setdefault("_keras_sync_told", set())  # what was said about this model

    def say_once(what: str, line: str) -> None:
        if what not in told and context.is_chief:
            _say(line)
        told.add(what)

    before = (model.steps_per_execution, model.jit_compile)
    if given(context.config, "steps_per_execution"):
        model.steps_per_execution = rt.steps_per_execution
    # Keras compiles strategy.run as one XLA cluster: over logical CPUs XLA reads variables of CPU:1
    # from CPU:0; across CPU workers it has no collectives and aborts.
    devices = getattr(model.distribute_strategy.extended, "worker_devices", ()) if n > 1 else ()
    xla_fails = bool(devices) and all("CPU" in str(d).upper() for d in devices)
    if given(context.config, "jit_compile") and rt.jit_compile is True and xla_fails:
        from keras_sync.errors import UsageError

        raise UsageError(
            f"Invalid value for runtime.jit_compile. Received: true with {n} replicas on CPU "
            "devices, where XLA cannot compile a distributed step. Expected false or auto (XLA "
            "works on one device, and on GPUs or TPUs)."
        )
    if rt.jit_compile == "auto" and model.jit_compile is True and xla_fails:
        # compile(jit_compile=True) itself: Keras's "auto" is False under a strategy.
        say_once(
            "xla",
            f"jit_compile=True of {name}'s compile is not applied: XLA cannot compile a step over "
            f"{n} replicas on CPU devices, so the model trains without XLA (it works on one "
            "device, and on GPUs or TPUs).",
        )
        model.jit_compile = False
    elif given(context.config, "jit_compile") and rt.jit_compile != "auto":
        model.jit_compile = rt.jit_compile
    changed = before != (model.steps_per_execution, model.jit_compile)
    norms = [x for x in all_layers(model) if isinstance(x, keras.layers.BatchNormalization)]
    if rt.sync_batch_norm:
        changed = changed or not all(x.synchronized for x in norms)
        for layer in norms:
            layer.synchronized = True  # read in BatchNormalization.call: the traced step uses it
    elif n > 1 and any(not x.synchronized for x in norms):
        say_once(
            "bn",
            f"{name} has {len(norms)} BatchNormalization layer(s) with per-replica statistics over "
            f"the {context.per_replica_batch_size} examples of a replica, not the global batch of "
            f"{context.global_batch_size}. For statistics over all replicas set "
            "runtime.sync_batch_norm: true.",
        )
    if changed:
        model.train_function = None  # Keras builds it again with the new settings


def _say(line: str) -> None:
    print(f"keras-sync: {line}", file=sys.stderr, flush=True)


def all_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested ones included, each once."""
    out, stack, seen = [], list(getattr(model, "layers", [])), set()
    while stack:
        layer = stack.pop()
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
            stack.extend(getattr(layer, "layers", []) or [])
    return out


def setup_callback(runtime: Any) -> Any:
    """A Keras callback that sets up gradient accumulation and the replica probe once `fit` built the model."""
    import keras

    class RuntimeSetup(keras.callbacks.Callback):
        def set_model(self, model: Any) -> None:
            # After `fit` built the model and its optimizer, before it builds the train function.
            super().set_model(model)
            from keras_sync.training import instrument as _instrument
            from keras_sync.training.accumulate import GradientAccumulator

            steps = runtime.gradient_accumulation_steps
            accumulator = getattr(_instrument.probe_of(model), "accumulator", None)
            if steps > 1 and (accumulator is None or accumulator.steps != steps):
                accumulator = GradientAccumulator(model, steps)
            _instrument.instrument(
                model,
                gradients=runtime.train_step_gradients,
                accumulator=accumulator if steps > 1 else None,
            )

    return RuntimeSetup()
