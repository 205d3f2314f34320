"""The `runtime:` section applied to a run, with the user's own `model.compile(...)` line unchanged.

- ``mixed_precision``: the global Keras dtype policy, set by `keras_sync.load()` before the model
  is built (layers compute in float16/bfloat16, variables stay float32). Keras's `compile` then
  wraps the optimizer in a `LossScaleOptimizer` for ``mixed_float16`` (dynamic loss scaling).
- ``jit_compile``, ``steps_per_execution``: set on the compiled model by `Sync.fit` before Keras
  builds its train function. The rule when the user's compile set them too: a key written in
  the YAML (or given as a flag) wins; a key left at its default keeps what compile set. When the
  YAML replaces a different compile value, one line on the chief says so. XLA cannot compile a
  step over several replicas on CPU devices: ``runtime.jit_compile: true`` is refused there, and a
  compile's own ``jit_compile=True`` (a script written for a GPU) is turned off with one line.
- ``gradient_accumulation_steps``: see `keras_sync.training.accumulate`.
- ``sync_batch_norm``: every `BatchNormalization` layer of the model computes its statistics over
  all replicas (Keras's ``synchronized=True``). Off with several replicas: one line on the chief
  says the statistics are per replica, of how many examples.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

_told: dict[str, weakref.WeakSet[Any]] = {}


def _say(sync: Any, line: str) -> None:
    if sync.is_chief:
        print(f"keras-sync: {line}", file=sys.stderr, flush=True)


def given(config: Any, key: str) -> bool:
    """Whether ``runtime.<key>`` was written in the config (file, dict or flag), not left at its default."""
    return config.source_of(f"runtime.{key}") != "default"


def set_dtype_policy(config: Any, *, is_chief: bool) -> None:
    """Set the Keras dtype policy of ``runtime.mixed_precision`` (when given); warn about slow float16."""
    if not given(config, "mixed_precision"):
        return
    import keras

    name = config.runtime.mixed_precision
    keras.mixed_precision.set_dtype_policy("float32" if name == "none" else name)
    if name == "mixed_float16" and is_chief:
        fast, where = _fast_float16()
        if not fast:
            print(
                f"keras-sync: runtime.mixed_precision: mixed_float16 on {where}, which has no fast float16: "
                "training may be slower than float32; mixed_bfloat16 is the usual choice on CPU and TPU.",
                file=sys.stderr,
                flush=True,
            )


def _fast_float16() -> tuple[bool, str]:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False, "CPU"
    for gpu in gpus:
        cc = tf.config.experimental.get_device_details(gpu).get("compute_capability") or (0, 0)
        if tuple(cc) < (7, 0):  # tensor cores (Volta) and later
            return False, f"{gpu.name} (compute capability {cc[0]}.{cc[1]})"
    return True, "GPU"


def prepare_model(sync: Any, model: Any) -> None:
    """Apply jit_compile, steps_per_execution and sync_batch_norm to ``model`` (before `fit`)."""
    config, rt = sync.config, sync.config.runtime
    changed = False
    if (
        given(config, "steps_per_execution")
        and int(model.steps_per_execution or 1) != rt.steps_per_execution
    ):
        if int(model.steps_per_execution or 1) != 1:  # the user's compile chose a value
            _replacing(
                sync,
                model,
                "steps_per_execution",
                model.steps_per_execution,
                rt.steps_per_execution,
            )
        model.steps_per_execution = rt.steps_per_execution
        changed = True
    if given(config, "jit_compile") and rt.jit_compile is True:
        _check_xla_devices(sync)
    elif rt.jit_compile == "auto" and model.jit_compile is True and _xla_fails(sync):
        # compile(jit_compile=True) itself: Keras's "auto" is False under a strategy, so only an explicit True.
        if _once("xla", model):
            _say(
                sync,
                f"jit_compile=True of {type(model).__name__}'s compile is not applied: XLA cannot compile a "
                f"step over {sync.num_replicas} replicas on CPU devices (no XLA collectives on CPU; variables "
                "on several devices), so the model trains without XLA. XLA works on one device, and on GPUs "
                "or TPUs.",
            )
        model.jit_compile = False
        changed = True
    if (
        given(config, "jit_compile")
        and rt.jit_compile != "auto"
        and bool(model.jit_compile) != rt.jit_compile
    ):
        if model.jit_compile:  # on, by the user's compile (or Keras's auto on an accelerator)
            _replacing(sync, model, "jit_compile", model.jit_compile, rt.jit_compile)
        model.jit_compile = rt.jit_compile
        changed = True
    layers = [layer for layer in _all_layers(model) if _is_batch_norm(layer)]
    if rt.sync_batch_norm:
        for layer in layers:
            if not layer.synchronized:
                layer.synchronized = (
                    True  # read in BatchNormalization.call: the traced step uses it
                )
                changed = True
    elif (
        sync.num_replicas > 1
        and any(not layer.synchronized for layer in layers)
        and _once("bn", model)
    ):
        _say(
            sync,
            f"{type(model).__name__} has {len(layers)} BatchNormalization layer(s) with per-replica "
            f"statistics: each uses the {sync.per_replica_batch_size} examples of its replica, not the "
            f"global batch of {sync.global_batch_size}. For statistics over all replicas set "
            "runtime.sync_batch_norm: true.",
        )
    if changed:
        model.train_function = None  # Keras builds it again with the new settings


def _xla_fails(sync: Any) -> bool:
    """Whether XLA cannot compile this run's step: several replicas, all on CPU devices."""
    if (
        sync.num_replicas <= 1
    ):  # the default strategy has no worker_devices (it raises RuntimeError)
        return False
    devices = [str(d) for d in getattr(sync.strategy.extended, "worker_devices", ())]
    return bool(devices) and all("CPU" in d.upper() for d in devices)


