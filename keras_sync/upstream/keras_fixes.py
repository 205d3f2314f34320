"""Fixes for upstream Keras bugs that break distributed `fit`, patched for one `Sync` call; each
cites its upstream issue and is decided by probing what it replaces, not by the Keras version."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import sys
import threading
import time
from typing import Any

from keras_sync.upstream import internals as _internals
from keras_sync.upstream.patching import Patch, original, patched
from keras_sync.upstream.strategy_facts import in_multi_worker_mode


def _is_multi_worker(strategy: Any) -> bool:
    import tensorflow as tf

    is_mwms = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    return is_mwms and in_multi_worker_mode(strategy)


# True while `fit` trains on data whose end Keras's epoch iterator knows (set by `fixed_keras`).
_TRAIN_END_KNOWN = contextvars.ContextVar("keras_sync_train_end_known", default=False)


def _end_known(data: Any) -> bool:
    """Whether Keras stops at the last batch of ``data`` without reading past it: arrays, datasets of
    known cardinality, infinite ones (they never end)."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        return int(data.cardinality()) != int(tf.data.UNKNOWN_CARDINALITY)
    leaves = tf.nest.flatten(data)
    return bool(leaves) and all(
        hasattr(leaf, "shape") and hasattr(leaf, "__len__") for leaf in leaves
    )


@contextlib.contextmanager
def fixed_keras(strategy: Any, train_data: Any = None) -> Any:
    """For the block, Keras runs with the fixes ``strategy`` needs; ``train_data``: what `fit` trains
    on (the end-of-data check is left out when Keras knows its end)."""
    patches = end_of_data_patches() + iterator_release_patches()
    if _is_multi_worker(strategy):
        patches += multi_worker_patches()
    else:
        patches += same_data_order_patches(multi_worker=False)
    token = _TRAIN_END_KNOWN.set(train_data is not None and _end_known(train_data))
    try:
        with patched(patches):
            yield
    finally:
        _TRAIN_END_KNOWN.reset(token)


def multi_worker_patches() -> list[Patch]:
    """Keras 3 `fit` on several workers (keras-team/keras#20585): 1. the first batch's all-reduce of
    nested `PerReplica` (`same_data_order_patches`); 2. scalar logs reduced on axis 0, now averaged;
    3. keras-team/keras#19246: the one-step `tf.function` nested in the multi-step loop, inlined."""
    _internals.require("multi_worker_fit")
    from keras import tree

    tf_trainer = importlib.import_module(_internals.TRAINER)
    cls = tf_trainer.TensorFlowTrainer
    original_reduce = original(tf_trainer, "reduce_per_replica")

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

    # `make_train_function` looks `reduce_per_replica` up in the module at trace time.
    patches: list[Patch] = [(tf_trainer, "reduce_per_replica", reduce_per_replica)]
    patches += same_data_order_patches(multi_worker=True)
    if not _internals.available("multi_worker_steps_per_execution"):
        return patches  # fix 3 left out; check_steps_per_execution refuses spe > 1
    keras_own = original(cls, "_autoconvert_optionals")

    def _autoconvert_optionals(self: Any, step_func: Any) -> Any:
        inner = getattr(step_func, "python_function", None)  # the function a `tf.function` wraps
        spe = int(self.steps_per_execution or 1)
        if inner is not None and spe > 1 and _is_multi_worker(self._distribute_strategy):
            step_func = inner  # jit_compile was the nested function's: the step runs without XLA
        return keras_own(self, step_func)

    return [*patches, (cls, "_autoconvert_optionals", _autoconvert_optionals)]


def end_of_data_patches() -> list[Patch]:
    """No step past the end of data of unknown length (keras-team/keras#23179): with
    ``steps_per_execution == 1`` Keras runs one more step to learn the end, and its ops that do not
    read the batch move ``optimizer.iterations`` and every seed. The step now runs only on an
    optional batch that has a value. The check costs a host round trip, so a train function skips it
    while `fixed_keras` says Keras knows the end (decided per call: a cached train function serves
    fits of both kinds). [] when its closure moved."""
    if not _internals.available(_internals.END_OF_DATA):
        return []
    cls = importlib.import_module(_internals.TRAINER).TensorFlowTrainer
    keras_own = original(cls, "_make_function")

    @functools.wraps(keras_own)  # the probes read Keras's code through __wrapped__
    def _make_function(self: Any, step_function: Any) -> Any:
        function = keras_own(self, step_function)
        cell = function.__code__.co_freevars.index("one_step_on_data")  # probed by END_OF_DATA
        one_step = function.__closure__[cell].cell_contents
        import tensorflow as tf

        iterators = (tf.data.Iterator, tf.distribute.DistributedIterator)
        trains = step_function == self.train_step

        # The check is eager: run in one tf.function with the step inside a tf.cond, 2 replicas
        # under load trained some pipelines to other weights (tests/test_pipeline.py).
        def function_stopping_at_end(iterator: Any) -> Any:
            if (
                int(self.steps_per_execution or 1) != 1
                or not isinstance(iterator, iterators)
                or (trains and _TRAIN_END_KNOWN.get())
            ):
                return function(iterator)
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                raise StopIteration
            return one_step(batch.get_value())

        return function_stopping_at_end

    return [(cls, "_make_function", _make_function)]


