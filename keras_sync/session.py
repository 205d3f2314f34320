"""`keras_sync.load()` and `Sync`: the strategy, the scaled batch and learning rate, and a drop-in `fit`."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from keras_sync.cluster import read_cluster, strategy_role
from keras_sync.config import Config, load_config
from keras_sync.config.kinds import KINDS
from keras_sync.errors import KerasSyncError, UsageError
from keras_sync.training import scaling
from keras_sync.upstream.strategy_facts import built_under, in_multi_worker_mode


def load(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> Sync:
    """Read the config, build the distribution strategy and scale batch size and learning rate.

    Call it before any other TensorFlow work: simulated CPU replicas and the multi-worker cluster
    can only be set up before TensorFlow initialises.

    Args:
        config: path to a YAML file, a dict of the same shape, a `Config`, or None
            (then ``$KERAS_SYNC_CONFIG``, else ``./keras_sync.yaml`` if present, else defaults).
        overrides: dotted keys that win over the file, e.g. ``{"batch.per_replica": 64}``.

    Example:
        >>> sync = keras_sync.load("keras_sync.yaml")              # doctest: +SKIP
        >>> with sync.scope():                                     # doctest: +SKIP
        ...     model = make_model()
        ...     model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
        >>> sync.fit(model, x, y, epochs=3)                        # doctest: +SKIP
    """
    cfg = config if isinstance(config, Config) else load_config(config, overrides=overrides)
    from keras_sync.strategy import ONE_PROCESS_KINDS, build_strategy, check_one_process, detect
    from keras_sync.training import paths, runtime
    from keras_sync.upstream import stack

    stack.check_backend()  # KERAS_BACKEND=jax/torch: one line here, not a false scope error at fit
    check_one_process(cfg)  # `mirrored` under a TF_CONFIG of 2 workers, refused before TensorFlow
    kind = detect(cfg).kind
    one_process = kind in ONE_PROCESS_KINDS  # surely the chief
    if one_process:
        paths.check_config_paths(cfg, is_chief=True)  # before TensorFlow starts
    _say_first_line(cfg, kind)
    early_writer = None
    if cfg.mlflow.enabled and one_process:
        from keras_sync.training.job_run import start_writer

        early_writer = start_writer(cfg)  # its courier imports MLflow while TensorFlow imports
    try:
        strategy, detection = build_strategy(cfg)
        if in_multi_worker_mode(strategy):  # fit/evaluate/predict called alone: one line
            from keras_sync.cluster import collective_calls

            collective_calls.configure(strategy, cfg.strategy.connect_timeout_s)
        sync = Sync(cfg, strategy, detection)
        if not one_process:
            paths.check_config_paths(cfg, is_chief=sync.is_chief)
        if sync.is_chief and cfg.mlflow.enabled:  # the run is made at the first log
            sync.job_run.writer(early=True, started=early_writer)
            early_writer = None
    finally:
        if early_writer is not None:  # the build failed: no empty spool folder left
            early_writer.close()
            with contextlib.suppress(OSError):  # not empty (other runs' spools), or gone
                os.rmdir(os.path.dirname(os.path.abspath(early_writer.spool_path)))
    runtime.set_dtype_policy(cfg)  # before the user builds the model
    if cfg.verify is not None:  # `keras-sync verify`: the same weights and data on both runs
        from keras_sync.training.verify_record import seed_everything

        seed_everything()
    stack.check_backend()  # what the imported Keras really uses (a keras.json the rule misread)
    return sync


def _say_first_line(cfg: Config, kind: str) -> None:
    """On the chief: the config and what TensorFlow's seconds-long start is spent on."""
    try:
        info = read_cluster(cfg.strategy)[0]
    except KerasSyncError:  # building the strategy says what is wrong
        info = None
    if info is not None and not info.is_chief:
        return
    what = f"starting TensorFlow and the {kind} strategy"
    workers = info.num_workers if info is not None and KINDS[kind].multi_process else 0
    if workers > 1:
        what += f", then waiting for its {workers} workers to join (at most {cfg.strategy.connect_timeout_s:g} s)"
    print(f"keras-sync: config: {cfg.origin()}; {what}", file=sys.stderr, flush=True)