def _check_xla_devices(sync: Any) -> None:
    """Refuse XLA for a step over several replicas on CPUs: measured to fail, so say it before any step runs."""
    if _xla_fails(sync):
        from keras_sync.errors import UsageError

        # Measured with Keras 3.15.1 / TF 2.21: Keras compiles strategy.run as one XLA cluster. Over
        # logical CPUs of one process XLA reads variables of CPU:1 from CPU:0 ("Trying to access
        # resource ... located in device"); across CPU workers it stops with "Collectives are not yet
        # implemented for CPU devices when compiling with XLA" and the process then aborts.
        raise UsageError(
            f"Invalid value for runtime.jit_compile. Received: true with {sync.num_replicas} replicas on "
            "CPU devices, where XLA cannot compile a distributed step (no XLA collectives on CPU; "
            "variables on several devices). Expected false or auto; XLA works on one device, and on "
            "GPUs or TPUs."
        )


def _replacing(sync: Any, model: Any, key: str, old: Any, new: Any) -> None:
    if _once(key, model):
        _say(
            sync,
            f"runtime.{key}: {new} (from {sync.config.source}) replaces {key}={old} of "
            f"{type(model).__name__}'s compile (a key written in the config wins over compile).",
        )


def _once(what: str, model: Any) -> bool:
    models = _told.setdefault(what, weakref.WeakSet())
    if model in models:
        return False
    models.add(model)
    return True


def _all_layers(model: Any) -> list[Any]:
    out, stack, seen = [], list(getattr(model, "layers", [])), set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        stack.extend(getattr(layer, "layers", []) or [])
    return out


def _is_batch_norm(layer: Any) -> bool:
    import keras

    return isinstance(layer, keras.layers.BatchNormalization)


def setup_callback(sync: Any) -> Any:
    """A Keras callback that, once `fit` has built the model, sets up accumulation, custom-step averaging
    and the weighting of replicas by their examples (`keras_sync.training.instrument._example_weight`)."""
    import keras

    class RuntimeSetup(keras.callbacks.Callback):
        def set_model(self, model: Any) -> None:
            # Runs after `fit` built the model and its optimizer, before it builds the train function.
            super().set_model(model)
            from keras_sync.training import instrument as _instrument

            steps = sync.config.runtime.gradient_accumulation_steps
            # Always: several replicas' gradients weigh by their examples (an uneven last batch), and
            # the run-time checks (`keras_sync.training.run_checks`) count the examples of every step from the probe.
            accumulator = None
            if steps > 1:
                from keras_sync.training.accumulate import GradientAccumulator

                probe = _instrument.probe_of(model)
                accumulator = (
                    probe.accumulator
                    if probe is not None
                    and probe.accumulator is not None
                    and probe.accumulator.steps == steps
                    else GradientAccumulator(model, steps)
                )
            _instrument.instrument(
                model, gradients=sync.config.runtime.train_step_gradients, accumulator=accumulator
            )

    return RuntimeSetup()
