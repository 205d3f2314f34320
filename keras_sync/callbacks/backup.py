"""Back up the training state and resume exactly where a killed job stopped, mid-epoch included.

Keras' own `BackupAndRestore` restores weights and the epoch, but with an integer `save_freq`
it restarts the interrupted epoch at batch 0 and replays a different data order, so the
result differs from an uninterrupted run. This callback restores everything that decides the
next update: weights, optimizer state (``iterations``, momentum...), the epoch, the batches of
it already trained, the metric totals of that epoch, and the position of the input pipeline.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import keras

from keras_sync.cluster import strategy_role
from keras_sync.errors import UsageError
from keras_sync.training import backup_files as _backup_files
from keras_sync.training.resume import ResumePoint, SaveSchedule, batches_to_skip, write_dir
from keras_sync.upstream.strategy_facts import in_multi_worker_mode

log = logging.getLogger("keras_sync")


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state every epoch or every N batches; restore it when `fit` restarts.

    Saved with `tf.train.Checkpoint`: the model, its optimizer, the metrics of the running epoch
    and the position ``(epoch, batches trained in it)``. On restart the weights and optimizer
    are restored before any other callback's ``on_train_begin`` runs (put this callback first),
    so ``model.optimizer.iterations`` already holds the restored step count there; `fit` then
    continues at the saved epoch and skips the batches already trained, replaying the input
    pipeline so a seeded shuffle yields the same order as an uninterrupted run.

    Under `MultiWorkerMirroredStrategy` every worker saves (reading the variables is collective);
    the chief writes ``backup_dir`` and the others a temporary directory they delete at once.
    All workers restore from ``backup_dir``, which must be on storage they share. The backup is
    deleted when training ends normally.

    Skipping batches needs `Sync.fit` (it installs the epoch iterator that can skip). Passed to
    plain `model.fit`, a mid-epoch backup restarts its epoch at batch 0, as Keras does.

    Args:
        backup_dir: directory for the checkpoints; not shared with anything else.
        save_freq: ``"epoch"``, or an integer: save every that many batches.
        delete_checkpoint: delete the backup when training finishes. Defaults to True.
        max_to_keep: checkpoints kept (the newest ones), at least 2: a damaged newest one is skipped
            on restore for the one before (each checkpoint's manifest, written last, tells complete
            from partial; see `keras_sync.training.backup_files`). Defaults to 2.
        grace_period_s: a SIGTERM (or Ctrl-C) during `fit` saves a backup at the current step on every
            worker, then exits with code 143 (130) (`keras_sync.cluster.preemption`); if that cannot happen
            within this many seconds, the process exits without it. None: both signals are left alone.
            Defaults to 25 (under Kubernetes' default grace of 30 s).
        writer: the MLflow writer whose queued metrics go to its spool before each save.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks, flushed
            before each save (so `SyncMetrics` logs the steps the backup holds first).

    Example:
        >>> sync = keras_sync.load({"fault_tolerance": {"backup_dir": "/tmp/bk", "save_freq": 50}})  # doctest: +SKIP
        >>> sync.fit(model, x, y, epochs=5)   # adds this callback; rerun after a kill to resume  # doctest: +SKIP
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        *,
        delete_checkpoint: bool = True,
        max_to_keep: int = 2,
        grace_period_s: float | None = 25.0,
        writer: Any = None,
        shared: Any = None,
    ):
        super().__init__()
        from keras_sync.training.context import check_shared

        self._barrier_fn: tuple[Any, Any] | None = None  # (strategy, its traced barrier)

        #: Flushed on every worker before each save: the held sync metrics are put in the writer
        #: (then in its spool) before the backup of their step exists.
        self.shared = check_shared(shared)
        # The MLflow writer, if any: its queued metrics are put in its spool before each backup, so
        # that after a kill MLflow has every step up to the backup the job resumes from.
        self.writer = writer
        #: Called on every worker before each save, after the shared flush (`Sync.fit` records the
        #: MLflow run id with the backup here).
        self.before_save: list[Any] = []
        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            raise UsageError(
                f"Invalid value for argument `backup_dir`. Received: backup_dir={backup_dir!r}. "
                "Expected the path of a directory used for nothing else."
            )
        self.backup_dir = os.fspath(backup_dir)
        self._schedule = SaveSchedule(save_freq)
        self.save_freq = save_freq
        if grace_period_s is not None and (
            isinstance(grace_period_s, bool)
            or not isinstance(grace_period_s, (int, float))
            or grace_period_s <= 0
        ):
            raise UsageError(
                f"Invalid value for argument `grace_period_s`. Received: grace_period_s={grace_period_s!r}. "
                "Expected a number of seconds > 0, or None to leave SIGTERM alone."
            )
        from keras_sync.cluster.preemption import PreemptionSaver

        self._preemption = PreemptionSaver(grace_period_s) if grace_period_s is not None else None
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep
        self.restored: ResumePoint | None = None
        #: The checkpoints a restore may use (`keras_sync.training.backup_files.choose`), when chosen before fit.
        self.choice: Any = None
        #: The `BackupLock` `Sync.fit` holds on ``backup_dir`` for this fit (released at its end).
        self.lock: Any = None
        self.epoch_iterator: Any = None  # set by `resumable_fit` to fit's training iterator
        self._epoch = 0
        self._step = 0
        # the cause of the last backup the disk refused, until one works
        self._failed_save: str | None = None
        self._restore_metrics_from: str | None = None
        self._deferred = False  # a scheduled save waits for gradient accumulation's next update

    # -- Keras hooks -----------------------------------------------------------------------

    def on_train_begin(self, logs: Any = None) -> None:
        import tensorflow as tf

        self._deferred = False

        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            # its variables must exist to be restored
            model.optimizer.build(model.trainable_variables)
        self._position = tf.Variable(
            [0, 0], dtype=tf.int64, trainable=False, name="keras_sync_position"
        )
        # The job's step minus the model's (`SharedState.job_step`): a resumed fit logs at the steps it
        # logged before. Saved, but restored on its own (`_restore_step_offset`): a backup written before
        # it existed must still restore.
        self._step_offset = tf.Variable(
            -1, dtype=tf.int64, trainable=False, name="keras_sync_step_offset"
        )
        state = dict(
            model=model,
            optimizer=model.optimizer,
            position=self._position,
            metrics=list(model.metrics_variables),
            random=random_states(model),
        )
        self._ckpt = tf.train.Checkpoint(**state)
        self._saved = tf.train.Checkpoint(**state, step_offset=self._step_offset)
        role = strategy_role(model.distribute_strategy)
        self._is_chief, task_id = role.is_chief, role.task_id
        self._dir = write_dir(self.backup_dir, is_chief=self._is_chief, task_id=task_id)
        choice, self.choice = self.choice or _backup_files.choose(self.backup_dir), None
        if self._is_chief:
            _drop_damaged_state_file(self.backup_dir)
        self._manager = tf.train.CheckpointManager(
            self._saved, self._dir, max_to_keep=max(self.max_to_keep, 2)
        )
        self.restored = None
        self._resume_line: str | None = None
        self._epoch = self._step = 0
        if self._preemption is not None:
            self._preemption.begin(model.distribute_strategy)
        latest = self._restore(choice)
        if latest is None:
            return
        epoch, step = (int(v) for v in self._position.numpy())
        iterations = int(model.optimizer.iterations.numpy()) if model.optimizer is not None else 0
        point = ResumePoint(epoch=epoch, step=step, iterations=iterations)
        self.restored = point  # the resume check compares the step training continues from
        model._initial_epoch = epoch  # read by Keras fit right after on_train_begin
        self._epoch, self._step = epoch, step
        if point.mid_epoch:
            if self.epoch_iterator is not None:
                skip = batches_to_skip(point, int(getattr(model, "steps_per_execution", 1) or 1))
                self.epoch_iterator.resume_at(epoch, skip)
                self._restore_metrics_from = latest
            else:
                warnings.warn(
                    f"keras-sync BackupAndRestore: the backup in {self.backup_dir} was taken after batch {step} of "
                    f"epoch {epoch}, but this fit cannot skip batches (use sync.fit), so epoch {epoch} restarts at "
                    "batch 0 and the result will differ from an uninterrupted run.",
                    UserWarning,
                    stacklevel=2,
                )
        elif self.epoch_iterator is not None:
            self.epoch_iterator.resume_at(epoch, 0)
        log.info(
            "keras-sync: resumed from %s at epoch %d, batch %d (optimizer step %d)",
            latest,
            epoch,
            step,
            iterations,
        )
        # Said at the first epoch begin, once every callback's on_train_begin has run and the
        # restored step is seen to hold (a relaunch should say that it continued, once per job).
        self._resume_line = (
            f"keras-sync: resumed from the backup in {self.backup_dir}: epoch {epoch + 1}, after "
            f"batch {step} (optimizer step {iterations})"
        )

    def _restore(self, choice: Any) -> str | None:
        """Restore the newest complete checkpoint that TensorFlow reads back; the path, or None if none."""
        import tensorflow as tf

        skipped = list(choice.skipped)
        for prefix in choice.usable:
            try:
                self._ckpt.restore(prefix).assert_existing_objects_matched()
            except (
                tf.errors.OpError,
                ValueError,
                AssertionError,
            ) as e:  # the manifest matched, the content did not
                skipped.append((prefix, f"TensorFlow cannot read it back: {type(e).__name__}"))
                continue
            if self._is_chief:
                _backup_files.say_skipped(_backup_files.Choice([prefix], skipped))
            self._restore_step_offset(prefix)
            return prefix
        if any(not why.startswith("incomplete") for _, why in skipped):
            raise _backup_files.no_usable_backup(self.backup_dir, skipped)
        if skipped and self._is_chief:
            _backup_files.say_skipped(_backup_files.Choice([], skipped))
        return None

    def _restore_step_offset(self, prefix: str) -> None:
        """The job's step offset saved with ``prefix`` becomes this fit's; none saved (an older backup): 0."""
        import tensorflow as tf

        self._step_offset.assign(-1)
        tf.train.Checkpoint(step_offset=self._step_offset).read(prefix).expect_partial()
        self.shared.step_offset = max(int(self._step_offset.numpy()), 0)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.restored is not None and getattr(self, "_resume_line", None):
            self._check_restored_state_held()
        self._epoch, self._step = epoch, (self._step if epoch == self._epoch else 0)
        if self._restore_metrics_from is not None:
            # Keras resets the metrics just before this hook; bring back the totals of the batches
            # trained before the interruption so the epoch's logs equal an uninterrupted run's.
            import tensorflow as tf

            tf.train.Checkpoint(metrics=list(self.model.metrics_variables)).read(
                self._restore_metrics_from
            ).expect_partial()
            self._restore_metrics_from = None

    def _check_restored_state_held(self) -> None:
        """The run-time check behind `refuse_keras_backup`: nothing restored other state over ours."""
        line, self._resume_line = self._resume_line, None
        assert self.restored is not None
        now = self._iterations() if self.model.optimizer is not None else 0
        if now != self.restored.iterations:
            raise UsageError(
                f"keras-sync's backup in {self.backup_dir} restored optimizer step {self.restored.iterations}, but another "
                f"callback changed it to {now} before training resumed (a second backup-and-restore callback?), so the "
                "data position and the weights would not match. Fix: keep one backup: remove that callback, or remove "
                "fault_tolerance.backup_dir."
            )
        if self._is_chief:
            print(line, file=sys.stderr, flush=True)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        trained = batch + 1
        done, self._step = trained - self._step, trained
        scheduled = self._schedule.after_batch(max(done, 1)) or self._deferred
        preempted = self._preemption is not None and self._preemption.save_due(self._iterations)
        if (scheduled or preempted) and self._between_updates():
            self._deferred = scheduled  # a SIGTERM's save stays due (save_due answers True again)
            return
        self._deferred = False
        saved = self._save() if scheduled or preempted else False
        if preempted:
            self._exit_preempted(saved)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._step = epoch + 1, 0
        scheduled = self._schedule.after_epoch()
        preempted = self._preemption is not None and self._preemption.save_due_at_epoch_end(
            self._iterations
        )
        if (scheduled or preempted) and self._between_updates():
            # An epoch that ends between two updates: the backup (and a SIGTERM's) moves to the
            # first batch end of the next epoch that applies the sums.
            self._deferred = self._deferred or scheduled
            return
        saved = self._save() if scheduled or preempted else False
        if preempted:
            self._exit_preempted(saved)

    def on_train_end(self, logs: Any = None) -> None:
        if self.restored is not None and getattr(self, "_resume_line", None):
            self._check_restored_state_held()  # restored after the last epoch: no epoch began
        # a later fit on this model starts at its own initial_epoch
        self.model._initial_epoch = None
        if self._preemption is not None:
            from keras_sync.cluster.preemption import signal_name

            if self._preemption.end() and self._is_chief:
                print(
                    f"keras-sync: {signal_name(self._preemption.signum)} arrived as training ended; training is "
                    "complete, so no backup was saved for it",
                    file=sys.stderr,
                    flush=True,
                )
        if self.delete_checkpoint:
            # Every worker saves at the last epoch end; the chief must not delete the backup (with the
            # other workers' temporary directories in it) while one is still writing: a barrier.
            self._barrier()
            if self._is_chief:
                shutil.rmtree(self.backup_dir, ignore_errors=True)

    def _barrier(self) -> None:
        strategy = self.model.distribute_strategy
        if not in_multi_worker_mode(strategy):
            return
        if self._barrier_fn is None or self._barrier_fn[0] is not strategy:
            import tensorflow as tf

            # In a tf.function: run eagerly, MWMS warns "Using MultiWorkerMirroredStrategy eagerly has
            # significant overhead" on every worker at the end of every fit.
            @tf.function(autograph=False)
            def barrier() -> Any:
                return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

            self._barrier_fn = (strategy, barrier)
        self._barrier_fn[1]()

    # -- saving ----------------------------------------------------------------------------

    def _between_updates(self) -> bool:
        """True while gradient accumulation holds micro-batches not applied yet (a backup would lose them)."""
        from keras_sync.training import instrument as _instrument

        return _instrument.holds_unapplied_gradients(self.model)

    def _iterations(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _exit_preempted(self, saved: bool = True) -> None:
        """After the coordinated save: every worker waits for the others, then exits with code 143 (SIGTERM)
        or 130 (Ctrl-C)."""
        from keras_sync.cluster.preemption import exit_code, exit_now, signal_name

        self._barrier()  # no worker leaves while another still takes part in the save
        assert self._preemption is not None
        self._preemption.watch.done()
        name, code = signal_name(self._preemption.signum), exit_code(self._preemption.signum)
        message = None
        if self._is_chief and saved:
            message = (
                f"{name}: saved a backup in {self.backup_dir} at epoch {self._epoch + 1}, after batch "
                f"{self._step} (optimizer step {self._iterations()}); exiting with code "
                f"{code}. Relaunch the job to resume from there."
            )
        elif self._is_chief:
            newest = _backup_files.newest_complete(self.backup_dir)
            where = (
                f"the newest backup, optimizer step {newest}"
                if newest is not None
                else "the start (no backup)"
            )
            message = (
                f"{name}: the backup at optimizer step {self._iterations()} could not be written to "
                f"{self.backup_dir} (said above); exiting with code {code}. A relaunch resumes "
                f"from {where}."
            )
        exit_now(code, message)

    def _save(self) -> bool:
        """Back up now; False when the disk refused it (said in one line, see `_save_failed`)."""
        self.shared.flush()
        for hook in self.before_save:
            hook()
        durable = getattr(self.writer, "flush_to_spool", None)  # optional in the Writer protocol
        if durable is not None and not durable(timeout_s=10.0):
            warnings.warn(
                "keras-sync: the MLflow spool did not take the queued metrics within 10 s; "
                "a crash now may lose the last steps' metrics.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._position.assign([self._epoch, self._step])
        # fixed by SyncMetrics' first step (else 0)
        self._step_offset.assign(self.shared.step_offset or 0)
        if not self._is_chief:
            os.makedirs(self._dir, exist_ok=True)
        number = int(self.model.optimizer.iterations.numpy())
        # a checkpoint of this number from before a fall-back: its manifest no longer holds
        if self._is_chief:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, f"ckpt-{number}{_backup_files.MANIFEST_SUFFIX}"))
        import tensorflow as tf

        try:
            prefix = self._manager.save(checkpoint_number=number)
            if not self._is_chief:
                shutil.rmtree(self._dir, ignore_errors=True)
                return True
            from keras_sync.training.job_run import run_record

            # Last, atomically: a checkpoint without its manifest is a save that was cut off.
            _backup_files.write_manifest(
                prefix, run_record(self.writer) if self.writer is not None else None
            )
        except (
            tf.errors.OpError,
            OSError,
        ) as e:  # a full or unwritable disk: the older backups still hold
            self._save_failed(number, e)
            return False
        if self._failed_save is not None and self._is_chief:
            print(
                f"keras-sync: backups in {self.backup_dir} are written again (optimizer step {number}).",
                file=sys.stderr,
                flush=True,
            )
        self._failed_save = None
        return True

    def _save_failed(self, number: int, error: BaseException) -> None:
        """One line (once per cause) for a backup the disk refused; training goes on with the older backups."""
        # TensorFlow's half-written checkpoint
        for temp in glob.glob(os.path.join(self._dir, "ckpt-*_temp")):
            shutil.rmtree(temp, ignore_errors=True)
        if not self._is_chief:
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        cause = _disk_error(error)
        newest = _backup_files.newest_complete(self.backup_dir)
        self._newest_failed = number
        if self._failed_save == cause:
            return
        self._failed_save = cause
        free = _free_bytes(self.backup_dir)
        size = (
            _backup_files.checkpoint_bytes(self.backup_dir, newest) if newest is not None else None
        )
        room = f"; {_kb(free)} free there" if free is not None else ""
        room += f", a backup takes {_kb(size)}" if size else ""
        resume = (
            f"a relaunch resumes from the newest backup, optimizer step {newest}"
            if newest is not None
            else "there is no backup to resume from yet"
        )
        message = (
            f"keras-sync: the backup at optimizer step {number} could not be written to {self.backup_dir} "
            f"({cause}{room}); training goes on, and {resume}. Fix: free space there, or set "
            "fault_tolerance.backup_dir to a folder this process can write on a disk with room. "
            "keras-sync tries again at each save and says when it works."
        )
        print(message, file=sys.stderr, flush=True)
        if self.writer is not None:
            self.writer.set_tags({"keras_sync.backup_failed": message[:4900]})

    def release(self) -> None:
        """Give the backup directory back (the lock `Sync.fit` took for this fit)."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()
        _backup_files.remember(self.backup_dir, None)


