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
    return True


def check_steps_per_execution(model: Any, strategy: Any) -> None:
    """Refuse `steps_per_execution > 1` where Keras is measured to fail: a multi-worker MWMS.

    keras-team/keras#19246: under `MultiWorkerMirroredStrategy` with several workers Keras's
    multi-step loop (the one-step `tf.function` called inside a `tf.while_loop` and a `tf.cond`)
    fails with "You must feed a value for placeholder tensor 'while/.../cond/Placeholder_1'"
    (Keras 3.15.1, 2 workers, keras-sync's other MWMS fixes on). Tracing the step inline instead
    (no nested function) trains, but the workers then issue their gradient all-reduces in
    different orders ("Shape mismatch in the collective instance"), so it is not a fix.
    `MirroredStrategy` is not affected (steps_per_execution 4 == 1, measured) and is accepted,
    as is any value on one worker.

    Raises:
        UsageError: with the value received and how to fix it.
    """
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    if steps <= 1 or not _is_multi_worker(strategy):
        return
    raise UsageError(
        f"Invalid value for runtime.steps_per_execution (or steps_per_execution of model.compile()). Received: "
        f"{steps} under multi_worker_mirrored with several workers, where Keras's multi-step loop fails "
        "(keras-team/keras#19246). Expected 1 there; steps_per_execution > 1 works with mirrored, tpu and one "
        "worker. Fix: set runtime.steps_per_execution: 1 for multi-worker runs."
    )
