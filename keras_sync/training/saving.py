"""Under several workers the chief alone writes, and every worker meets the others.

TensorFlow's recipe: every worker saves (a read can be a collective), only the chief to the real
path, the others to a temporary directory deleted at once; `guard_callbacks` does the same for
Keras's file-writing callbacks. ``keras.saving.save_model`` and callbacks keras-sync does not know
write on every worker: guard them with ``sync.is_chief``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import strategy_role
from keras_sync.errors import UsageError

TEMP_PREFIX = "keras_sync_worker_save_"


def wrap_own(
    model: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], mark: str
) -> None:
    """Give ``model`` its own ``name``: ``wrap(call)``, ``call`` running the method it has now (its
    own, else its class's); once per ``mark``."""
    own = vars(model).get(name)
    if getattr(own, mark, False):
        return
    ref = weakref.ref(model)

    def call(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        return (own or getattr(type(model), name).__get__(model))(*args, **kwargs)

    wrapper = functools.wraps(own or getattr(type(model), name))(wrap(call))
    setattr(wrapper, mark, True)  # functools.wraps copied the marks of the wrapped one
    object.__setattr__(model, name, wrapper)  # a function is not state for Keras's tracker


def for_workers(model: Any) -> None:
    """Under several workers: ``save``/``save_weights`` write the user's path on the chief only,
    ``fit``/``evaluate``/``predict`` meet the peers first (every worker, or one line)."""
    from keras_sync.cluster.collective_calls import collective

    strategy, ref = model.distribute_strategy, weakref.ref(model)

    def chief_writes(call: Callable[..., Any]) -> Callable[..., Any]:
        def save(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            with write_target(filepath, strategy) as target:
                return call(target, *args, **kwargs)

        return save

    def meeting(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            with collective(ref(), f"model.{name}"):
                return call(*args, **kwargs)

        return method

    for name in ("save", "save_weights"):
        wrap_own(model, name, chief_writes, "_keras_sync_chief_writes")
    for name in ("fit", "evaluate", "predict"):
        wrap_own(model, name, functools.partial(meeting, name), "_keras_sync_meets_peers")


@contextlib.contextmanager
def write_target(filepath: Any, strategy: Any) -> Iterator[Any]:
    """The path to write ``filepath`` to: itself on the chief, else a temporary file of the same
    name (Keras's extension checks hold), deleted when the block ends."""
    if strategy is None or strategy_role(strategy).is_chief:
        yield filepath
        return
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        yield os.path.join(tmp, os.path.basename(os.fspath(filepath).rstrip("/")) or "model.keras")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save(model: Any, filepath: Any, **kwargs: Any) -> None:
    """Save ``model`` to ``filepath`` (``*.weights.h5``: its weights) from every worker; only the
    chief writes ``filepath``."""
    if not hasattr(model, "save") or not hasattr(model, "save_weights"):
        raise UsageError(
            f"Invalid value for argument `model` of sync.save. Received: {type(model).__name__}. "
            "Expected a Keras model."
        )
    if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
        raise UsageError(
            f"Invalid value for argument `filepath` of sync.save. Received: filepath={filepath!r}. "
            "Expected a path such as 'model.keras' or 'model.weights.h5'."
        )
    name = "save_weights" if os.fspath(filepath).endswith(".weights.h5") else "save"
    with write_target(filepath, getattr(model, "distribute_strategy", None)) as target:
        getattr(type(model), name)(model, target, **kwargs)


#: Keras callbacks that write files, and the attribute of the user's path (a temporary one elsewhere).
USER_PATH_ATTRS = (("TensorBoard", "log_dir"), ("CSVLogger", "filename"))
_USER_PATH_MARK = "_keras_sync_user_path"


def guard_callbacks(strategy: Any, callbacks: list[Any]) -> list[Any]:
    """Make Keras's callbacks in ``callbacks`` write the user's paths on the chief only; returns the
    list (elsewhere `BackupAndRestore` saves to a temporary file and deletes nothing)."""
    if strategy_role(strategy).is_chief:
        return callbacks
    import keras

    from keras_sync.upstream.backup_and_restore import non_chief_backup

    for cb in callbacks:
        if type(cb) is keras.callbacks.BackupAndRestore:  # a subclass may save differently
            non_chief_backup(cb)
        for class_name, attr in USER_PATH_ATTRS:
            if isinstance(cb, getattr(keras.callbacks, class_name)):
                _write_elsewhere(cb, attr)
    return callbacks


def _write_elsewhere(cb: Any, attr: str) -> None:
    """Point ``cb.<attr>`` into a fresh temporary directory, deleted after the callback's train end."""
    user_path = getattr(cb, _USER_PATH_MARK, None) or getattr(cb, attr)  # a callback reused
    setattr(cb, _USER_PATH_MARK, user_path)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    name = os.path.basename(os.fspath(user_path).rstrip("/")) or "logs"
    setattr(cb, attr, os.path.join(tmp, name))
    train_end = type(cb).on_train_end

    def on_train_end(logs: Any = None) -> None:
        try:
            train_end(cb, logs)  # closes the file or the event writers first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    cb.on_train_end = on_train_end