def _first_batch_spec(epoch_iterator: Any) -> Any:
    """One replica's specs of a batch of the iterator's dataset; None unless all plain tensors."""
    import tensorflow as tf

    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is None:
        return None

    def one_replica(leaf: Any) -> Any:
        if type(leaf).__name__ == "PerReplicaSpec":  # the same spec once per replica
            leaf = tf.nest.flatten(leaf, expand_composites=True)[0]
        return leaf if isinstance(leaf, tf.TensorSpec) else None

    specs = tf.nest.map_structure(one_replica, spec)
    return None if any(leaf is None for leaf in tf.nest.flatten(specs)) else specs


def same_data_order_patches(multi_worker: bool) -> list[Patch]:
    """Build the model from the dataset's element spec, not a batch of an extra iterator (it starts
    a pass: a reshuffling dataset trains in another order, a generator loses batches). On several
    workers without a spec: the first replica's batch."""
    from keras import tree

    # Probed here, outside the span: inside it the probe would read this patch, not Keras's code.
    if not multi_worker and not _internals.available(_internals.SAME_DATA_ORDER):
        return []
    cls = importlib.import_module(_internals.TRAINER).TensorFlowTrainer
    keras_own = original(cls, "_maybe_symbolic_build")

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None:
            spec = _first_batch_spec(iterator)  # None if Keras no longer keeps the dataset there
            if spec is not None:
                iterator, data_batch = None, spec
            elif multi_worker and _is_multi_worker(strategy):
                import tensorflow as tf

                def first_replica(x: Any) -> Any:
                    if isinstance(x, tf.distribute.DistributedValues):
                        return strategy.experimental_local_results(x)[0]
                    return x

                for *_, it in iterator:  # (step, it) in Keras 3.10, (begin, end, it) later
                    data_batch = tree.map_structure(first_replica, next(it))
                    break
                iterator = None
        return keras_own(self, iterator=iterator, data_batch=data_batch)

    return [(cls, "_maybe_symbolic_build", _maybe_symbolic_build)]


KEPT_ITERATOR = "_keras_sync_dropped_iterator"  # the iterator an epoch iterator's `reset` dropped
_ITERATOR_ATTRS = ("_current_iterator", "_epoch_iterator", KEPT_ITERATOR)
_DESTROYER = "keras-sync-iterator-drop"  # the name of each thread that destroys one iterator


