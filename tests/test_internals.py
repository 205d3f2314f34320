"""The registry of private Keras/TensorFlow/MLflow internals: every probe holds on this stack, and a
moved internal ends in a one-line refusal (the versions, what is missing, what to do)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_sync.errors import CompatibilityError, KerasSyncError
from keras_sync.upstream import internals as _internals


@pytest.fixture(autouse=True)
def _fresh_probes():
    # The probes run once per process; these tests move internals, so each probes afresh.
    _internals.check.cache_clear()
    yield
    _internals.check.cache_clear()


@pytest.mark.compat
def test_every_required_probe_holds_on_the_installed_stack():
    results = {i.name: (i.refused is None, _internals.check(i)) for i in _internals.REGISTRY}
    print(
        {name: missing for name, (_, missing) in results.items() if missing}
    )  # fallbacks taken here
    expected = {
        i.name for i in _internals.REGISTRY if _internals.predates(i)
    }  # newer than this stack
    failed = {
        name: missing
        for name, (fallback, missing) in results.items()
        if missing and not fallback and name not in expected
    }
    assert not failed, failed


@pytest.mark.compat
def test_the_end_of_data_fix_applies_to_the_installed_keras():
    # Keras 3.10-3.15 run a step past the end of an unknown-length dataset (keras-team/keras#23179);
    # the fix must take on every Keras the ranges allow, or that silent extra step is back.
    from keras_sync.upstream import keras_fixes as _keras_compat
    from keras_sync.upstream.patching import patched

    assert _internals.available(_internals.END_OF_DATA)
    patches = _keras_compat.end_of_data_patches()
    assert [name for _, name, _ in patches] == ["_make_function"]
    with patched(patches):  # as in sync.fit; the probe reads Keras's code through the wrapper
        assert _internals.available(_internals.END_OF_DATA)


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # how an unknown length ends
def test_the_end_of_data_check_is_decided_at_each_call_of_a_cached_train_function():
    # Keras stops at the end of known-length data by itself, so the check is skipped there; the
    # train function that fit caches must still check when a later fit trains on unknown length.
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_sync.upstream.keras_fixes import _end_known, fixed_keras

    x, y = np.ones((64, 2), "float32"), np.ones((64, 1), "float32")
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    spec = (tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    unknown = tf.data.Dataset.from_generator(
        lambda: ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)), output_signature=spec
    )
    assert _end_known(known) and _end_known(x) and _end_known({"a": x})
    assert _end_known(known.repeat()) and not _end_known(unknown)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    strategy = tf.distribute.get_strategy()
    steps = []
    for data in (known, unknown, x):
        with fixed_keras(strategy, data):
            model.fit(
                data, y if data is x else None, batch_size=16, epochs=2, shuffle=False, verbose=0
            )
        steps.append(int(model.optimizer.iterations.numpy()))
    assert steps == [8, 16, 24]  # 4 batches per epoch; Keras alone makes the second 18


def test_an_internal_newer_than_the_installed_library_refuses_its_feature_with_the_floor(
    monkeypatch,
):
    import keras
    import tensorflow as tf

    newer = _internals.Internal(
        "multi_worker_steps_per_execution",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer has no_such_attribute",
        refused="steps_per_execution > 1 on several workers",
        alternative="or set runtime.steps_per_execution: 1",
        since="99.1",
    )
    monkeypatch.setattr(_internals, "REGISTRY", [newer])
    assert _internals.predates(newer)
    with pytest.raises(CompatibilityError) as e:
        _internals.require("multi_worker_steps_per_execution")
    assert str(e.value) == (
        f"steps_per_execution > 1 on several workers cannot work with Keras "
        f"{keras.__version__}, TensorFlow {tf.__version__}: `keras.src.backend.tensorflow.trainer:"
        "TensorFlowTrainer` has no ['no_such_attribute']. "
        'Fix: pip install "keras>=99.1,<3.16", or set runtime.steps_per_execution: 1.'
    )


def test_each_feature_is_one_entry_that_refuses_only_when_its_internals_moved():
    names = [i.name for i in _internals.REGISTRY]
    assert len(names) == len(set(names))  # one entry per feature or fallback
    assert {i.library for i in _internals.REGISTRY} <= set(_internals.RANGES)
    features = [i.name for i in _internals.REGISTRY if i.refused is not None]
    assert {"multi_worker_fit", "exact_resume", "model_strategy"} <= set(features)
    for feature in features:
        entry = next(i for i in _internals.REGISTRY if i.name == feature)
        if _internals.missing(feature) is not None and _internals.predates(entry):
            # a feature of a newer Keras than this one
            with pytest.raises(CompatibilityError, match=f'"keras>={entry.since},'):
                _internals.require(feature)
        else:
            _internals.require(feature)  # all present here: no refusal


def test_a_probe_can_fail():
    # The probes are not vacuous: each kind reports a shape that does not match.
    def fails(*specs):
        return _internals.check(_internals.Internal("test", *specs))

    assert "takes" in fails("json:dumps(not_obj)")
    assert "no longer uses" in fails("json:dumps uses no_such_name")
    assert "has no" in fails("json has no_such_attr")
    assert "has no" in fails("json has dumps", lambda: "has no x")
    assert fails("json:nope has x").startswith("`json:nope` is gone (AttributeError")


def _one_line(message: str) -> str:
    assert "\n" not in message
    return message


def test_moved_keras_internal_refuses_multi_worker_fit_in_one_line(monkeypatch):
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    monkeypatch.delattr(trainer, "reduce_per_replica")
    with pytest.raises(CompatibilityError) as info:
        _internals.require("multi_worker_fit")
    assert isinstance(info.value, KerasSyncError)
    assert _one_line(str(info.value)) == (
        f"`fit` on several workers cannot work with Keras {keras.__version__}, "
        f"TensorFlow {tf.__version__}: `keras.src.backend.tensorflow.trainer:reduce_per_replica` is gone "
        "(AttributeError: module 'keras.src.backend.tensorflow.trainer' has no attribute 'reduce_per_replica'). "
        'Fix: pip install "keras>=3.10,<3.16", or train on one worker (strategy.kind: mirrored).'
    )


def test_backup_guard_refuses_a_keras_without_the_hooks_it_relies_on(monkeypatch, tmp_path):
    import keras
    from keras.src.callbacks import backup_and_restore

    from keras_sync.upstream.backup_and_restore import non_chief_backup

    cb = keras.callbacks.BackupAndRestore(str(tmp_path))
    monkeypatch.delattr(backup_and_restore.BackupAndRestore, "_save_model")
    with pytest.raises(
        CompatibilityError,
        match=r"Keras's BackupAndRestore on several workers cannot work with Keras .* has no "
        r"\['_save_model'\].* Fix: pip install .*, or use keras-sync's backup \(fault_tolerance",
    ):
        non_chief_backup(cb)


def test_changed_signature_is_named(monkeypatch):
    from keras.src.backend.tensorflow import trainer

    monkeypatch.setattr(
        trainer.TensorFlowTrainer, "_maybe_symbolic_build", lambda self, data_batch=None: None
    )
    with pytest.raises(
        CompatibilityError,
        match=re.escape(
            "`keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build` takes "
            "['self', 'data_batch'], not ['self', 'iterator', 'data_batch']"
        ),
    ):
        _internals.require("multi_worker_fit")


def test_fit_that_no_longer_uses_the_swapped_iterator_refuses_exact_resume(monkeypatch):
    from keras.src.backend.tensorflow import trainer

    def fit(self, *args, **kwargs):  # a Keras whose fit builds its iterator some other way
        return None

    monkeypatch.setattr(trainer.TensorFlowTrainer, "fit", fit)
    with pytest.raises(
        CompatibilityError,
        match=r"^exact mid-epoch resume cannot .*"
        r"`keras.src.backend.tensorflow.trainer:TensorFlowTrainer.fit` no longer uses "
        r"\['TFEpochIterator', '_initial_epoch'\].* or remove fault_tolerance.backup_dir\.$",
    ):
        _internals.require("exact_resume")


def test_moved_fallback_internal_refuses_nothing(monkeypatch):
    from tensorflow.python.eager import context

    from keras_sync.upstream.tf_runtime import global_seed_set

    monkeypatch.delattr(context, "global_seed")
    entry = next(i for i in _internals.REGISTRY if i.name == _internals.GLOBAL_SEED)
    assert entry.refused is None and _internals.check(entry) is not None
    assert global_seed_set() is False  # the public path takes over
    _internals.require("exact_resume")


def test_registry_imports_nothing_heavy():
    code = (
        "import sys, keras_sync.upstream.internals; "
        "heavy = [m for m in ('tensorflow', 'keras', 'mlflow') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_supported_ranges_are_the_ones_pyproject_declares():
    # The refusals' fixes and the tested-versions text come from _internals.RANGES: one place.
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for library, (floor, _, ceiling) in _internals.RANGES.items():
        wanted = "tensorflow-cpu" if library == "tensorflow" else library
        assert f'"{wanted}>={floor},<{ceiling}"' in text, (library, floor, ceiling)


def test_the_ranges_cap_at_the_next_major_version_unless_a_break_is_written_beside_it():
    # A plugin must not downgrade its user's stack: `mlflow<3.18` turned a project's mlflow-skinny
    # 3.18.0 into 3.17.2. A cap below the next major version is allowed only with a known break in
    # a comment on its line.
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for lib in ("keras", "mlflow", "tensorflow-cpu", "tensorflow", r"tensorflow\[and-cuda\]"):
        for line in re.findall(rf'^.*"{lib}>=[^"]*".*$', text, flags=re.M):
            cap = re.search(r"<([0-9.]+)", line).group(1)
            assert cap.isdigit() or "break" in line, line  # "<4", or "<3.18  # break: ..."
    for library, (_, newest, ceiling) in _internals.RANGES.items():
        assert ceiling.isdigit() and int(ceiling) == int(newest.split(".")[0]) + 1, (
            library,
            ceiling,
        )
    # The refusals' fix still pins the newest tested release, not the open range.
    assert _internals._pin("keras") == 'pip install "keras>=3.10,<3.16"'


def test_the_newest_ci_lane_installs_unpinned_releases_and_records_them():
    root = Path(__file__).resolve().parents[1]
    run = (root / ".ci" / "run").read_text()
    newest = re.search(r"compat_lane install newest [^\n]*\\\n([^>]*)>", run).group(1).split()
    assert newest == ["tensorflow", "keras", "mlflow"], newest
    lane = (root / ".ci" / "compat_lane").read_text()
    assert (
        'say "installed in' in lane and "$(stack" in lane
    )  # the log line names the versions it got


# Private names of the standard library, documented there: not a Keras/TF/MLflow internal.
_STDLIB_PRIVATE = {
    "_exit": "os._exit",
    "_getframe": "sys._getframe",
    "_run_exitfuncs": "atexit._run_exitfuncs (run the exit handlers before os._exit)",
}


def _private_uses(package: Path) -> dict[str, list[str]]:
    """Private attributes the package reads or sets on objects that are not its own: ``x._name`` with
    ``x`` not self/cls, and ``getattr/hasattr/setattr(x, "_name")``, for names keras-sync does not
    define itself (its functions, classes, module globals, imports and ``self._...`` attributes)."""
    import ast

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    trees = {p: ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    own: set[str] = set()
    for tree in trees.values():
        for node in tree.body:
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Name):
                    own.add(target.id)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.ClassDef):
                pass
            elif isinstance(node, ast.alias):
                own.add((node.asname or node.name).split(".")[-1])
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(target, ast.Name):
                        own.add(target.id)
    uses: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name = None
            if (
                isinstance(node, ast.Attribute)
                and private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and private(node.args[1].value)
            ):
                name = node.args[1].value
            if name is not None and name not in own:
                uses.setdefault(name, []).append(
                    f"{path.relative_to(package.parent)}:{node.lineno}"
                )
    return uses


def test_every_private_attribute_the_package_uses_is_listed_with_a_probe():
    # `model._initial_epoch` was used by the backup and listed nowhere: a release that renamed it
    # would have resumed at the wrong epoch with no word. Each use must be named by a probed entry.
    import keras_sync

    package = Path(keras_sync.__file__).resolve().parent  # the whole package, every subpackage
    uses = _private_uses(package)
    assert "_initial_epoch" in uses and "_distribute_strategy" in uses  # the scan finds real uses
    listed = {  # the private attributes the entries' specs name
        a
        for i in _internals.REGISTRY
        for s in i.specs
        if isinstance(s, str)
        for a in re.findall(r"\b_[a-z]\w*", s)
    }
    unlisted = {
        name: where
        for name, where in uses.items()
        if name not in listed and name not in _STDLIB_PRIVATE
    }
    assert not unlisted, (
        f"private attributes used but not in keras_sync/upstream/internals.py REGISTRY attrs: {unlisted}"
    )


def test_private_attributes_are_read_only_inside_upstream():
    # test_import_graph sees imports, not `obj._attr`: outside upstream/, a private attribute goes
    # through an accessor there, beside its probe.
    import keras_sync

    package = Path(keras_sync.__file__).resolve().parent
    outside = {
        name: [w for w in where if not w.startswith("keras_sync/upstream/")]
        for name, where in _private_uses(package).items()
        if name not in _STDLIB_PRIVATE
    }
    assert {name: where for name, where in outside.items() if where} == {}


def test_the_private_attribute_scan_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "def f(model):\n    return model._made_up_private + getattr(model, '_another')\n"
    )
    assert set(_private_uses(pkg)) == {"_made_up_private", "_another"}
