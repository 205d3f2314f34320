"""Fixes for upstream Keras bugs that break distributed `fit`, applied where probes allow.

Each fix cites its upstream issue. Whether it can be applied is decided by probing the
internals it patches (`keras_sync._internals`, feature ``multi_worker_fit``), not by the
Keras version number: a Keras that moved one is refused with one line. Results with the
fixes equal plain Keras on one device (see tests/test_keras_compat.py). No TensorFlow or
Keras import at module import time.
"""

from __future__ import annotations

import logging
from typing import Any

from keras_sync.errors import UsageError

logger = logging.getLogger(__name__)

# keras-team/keras#20585 is present from Keras 3.0 and still in 3.15.1 (measured here); the
# canary test (tests/test_keras_compat.py) says when plain Keras stops failing.
_PATCH_MARK = "_keras_sync_multi_worker_fix"


def _is_multi_worker(strategy: Any) -> bool:
    import tensorflow as tf

    from keras_sync.strategy import in_multi_worker_mode

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and in_multi_worker_mode(strategy)


def apply_multi_worker_fixes() -> bool:
    """Make Keras 3 `model.fit` work under a multi-worker `MultiWorkerMirroredStrategy`.

    keras-team/keras#20585 (also tensorflow/tensorflow#72388): under MWMS with more
    than one worker, `fit` fails twice in `keras/src/backend/tensorflow/trainer.py`:

    1. `TensorFlowTrainer._maybe_symbolic_build` all-reduces the first (tuple)
       data batch with `strategy.reduce("MEAN", ..., axis=None)` only to learn its
       shapes, which fails for a nested structure of `PerReplica`. We give it the
       first local replica's batch instead: same shapes and dtypes, no collective.
    2. `reduce_per_replica` reduces the logs with `strategy.reduce("MEAN", v,
       axis=0)`; the logs are scalars ("Invalid reduction dimension 0 for input
       with 0 dimensions"). For scalars we reduce across replicas only
       (`axis=None`), which is the mean Keras reports on one machine.

    3. keras-team/keras#19246 under MWMS: with ``steps_per_execution > 1`` the train
       (and test) function calls the one-step `tf.function` inside a `tf.while_loop`
       and a `tf.cond`; with the multi-worker collectives in it, running it fails with
       "You must feed a value for placeholder tensor 'while/.../cond/Placeholder_1'".
       We give Keras the one-step Python function instead of its nested `tf.function`
       (`_autoconvert_optionals` receives it), so the step is traced inline into the
       multi-step function: same ops, no nested function call. Measured: 2 workers,
       steps_per_execution 4 gives weights identical to 1 (max |dw| 0.0). The nested
       function only carried `jit_compile`: with XLA on, the multi-step loop of an MWMS
       model then runs without XLA (a line says so). `MirroredStrategy` is not affected
       (steps_per_execution 4 == 1 there with plain Keras) and is left alone.

    All patches only change behaviour when the strategy is a multi-worker MWMS;
    every other call goes to the original Keras code.

    Returns:
        True: the fixes are active (now or from an earlier call).

    Raises:
        CompatibilityError: the installed Keras no longer has the internals patched here.
    """
    from keras_sync import _internals

    _internals.require("multi_worker_fit")
    from keras import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if getattr(tf_trainer.reduce_per_replica, _PATCH_MARK, False):
        return True

    original_reduce = tf_trainer.reduce_per_replica
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        tpu = tf_trainer._is_tpu_strategy(strategy)
        if reduction not in ("auto", "mean") or tpu or not _is_multi_worker(strategy):
            return original_reduce(values, strategy, reduction)

        def _reduce(v: Any) -> Any:
            first = v.values[0] if tf_trainer._is_per_replica_instance(v) else v
            if tf_trainer._is_scalar(first):
                return strategy.reduce("MEAN", v, axis=None)
            return original_reduce(v, strategy, reduction)

        return tree.map_structure(_reduce, values)

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None and _is_multi_worker(strategy):
            import tensorflow as tf

            def first_replica(x: Any) -> Any:
                if isinstance(x, tf.distribute.DistributedValues):
                    return strategy.experimental_local_results(x)[0]
                return x

            for *_, it in iterator:  # (step, it) in Keras 3.10, (begin, end, it) later
                data_batch = tree.map_structure(first_replica, next(it))
                break
            iterator = None
        return original_build(self, iterator=iterator, data_batch=data_batch)

    setattr(reduce_per_replica, _PATCH_MARK, True)
    setattr(_maybe_symbolic_build, _PATCH_MARK, True)
    # `make_train_function` looks `reduce_per_replica` up in the module at trace time.
    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    if multi_step_probe():
        tf_trainer.TensorFlowTrainer._autoconvert_optionals = _inline_multi_step(
            tf_trainer.TensorFlowTrainer._autoconvert_optionals)
    return True


def multi_step_probe() -> bool:
    """Whether Keras still hands its one-step `tf.function` to `_autoconvert_optionals` (fix 3's hook)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TensorFlowTrainer
    make = getattr(cls, "_make_function", None)
    if not callable(getattr(cls, "_autoconvert_optionals", None)) or make is None:
        return False
    names, codes = set(), [make.__code__]
    while codes:  # the names `_make_function` and its nested functions use
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if hasattr(c, "co_names")]
    return {"_autoconvert_optionals", "steps_per_execution", "while_loop"} <= names


def multi_step_fixed() -> bool:
    """Whether fix 3 (steps_per_execution > 1 under multi-worker MWMS) is active in this process."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    return getattr(tf_trainer.TensorFlowTrainer._autoconvert_optionals, _PATCH_MARK, False)


def _inline_multi_step(original: Any) -> Any:
    def _autoconvert_optionals(self: Any, step_func: Any) -> Any:
        strategy = self._distribute_strategy
        inner = getattr(step_func, "python_function", None)
        if inner is not None and int(self.steps_per_execution or 1) > 1 and strategy is not None \
                and _is_multi_worker(strategy):
            if self.jit_compile:
                logger.warning("keras-sync: under multi_worker_mirrored with steps_per_execution=%s the train step "
                               "runs without XLA (keras-team/keras#19246 workaround)", self.steps_per_execution)
            step_func = inner
        return original(self, step_func)

    setattr(_autoconvert_optionals, _PATCH_MARK, True)
    return _autoconvert_optionals


def check_steps_per_execution(model: Any, strategy: Any) -> None:
    """Refuse `steps_per_execution > 1` where Keras fails and keras-sync has no fix here.

    Only a multi-worker `MultiWorkerMirroredStrategy` fails (keras-team/keras#19246, see
    fix 3 of `apply_multi_worker_fixes`); with the fix active, or on any other strategy,
    every value is accepted.

    Raises:
        UsageError: with the value received and how to fix it.
    """
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    if steps <= 1 or not _is_multi_worker(strategy) or multi_step_fixed():
        return
    raise UsageError(
        f"Invalid value for runtime.steps_per_execution (or steps_per_execution of model.compile()). Received: "
        f"{steps} under multi_worker_mirrored with Keras {'.'.join(map(str, _keras_version()))}, where Keras's "
        "multi-step loop fails (keras-team/keras#19246) and keras-sync's fix is not available for this version "
        f"(tested: Keras {TESTED_RANGE_TEXT}). Fix: use steps_per_execution 1, or a Keras version in that range."
    )