def _at_exit() -> bool:
    """The interpreter is exiting: the main thread is done (its threads are being joined) or later."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()


class _IteratorReleaser:
    """Destroys the tf.data iterators Keras drops off the training thread (`fit` does not wait for
    their autotuning threads): a watcher holds each until nothing else refers to it, or `HOLD_S`,
    then destroys it on a thread of its own, since one destruction can take seconds and one after
    another they add up; a generator is closed and its frame's TensorFlow locals held instead. No
    daemons: one inside TensorFlow at exit aborts the process. At exit what is held is dropped on
    the watcher (no thread can start then)."""

    HOLD_S = 600.0

    def __init__(self) -> None:
        # Reentrant: `release` runs from `__del__`, which a collection may call under the lock.
        self._lock = threading.RLock()
        self._held: list[list[Any]] = []  # [value, held since]
        self._watcher: threading.Thread | None = None

    def release(self, box: list[Any]) -> None:
        """Take what ``box`` holds (its only reference); destroy it off this thread."""
        if not any(v is not None for v in box) or _at_exit():  # at exit the caller drops it
            return
        with self._lock:
            while box:
                self._hold(box.pop())
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="keras-sync-iterators")
                try:
                    self._watcher.start()
                except RuntimeError:  # 3.12: the exit began after the check above; let go
                    self._watcher = None
                    self._held.clear()

    def _hold(self, value: Any) -> None:
        if value is not None and not any(h[0] is value for h in self._held):
            self._held.append([value, time.monotonic()])

    def _watch(self) -> None:
        pause = 0.005
        while True:
            with self._lock:
                self._open_generators()
                alone = self._take_alone(force=_at_exit())
                if not self._held and not alone:
                    self._watcher = None
                    return
            while alone:
                self._destroy(alone.pop())
            pause = min(pause * 2, 0.1) if self._held else 0.005
            time.sleep(pause)

    @staticmethod
    def _destroy(box: list[Any]) -> None:
        """Empty ``box`` (the only reference) on a thread of its own, or here at exit."""
        if not _at_exit():
            with contextlib.suppress(RuntimeError):  # 3.12: the exit began after the check
                threading.Thread(target=box.clear, name=_DESTROYER).start()
                return
        box.clear()  # the destructors run here (TensorFlow releases the GIL)

    def _take_alone(self, force: bool) -> list[list[Any]]:
        """Take out what nothing else refers to (or was held `HOLD_S`), each in a box of its own."""
        now, out = time.monotonic(), []
        for slot in list(self._held):
            # Alone: the slot and getrefcount's argument are its only references.
            if force or now - slot[1] > self.HOLD_S or sys.getrefcount(slot[0]) <= 2:
                self._held.remove(slot)
                out.append([slot.pop(0)])
        return out

    def _open_generators(self) -> None:
        """Replace each held generator by its frame's TensorFlow locals, and close it."""
        for slot in [s for s in self._held if inspect.isgenerator(s[0])]:
            self._held.remove(slot)
            generator = slot.pop(0)
            frame = generator.gi_frame
            values = [] if frame is None else list(dict(frame.f_locals).values())
            inner = [v for v in values if type(v).__module__.startswith("tensorflow.")]
            del frame, values
            with contextlib.suppress(Exception):
                generator.close()
            del generator
            while inner:
                self._hold(inner.pop())

    def wait(self, timeout_s: float) -> bool:
        """Wait until every iterator handed over is destroyed; True when none is left."""
        deadline = time.monotonic() + timeout_s
        watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout_s)
        destroyers = [t for t in threading.enumerate() if t.name == _DESTROYER]
        for thread in destroyers:  # no more start once the watcher has ended
            thread.join(max(0.0, deadline - time.monotonic()))
        return self._watcher is None and not any(t.is_alive() for t in destroyers)


RELEASER = _IteratorReleaser()


class _ReleasedOffThread:
    """An epoch iterator attribute whose replaced value goes to `RELEASER`, not dropped in place."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else obj.__dict__.get(self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        # Straight into the box: a local name here could hold the last reference.
        box = [obj.__dict__.get(self.name)]
        if box[0] is not value:
            obj.__dict__[self.name] = value
            RELEASER.release(box)


def iterator_release_patches() -> list[Patch]:
    """Keep the iterator an epoch iterator's `reset` drops alive until the next one (its thread may
    still read: SIGSEGV, in plain Keras too); every one it drops is destroyed by `RELEASER`."""
    if not _internals.available(_internals.EPOCH_ITERATOR_RESET):
        return []
    cls = importlib.import_module("keras.src.trainers.epoch_iterator").EpochIterator
    keras_reset = original(cls, "reset")

    @functools.wraps(keras_reset)
    def reset(self: Any) -> Any:
        # The one kept from the reset before is released now: its threads have long finished.
        setattr(self, KEPT_ITERATOR, getattr(self, "_current_iterator", None))
        return keras_reset(self)

    def __del__(self: Any) -> None:
        RELEASER.release([self.__dict__.pop(name, None) for name in _ITERATOR_ATTRS])

    return [(cls, name, _ReleasedOffThread(name)) for name in _ITERATOR_ATTRS] + [
        (cls, "__del__", __del__),
        (cls, "reset", reset),
    ]


def sums_pass_through(optimizer: Any) -> list[Patch] | None:
    """The patch that lets summed gradients pass the optimizer's own all-reduce unchanged while a
    replica traces its apply (one all-reduce, not two); None when this Keras moved it."""
    if not _internals.available(_internals.SUMS_PASS_THROUGH):
        return None
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return [(inner, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))]


def check_steps_per_execution(model: Any, strategy: Any) -> None:
    """Refuse ``steps_per_execution > 1`` on several workers when fix 3 cannot apply."""
    if int(getattr(model, "steps_per_execution", 1) or 1) > 1 and _is_multi_worker(strategy):
        _internals.require("multi_worker_steps_per_execution")
