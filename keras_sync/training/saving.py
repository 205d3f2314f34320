"""Saving from every worker: the chief writes the user's path, the other workers a temporary copy.

Under `MultiWorkerMirroredStrategy` every worker runs the whole script, so a plain
``model.save("best.keras")`` or a `ModelCheckpoint` makes every worker open the same path for
writing; two writers of one zip file left a `.keras` that does not load here
(``BadZipFile: Bad CRC-32 for file 'config.json'``). TensorFlow's own recipe is that every
worker saves (reading a variable can be a collective) and only the chief to the real path.
This module applies that recipe to the user's own calls:

* Each model compiled in ``sync.scope()`` (and each model `Sync.fit` trains) under a multi-worker
  strategy gets its own ``save`` and ``save_weights`` (`chief_writes_on`; Keras's classes are not
  touched): a worker that is not the chief writes into a fresh temporary directory (same file
  name, so Keras' checks on the extension hold) and deletes it at once. The chief and every
  single-worker strategy write the given path unchanged.
* `guard_callbacks` makes Keras' own `BackupAndRestore` write its backup on the chief only;
  all workers still read it when a job resumes. Keras' `TensorBoard` and `CSVLogger` (and their
  subclasses) write the user's ``log_dir``/``filename`` on the chief only: on the other workers
  they write into a fresh temporary directory, deleted when their `fit` ends (without it every
  worker wrote its own event files into ``tb/train``, so TensorBoard showed every point once per
  worker, and both workers opened ``log.csv`` for writing). `ModelCheckpoint` needs nothing more:
  it saves through the model's ``save``/``save_weights`` (its decision, e.g. ``save_best_only``,
  is the same on every worker because the logs it reads are all-reduced).
* `save` is the explicit form (``sync.save(model, path)``).

The chief is who `keras_sync.cluster.strategy_role` names (the ``chief`` task, else ``worker`` 0;
the rule TensorFlow's ``should_checkpoint`` follows too). ``keras.saving.save_model(model, ...)``, the function, is
not wrapped: use ``model.save`` or ``sync.save``. A callback keras-sync does not know writes its
path on every worker: guard it with ``sync.is_chief`` (docs/how-to/saving.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import strategy_role
from keras_sync.errors import UsageError

TEMP_PREFIX = "keras_sync_worker_save_"


def writes_user_paths(strategy: Any) -> bool:
    """Whether this process writes the paths a user gives: the chief, or any single-worker strategy."""
    return strategy is None or strategy_role(strategy).is_chief


@contextlib.contextmanager
def write_target(filepath: Any, strategy: Any) -> Iterator[Any]:
    """The path this worker should write ``filepath`` to: itself on the chief, else a temporary
    file of the same name that is deleted when the block ends."""
    if writes_user_paths(strategy):
        yield filepath
        return
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        yield os.path.join(tmp, os.path.basename(os.fspath(filepath).rstrip("/")) or "model.keras")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def chief_writes_on(model: Any) -> None:
    """Give ``model`` its own ``save`` and ``save_weights``: the chief writes the user's path, the
    other workers a temporary copy (see the module docstring). Keras's classes are left as they are."""
    for name in ("save", "save_weights"):
        if name not in vars(model):
            object.__setattr__(model, name, _chief_writes(model, getattr(type(model), name)))


def _chief_writes(model: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        with write_target(filepath, getattr(model, "_distribute_strategy", None)) as target:
            return method(model, target, *args, **kwargs)

    return wrapper


def save(model: Any, filepath: Any, **kwargs: Any) -> None:
    """Save ``model`` to ``filepath`` from every worker; only the chief writes ``filepath``.

    Call it on every worker. ``*.weights.h5`` saves the weights (`model.save_weights`); any
    other name saves the whole model (`model.save`: ``.keras``, or legacy ``.h5``).
    """
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
    with write_target(filepath, getattr(model, "_distribute_strategy", None)) as target:
        getattr(type(model), name)(model, target, **kwargs)


#: Keras callbacks that write files, and the attribute holding the user's path: on a worker that
#: is not the chief it is pointed into a temporary directory before `fit` hands the callback the
#: model (TensorBoard derives its ``train``/``validation`` directories from ``log_dir`` there).
#: ModelCheckpoint needs no entry: it saves through the model's ``save``/``save_weights``.
USER_PATH_ATTRS = (("TensorBoard", "log_dir"), ("CSVLogger", "filename"))
_USER_PATH_MARK = "_keras_sync_user_path"


def guard_callbacks(strategy: Any, callbacks: list[Any]) -> list[Any]:
    """Make Keras' callbacks in ``callbacks`` write the user's paths on the chief only; returns the list.

    `BackupAndRestore`: on the other workers its save goes through ``model.save_weights`` (so to
    a temporary file, taking part in any collective), its metadata file is not written, and the
    backup is not deleted at train end (the chief deletes it). Restoring still reads
    ``backup_dir``, which must be on storage every worker sees. `TensorBoard`, `CSVLogger`: see
    `USER_PATH_ATTRS`.
    """
    if writes_user_paths(strategy):
        return callbacks
    import keras

    for cb in callbacks:
        if (
            type(cb) is keras.callbacks.BackupAndRestore
        ):  # a subclass may save differently: left alone
            _non_chief_backup(cb)
        for class_name, attr in USER_PATH_ATTRS:
            if isinstance(cb, getattr(keras.callbacks, class_name)):
                _write_elsewhere(cb, attr)
    return callbacks


def _write_elsewhere(cb: Any, attr: str) -> None:
    """Point ``cb.<attr>`` into a fresh temporary directory, deleted after the callback's train end."""
    user_path = getattr(cb, _USER_PATH_MARK, None) or getattr(
        cb, attr
    )  # a callback reused by a second fit
    setattr(cb, _USER_PATH_MARK, user_path)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    setattr(
        cb, attr, os.path.join(tmp, os.path.basename(os.fspath(user_path).rstrip("/")) or "logs")
    )
    train_end = type(cb).on_train_end

    def on_train_end(logs: Any = None) -> None:
        try:
            train_end(cb, logs)  # closes the file or the event writers first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    cb.on_train_end = on_train_end


def _non_chief_backup(cb: Any) -> None:
    # Keras 3's BackupAndRestore saves in `_save_model` (weights, then a metadata JSON, after
    # optional copies to `.bkp`) and deletes `backup_dir` in `on_train_end`.
    if not callable(getattr(cb, "_save_model", None)) or not hasattr(cb, "_weights_path"):
        from importlib.metadata import version

        raise UsageError(
            f"keras.callbacks.BackupAndRestore of Keras {version('keras')} has no `_save_model`/`_weights_path`, "
            "so keras-sync cannot keep the workers that are not the chief from writing its backup. "
            "Fix: use keras-sync's backup (fault_tolerance.backup_dir in the config) instead."
        )
    cb._save_model = lambda: cb.model.save_weights(cb._weights_path, overwrite=True)
    cb.on_train_end = lambda logs=None: None