def _disk_error(error: BaseException) -> str:
    """What the disk said, from an OSError or TensorFlow's op error ("...; No space left on device [Op:SaveV2]")."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(getattr(error, "message", error)).split(" [Op:", 1)[0]
    return text.rsplit("; ", 1)[-1].strip() or type(error).__name__


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _kb(n: int | None) -> str:
    n = n or 0
    return f"{n / 1024:,.0f} KB" if n < 10 << 20 else f"{n / (1 << 20):,.0f} MB"


def _drop_damaged_state_file(backup_dir: str) -> None:
    """TensorFlow's ``checkpoint`` state file, if unreadable, is removed: the checkpoints are found by their
    own files, and `tf.train.CheckpointManager` would refuse the directory ("Invalid checkpoint state")."""
    import tensorflow as tf

    path = os.path.join(backup_dir, "checkpoint")
    if not os.path.exists(path):
        return
    try:
        tf.train.get_checkpoint_state(backup_dir)
        return
    except (tf.errors.OpError, ValueError) as e:
        why = type(e).__name__
    print(
        f"keras-sync: the checkpoint state file {path} is damaged ({why}); removed, the backups are found by "
        "their own files",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(OSError):
        os.unlink(path)


def random_states(model: Any) -> list[Any]:
    """The model's variables that are not its weights: the states of its random-seed generators
    (``Dropout``, ``GaussianNoise``, ``RandomFlip``...: ``seed_generator_state``).

    A checkpoint of ``model`` does not reach them (a Keras `SeedGenerator` is not a TensorFlow
    trackable), so without them a resumed run draws other dropout masks than the run it
    continues.
    """
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


@contextlib.contextmanager
def resumable_fit(callbacks: list[Any]) -> Iterator[None]:
    """Run one `model.fit` with Keras' epoch iterator replaced by one that can resume mid-epoch.

    A no-op unless ``callbacks`` holds a `BackupAndRestore`. Keras 3 `fit` builds its iterator
    from the module global ``TFEpochIterator``; it is swapped for the length of the call only.
    """
    backup = next((c for c in callbacks if isinstance(c, BackupAndRestore)), None)
    if backup is None:
        yield
        return
    from keras_sync.upstream.epoch_iterator import resumable_epoch_iterators

    def made(iterator: Any) -> None:
        # fit builds its training iterator first, then validation's
        if backup.epoch_iterator is None:
            backup.epoch_iterator = iterator

    try:
        with resumable_epoch_iterators(made):
            yield
    finally:
        backup.epoch_iterator = None
        backup.release()
        # a fit that raised: SIGTERM and SIGINT get their previous meaning back
        if backup._preemption is not None:
            backup._preemption.end(clean=False)


def refuse_keras_backup(backup_dir: str | None, callbacks: Any, method: str = "fit") -> None:
    """Refuse Keras's own `BackupAndRestore` beside keras-sync's (``fault_tolerance.backup_dir``).

    Both would restore after a relaunch, Keras's after keras-sync's: Keras's weights and optimizer
    (its last epoch end) with keras-sync's data position (mid-epoch), a run that matches neither
    (and a false "resumed" line).
    """
    if not backup_dir:
        return
    theirs = next(
        (cb for cb in callbacks or () if isinstance(cb, keras.callbacks.BackupAndRestore)), None
    )
    if theirs is None:
        return
    raise UsageError(
        f"callbacks of sync.{method}: keras.callbacks.BackupAndRestore({getattr(theirs, 'backup_dir', '?')!r}) cannot "
        f"run beside keras-sync's own backup (fault_tolerance.backup_dir: {backup_dir!r}): after a relaunch both "
        "would restore, Keras's state over keras-sync's, and training would continue from neither. Fix: remove "
        "keras.callbacks.BackupAndRestore from callbacks (keras-sync's backup resumes mid-epoch exactly), or remove "
        "fault_tolerance.backup_dir to keep Keras's."
    )


def backup_callbacks(sync: Any, *, shared: Any = None) -> list[Any]:
    """The backup callback the config asks for (``fault_tolerance.backup_dir``), or none."""
    ft = sync.config.fault_tolerance
    if not ft.backup_dir:
        return []
    # Before any MLflow run is opened: the directory's owner, and the checkpoint a resume would use.
    choice = _backup_files.choose(ft.backup_dir)
    lock = _claim(sync, ft.backup_dir)
    _backup_files.remember(ft.backup_dir, choice)
    writer = None
    if sync.config.mlflow.enabled:
        from keras_sync.training.job_run import record_run, writer_for

        writer = writer_for(sync)
    backup = BackupAndRestore(
        ft.backup_dir, ft.save_freq, grace_period_s=ft.grace_period_s, writer=writer, shared=shared
    )
    backup.choice, backup.lock = choice, lock
    # the run goes with every backup: a relaunch that restores it continues that run
    if writer is not None:
        backup.before_save.append(lambda: record_run(writer, ft.backup_dir))
    return [backup]


def _claim(sync: Any, backup_dir: str) -> Any:
    """The chief locks ``backup_dir`` for this fit; every other worker checks that its own job holds it.

    A live lock of another job ends this one before training, in one line naming that job.
    """
    import json
    import socket

    resolver = getattr(sync.strategy, "cluster_resolver", None)
    cluster = None
    if resolver is not None and sync.num_workers > 1:
        cluster = json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True)
    me = _backup_files.Holder(sync.config.mlflow.job_id, socket.gethostname(), os.getpid(), cluster)
    if not sync.is_chief:
        other = _backup_files.live_other(_backup_files.read_lock(backup_dir), me, chief=False)
        if other is not None:
            raise _backup_files.refused(backup_dir, other)
        return None
    lock = _backup_files.BackupLock(backup_dir, me)
    lock.acquire()
    return lock