class Sync:
    """A configured distributed-training session: strategy, batch sizes, learning rate, `fit`.

    Build it with `keras_sync.load`. Attributes: ``config``, ``strategy``, ``kind`` (the kind
    built, after `auto`), ``num_replicas``, ``num_workers``, ``is_chief``,
    ``per_replica_batch_size``, ``global_batch_size``, ``gradient_accumulation_steps``,
    ``effective_batch_size`` (examples per optimizer update), ``base_learning_rate``,
    ``learning_rate`` (the scaled peak, for the effective batch), ``input_facts`` (what the input
    pipeline did with the last `fit`'s data: `keras_sync.training.pipeline.InputFacts`, None before).
    """

    def __init__(self, config: Config, strategy: Any, detection: Any):
        from keras_sync.training.job_run import JobRun

        self.config, self.strategy, self.kind = config, strategy, detection.kind
        self.num_replicas: int = int(strategy.num_replicas_in_sync)
        role = strategy_role(strategy)
        self.num_workers, self.is_chief = role.num_workers, role.is_chief
        self.task = (role.task_type, role.task_id)
        self.per_replica_batch_size, self.global_batch_size = scaling.resolve_batch_sizes(
            config.batch.per_replica, config.batch.global_, self.num_replicas
        )
        self.gradient_accumulation_steps: int = config.runtime.gradient_accumulation_steps
        self.effective_batch_size: int = self.global_batch_size * self.gradient_accumulation_steps
        lr = config.learning_rate
        self.base_learning_rate = lr.base
        self.base_batch_size = lr.base_batch_size or self.per_replica_batch_size
        self.learning_rate = scaling.scale_learning_rate(
            lr.base,
            global_batch_size=self.effective_batch_size,
            base_batch_size=self.base_batch_size,
            rule=lr.scaling,
        )
        self._schedules: list[Any] = []  # warmups in epochs, waiting for fit's steps per epoch
        self._steps_per_epoch: int | None = None
        self.input_facts: Any = None
        self.job_run = JobRun(config, self.is_chief)  # the writer (chief) and the fits' state

    def __repr__(self) -> str:
        return (
            f"Sync(kind={self.kind!r}, replicas={self.num_replicas}, workers={self.num_workers}, "
            f"per_replica_batch={self.per_replica_batch_size}, global_batch={self.global_batch_size}, "
            f"learning_rate={self.learning_rate:g})"
        )

    def warmup_steps(self, steps_per_epoch: int | None = None) -> int:
        """The warmup length in optimizer steps (0 when there is no warmup)."""
        lr = self.config.learning_rate
        return scaling.warmup_steps_from(
            warmup_steps=lr.warmup_steps,
            warmup_epochs=lr.warmup_epochs,
            steps_per_epoch=steps_per_epoch or self._steps_per_epoch,
        )

    def lr_schedule(self, steps_per_epoch: int | None = None, *, after: Any = None) -> Any:
        """The optimizer's learning rate: the scaled peak, or a `GradualWarmup` from the base rate to
        it (a warmup in epochs gets its length from `fit` unless ``steps_per_epoch`` is given).
        ``after``: a `LearningRateSchedule` that takes over after the warmup (returned without one)."""
        lr = self.config.learning_rate
        if not lr.warmup_steps and not lr.warmup_epochs:
            return self.learning_rate if after is None else after
        from keras_sync.training.schedules import GradualWarmup

        steps_known = steps_per_epoch or self._steps_per_epoch
        warmup = self.warmup_steps(steps_known) if (lr.warmup_steps or steps_known) else 1
        sched = GradualWarmup(self.base_learning_rate, self.learning_rate, warmup, after=after)
        if lr.warmup_epochs and not steps_known:  # fit sets its steps once it knows the epoch's
            self._schedules.append(sched)
        return sched

    def scope(self) -> Any:
        """The strategy's scope: build and compile the model inside it. A plain ``model.fit`` of a
        model compiled in it says once that it trains without keras-sync."""
        from keras_sync.training.run_checks import scope_guarding_fit

        writer = self.job_run.writer if self.config.mlflow.enabled else lambda: None
        return scope_guarding_fit(self.strategy, self.context(), writer)

    def distribute(self, data: Any, *, shuffle: bool = False, seed: int = 1337) -> Any:
        """A `tf.data.Dataset` batched by the global batch, split across workers.

        Args:
            data: a numpy array, a tuple/dict of arrays (``(x, y)``), or an unbatched
                `tf.data.Dataset` of single examples (its own shard policy, else
                ``batch.shard_policy``).
            shuffle: shuffle the examples each epoch, in one order on every worker.
            seed: the shuffle's seed.
        """
        ds, steps = self._pipeline().distribute(data, shuffle=shuffle, seed=seed)
        self._steps_per_epoch = steps or self._steps_per_epoch
        return ds

    def _pipeline(self) -> Any:
        from keras_sync.training import verify_record
        from keras_sync.training.pipeline import InputPipeline

        drop, kind = self.config.batch.drop_remainder, KINDS[self.kind]
        return InputPipeline(
            global_batch=self.global_batch_size,
            num_replicas=self.num_replicas,
            num_workers=self.num_workers,
            is_chief=self.is_chief,
            drop_remainder=kind.drop_remainder if drop == "auto" else bool(drop),
            shard_policy=self.config.batch.shard_policy,
            multi_worker=kind.multi_process,
            replay_order=bool(self.config.fault_tolerance.backup_dir),
            strategy=self.strategy,
            arrays_as_dataset=self.config.verify is not None
            and verify_record.arrays_as_dataset(self.config),
        )

    def fit(self, model: Any, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
        """`model.fit` under this strategy: same arguments, same return value (a `History`).

        Arrays and batched datasets are batched by the global batch (``batch_size``, if given, is
        the global batch, as Keras reads it under a strategy; with a scaled learning rate it must
        be the configured one). The MLflow run ends (FINISHED) when fit returns; the next fit of
        this `Sync` continues it.
        """
        from keras_sync.callbacks.backup import resumable_fit
        from keras_sync.cluster.collective_calls import collective
        from keras_sync.cluster.preemption import ctrl_c_ends_fit
        from keras_sync.training import verify_record

        self._ready(model, kwargs.get("callbacks"), "fit")
        given, data = kwargs.get("batch_size"), x  # the global batch, checked by _prepare
        x, y, kwargs = self._prepare(model, "fit", x, y, kwargs)
        # With steps_per_epoch an epoch is that many steps, not one pass over the data.
        steps_given = kwargs.get("steps_per_epoch")
        self._resolve_pending_warmup(steps_given or self.input_facts.steps_per_epoch)
        kwargs["callbacks"] = callbacks = self._fit_callbacks(
            kwargs.get("callbacks"),
            global_batch=given or self.global_batch_size,
            expected=None if steps_given else self.input_facts.examples_per_epoch,
            data=data,
            per_replica_batch_size=given // self.num_replicas if given else None,
        )
        if self.config.verify is not None:  # the recorder last: it reads what the others restored
            source, base = self.input_facts.source, self.base_batch_size
            callbacks.append(
                verify_record.callback(self.context(), input_source=source, base_batch_size=base)
            )
        # Ctrl-C is outermost: every other context has closed before the process exits.
        backup_dir = self.config.fault_tolerance.backup_dir
        with (
            ctrl_c_ends_fit(model, is_chief=self.is_chief, backup_dir=backup_dir),
            self.job_run.shared_run(),  # mlflow.keras.autolog() logs into this run, not its own
            self.job_run.ends_after_fit(),
            self._keras_call(model, x),  # before resumable_fit: its probes read Keras's own classes
            resumable_fit(callbacks),
            warnings.catch_warnings(),
            collective(model, "model.fit"),  # every worker at this fit, or one line
        ):
            if steps_given is None:
                # Data of unknown length ends each epoch by running out: Keras's advice to add
                # .repeat() would break the epoch. With steps_per_epoch it is a real shortfall.
                warnings.filterwarnings("ignore", "Your input ran out of data", UserWarning)
            history = type(model).fit(model, x, y, **kwargs)  # past the scope's direct_fit guard
        self.job_run.end_after_fit()  # with fit, not at exit: Ray Train V2 kills its workers
        if self.config.verify is not None:
            verify_record.end_script()  # all verify needs
        return history

    def context(self, *, per_replica_batch_size: int | None = None) -> Any:
        """The facts of this run for the callbacks, as a frozen `keras_sync.callbacks.RunContext`.

        ``per_replica_batch_size``: this `fit`'s batch when not the configured one. Steps per epoch
        (and a warmup in epochs) are those of the data last given to `fit`/`distribute`.
        """
        from keras_sync.training.context import RunContext

        per_replica = per_replica_batch_size or self.per_replica_batch_size
        try:
            warmup: int | str = self.warmup_steps(self._steps_per_epoch)
        except scaling.ScalingError:  # warmup in epochs, epoch length unknown
            warmup = "unknown"
        same = ("kind", "num_replicas", "num_workers", "is_chief", "gradient_accumulation_steps")
        return RunContext(
            **{n: getattr(self, n) for n in (*same, "base_learning_rate", "learning_rate")},
            per_replica_batch_size=per_replica,
            global_batch_size=per_replica * self.num_replicas,
            effective_batch_size=per_replica * self.num_replicas * self.gradient_accumulation_steps,
            lr_scaling=self.config.learning_rate.scaling,
            warmup_steps=warmup,
            steps_per_epoch=self._steps_per_epoch,
            config=self.config,
        )

    def callbacks(self, model: Any, callbacks: Any = None) -> list[Any]:
        """For a `model.fit` you call yourself: prepare ``model`` as `fit` would and return the
        callbacks `fit` adds, then ``callbacks`` and keras-sync's run-time checks.

        Give the model built and compiled in `scope()` and data batched by `distribute`; keep the
        returned order; end the run with `close()`. Refused with ``fault_tolerance.backup_dir``
        (its exact resume needs `fit`). Keras's fixes apply to `sync.fit`, `evaluate` and `predict`.

        Example:
            >>> model.fit(sync.distribute((x, y)), epochs=3, callbacks=sync.callbacks(model))  # doctest: +SKIP
            >>> sync.close()  # doctest: +SKIP
        """
        backup_dir = self.config.fault_tolerance.backup_dir
        if backup_dir:
            raise UsageError(
                f"Sync.callbacks cannot resume mid-epoch: fault_tolerance.backup_dir is set ({backup_dir!r}). "
                "Fix: call sync.fit(model, ...), or remove backup_dir and pass keras.callbacks.BackupAndRestore."
            )
        self._ready(model, callbacks, "callbacks")
        return self._fit_callbacks(callbacks, global_batch=self.global_batch_size)

    def _fit_callbacks(
        self, callbacks: Any, *, per_replica_batch_size: int | None = None, **kw: Any
    ) -> list[Any]:
        """keras-sync's callbacks around the user's, Keras's writers guarded on other workers."""
        from keras_sync.callbacks import fit_callbacks
        from keras_sync.training import saving

        context = self.context(per_replica_batch_size=per_replica_batch_size)
        out = fit_callbacks(context, callbacks, job_run=self.job_run, strategy=self.strategy, **kw)
        return saving.guard_callbacks(self.strategy, out)

    @property
    def run_id(self) -> str | None:
        """This job's MLflow run id on the chief once MLflow has created the run (at the first
        `fit` or `callbacks`); else None."""
        writer = self.job_run.current
        return writer.run_id if writer is not None else None

    def close(self, timeout_s: float | None = None) -> None:
        """End this job's MLflow run now (FINISHED) and wait for delivery while it makes progress
        (at most ``timeout_s``), as the process's exit would: after a `model.fit` of your own, or
        to have everything in MLflow now. A later `fit` continues the run."""
        self.job_run.close(timeout_s=timeout_s)

    def save(self, model: Any, filepath: str | os.PathLike[str], **kwargs: Any) -> None:
        """Save ``model`` (``.keras``, ``.h5``) or its weights (``*.weights.h5``): call it on every
        worker; only the chief writes ``filepath`` (as ``model.save`` under a multi-worker strategy)."""
        from keras_sync.training import saving

        saving.save(model, filepath, **kwargs)

    def evaluate(self, model: Any, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
        """`model.evaluate` under this strategy, batched as in `fit`; under `multi_worker_mirrored`
        a collective: call it on every worker (a worker calling it alone fails in one line)."""
        x, y, kwargs = self._prepare(model, "evaluate", x, y, kwargs)
        with self._keras_call(model):
            return model.evaluate(x, y, **kwargs)

    def predict(self, model: Any, x: Any = None, **kwargs: Any) -> Any:
        """`model.predict` under this strategy, batched as in `fit`; under `multi_worker_mirrored`
        a collective: call it on every worker, each gets all the predictions (a worker calling it
        alone fails in one line)."""
        x, _, kwargs = self._prepare(model, "predict", x, None, kwargs)
        with self._keras_call(model):
            return model.predict(x, **kwargs)

    @contextlib.contextmanager
    def _keras_call(self, model: Any, train_data: Any = None) -> Iterator[None]:
        """Around Keras's `fit` (of ``train_data``), `evaluate` and `predict`: Keras fixed for this
        strategy, a test step's loss one device's, a lost peer as `PeerLostError`."""
        from keras_sync.cluster.lost_peer import raised_as_peer_lost
        from keras_sync.upstream.keras_fixes import fixed_keras
        from keras_sync.upstream.keras_losses import unscaled_eval_losses

        backup_dir = self.config.fault_tolerance.backup_dir
        with (
            raised_as_peer_lost(self.strategy, backup_dir),
            fixed_keras(self.strategy, train_data),
            unscaled_eval_losses(model) if self.num_replicas > 1 else contextlib.nullcontext(),
        ):
            yield

    def _prepare(
        self, model: Any, method: str, x: Any, y: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any]]:
        """Check ``model`` (`fit`: done by `_ready`) and ``batch_size`` (the global batch, as Keras
        reads it under a strategy), then batch ``x``/``y`` by the global batch."""
        fit = method == "fit"
        if not fit:
            self._check_model(model, method)
            self._for_workers(model)
        kwargs = dict(kwargs)
        if not self.is_chief:  # one progress bar per job, the chief's; warnings still print
            kwargs["verbose"] = 0
        batch_size = kwargs.pop("batch_size", None)
        whole = isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1
        if batch_size is not None and (not whole or (fit and batch_size % self.num_replicas)):
            multiple = f", a multiple of the {self.num_replicas} replicas" if fit else ""
            raise UsageError(
                f"Invalid value for argument `batch_size` of sync.{method}. Received: batch_size={batch_size!r}. "
                f"Expected the global batch size (an integer >= 1{multiple}), or leave it out to use batch.global."
            )
        scaled = self.config.learning_rate.scaling != "none"
        if fit and scaled and batch_size not in (None, self.global_batch_size):
            raise UsageError(
                f"sync.fit(batch_size={batch_size}): the learning rate {self.learning_rate:g} was scaled for the "
                f"configured global batch {self.global_batch_size}. Fix: set batch.global: {batch_size} in the "
                "config, or leave batch_size out."
            )
        pipeline = self._pipeline()
        prepared = pipeline.prepare(method, x, y, kwargs, batch_size or self.global_batch_size)
        if fit:
            self.input_facts = pipeline.facts
        return prepared

    def _ready(self, model: Any, callbacks: Any, method: str) -> None:
        """Refuse in one line what cannot train here, then set the model up as `fit` runs it."""
        from keras_sync.callbacks.backup import refuse_keras_backup
        from keras_sync.training import runtime
        from keras_sync.training.schedules import check_lr_callbacks

        self._check_model(model, method, deep=True)  # first: a Keras 2 model is refused in one line
        refuse_keras_backup(self.config.fault_tolerance.backup_dir, callbacks, method)
        check_lr_callbacks(model, callbacks, method)
        runtime.prepare_model(self.context(), model)  # steps_per_execution, jit_compile, BatchNorm
        self._for_workers(model)

    def _for_workers(self, model: Any) -> None:
        """``model.save``, ModelCheckpoint: the chief writes; fit, evaluate, predict: every worker."""
        from keras_sync.training import saving
        from keras_sync.upstream.keras_fixes import check_steps_per_execution

        check_steps_per_execution(model, self.strategy)
        if self.num_workers > 1:
            saving.for_workers(model)

    def _check_model(self, model: Any, method: str, deep: bool = False) -> None:
        """Refuse a model this strategy cannot run; ``deep``: its variables and optimizers too."""
        import keras

        cls = type(model)
        if not isinstance(model, keras.Model):
            where = f"{cls.__module__}.{cls.__qualname__}"
            keras2 = cls.__module__.split(".")[0] in ("tf_keras", "tensorflow", "keras")
            if keras2 and hasattr(model, "fit"):
                raise UsageError(
                    f"sync.{method} got a Keras 2 model ({where}: tf_keras, or tf.keras with TF_USE_LEGACY_KERAS=1), "
                    f"and keras-sync supports Keras 3 only (keras {keras.__version__} is installed). Fix: build the "
                    "model with `import keras`, and unset TF_USE_LEGACY_KERAS."
                )
            raise UsageError(f"sync.{method}(model, ...) expects a keras.Model. Received: {where}.")
        if not KINDS[self.kind].scoped:
            return
        from keras_sync.upstream import internals as _internals

        _internals.require("model_strategy")  # else every model would look unscoped
        if getattr(cls, "call", None) in (keras.Model.call, keras.layers.Layer.call):
            raise UsageError(  # Keras builds a model under a strategy by calling it
                f"{cls.__name__} has no call() method, and under a distribution strategy Keras builds the model by "
                f"calling it. Fix: define call(self, inputs) in {cls.__name__}, returning the model's output."
            )
        if built_under(model) is not self.strategy:
            raise UsageError(
                f"The model was built outside sync.scope(), so sync.{method} cannot distribute it over "
                f"{self.num_replicas} replicas. Fix: create and compile the model inside `with sync.scope():`."
            )
        if not deep:
            return
        # Layers built outside the scope (Keras fails on "colocate_vars_with") and optimizer options
        # Keras runs in an all-reducing ``ops.cond`` (it fails on "merge_call").
        import tensorflow as tf

        from keras_sync.training.train_step_trace import named_optimizers

        in_scope = self.strategy.extended.variable_created_in_scope
        outside = (
            v.path.rpartition("/")[0] or v.path
            for v in model.variables
            if isinstance(value := getattr(v, "value", v), tf.Variable) and not in_scope(value)
        )
        names = list(dict.fromkeys(outside))  # each layer once, in order
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise UsageError(
                f"sync.{method}: layers of {cls.__name__} were built outside sync.scope() ({shown}), only the "
                f"model was assembled inside: their variables are not the {self.kind} strategy's, and Keras cannot "
                "train them under it. Fix: build the whole model (every layer, from keras.Input on) inside "
                "`with sync.scope():`."
            )
        for opt in named_optimizers(model).values():
            inner = getattr(opt, "inner_optimizer", opt)  # a LossScaleOptimizer's options
            name, steps = type(inner).__name__, getattr(inner, "gradient_accumulation_steps", None)
            fails = f"sync.{method}: the model's optimizer {name}"
            fails_in = f"fails under a {self.kind} strategy in Keras"
            if steps:
                raise UsageError(
                    f"{fails}(gradient_accumulation_steps={steps}) {fails_in}. Fix: remove it from the optimizer "
                    f"and set runtime.gradient_accumulation_steps: {steps} in the keras-sync config (same update, "
                    "on any replica count)."
                )
            if getattr(inner, "use_ema", False):
                raise UsageError(
                    f"{fails}(use_ema=True) {fails_in}. Fix: remove use_ema (and ema_momentum, "
                    "ema_overwrite_frequency) from the optimizer."
                )

    def _resolve_pending_warmup(self, steps: int | None) -> None:
        """Give the warmups in epochs their length, from the ``steps`` of one epoch of this fit."""
        if not self._schedules:
            return
        if not steps:
            raise UsageError(
                "learning_rate.warmup_epochs needs the steps per epoch, which data of unknown size does not "
                "tell. Fix: pass steps_per_epoch to sync.fit, or use learning_rate.warmup_steps."
            )
        self._steps_per_epoch = math.ceil(steps / self.gradient_accumulation_steps)  # updates
        for sched in self._schedules:
            sched.warmup_steps = self.warmup_steps(self._steps_per_epoch)
        self._schedules.clear()
