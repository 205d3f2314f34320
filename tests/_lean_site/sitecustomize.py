"""Test processes only (tests/conftest.py puts this folder first on PYTHONPATH): Keras starts without
scikit-learn, pandas and matplotlib.

Keras imports scikit-learn (and with it SciPy) at start-up when it is installed, for its optional
`keras.wrappers` (MLflow's full install brings it); keras-sync never uses those wrappers. That import
costs ~1.3 CPU-s of the ~6 CPU-s each TensorFlow process here spends starting, and the suite starts
a few hundred. `None` in `sys.modules` makes `import sklearn` raise ImportError, which Keras treats
as "not installed". A test that needed scikit-learn would fail loudly with that ImportError.

Keras also imports pandas (its array adapter accepts DataFrames) and matplotlib (image and box
gallery helpers) at start-up, each in a `try: ... except ImportError`: ~0.5 + ~0.3 CPU-s per process
(pandas 3 with pyarrow). keras-sync uses neither through Keras (its report draws with matplotlib's
object API in the courier, and no test feeds Keras a DataFrame). `_NotForKeras` makes those two
import statements, and only those, raise ImportError: every other importer (MLflow, keras-sync, a test)
gets the real package. A test that fed Keras a DataFrame would fail loudly (Keras: unknown data type).
"""

import os
import sys

sys.modules.setdefault("sklearn", None)

#: The Keras packages whose imports of pandas and matplotlib are refused (see the docstring): the
#: array adapter (`import pandas`) and the image/bounding-box galleries (`matplotlib.pyplot`, `patches`).
_KERAS_IMPORTERS = {
    "keras.src.trainers.data_adapters.": "pandas",
    "keras.src.visualization.": "matplotlib",
}


class _NotForKeras:
    """A meta path finder: ImportError for pandas/matplotlib when the importing module is in `_KERAS_IMPORTERS`."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in ("pandas", "matplotlib"):
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back  # the import machinery's own frames
        importer = (frame.f_globals.get("__name__") or "") if frame is not None else ""
        if any(
            importer.startswith(prefix) and top == refused
            for prefix, refused in _KERAS_IMPORTERS.items()
        ):
            raise ModuleNotFoundError(
                f"{name} is left out for Keras in keras-sync's test processes "
                "(tests/_lean_site/sitecustomize.py)",
                name=name,
            )
        return None


sys.meta_path.insert(0, _NotForKeras())

# KERAS_SYNC_TEST_PROCS=FILE: every process appends "<cpu s> <tf> <argv>" at exit (which processes the
# suite starts and what each costs; `tf` = 1 when it imported TensorFlow).
if os.environ.get("KERAS_SYNC_TEST_PROCS"):
    import atexit as _atexit

    def _log_process() -> None:
        import resource

        u = resource.getrusage(resource.RUSAGE_SELF)
        line = (
            f"{u.ru_utime + u.ru_stime:.1f} {int('tensorflow' in sys.modules)} {os.getpid()} "
            f"{os.getcwd()[-40:]} {' '.join(sys.argv)[:200]}\n"
        )
        with open(os.environ["KERAS_SYNC_TEST_PROCS"], "a") as fh:
            fh.write(line)

    _atexit.register(_log_process)

# KERAS_SYNC_TEST_ZYGOTE (set by tests/conftest.py): a script that names keras or tensorflow runs in a child
# of a process that has imported both already (_zygote.py's docstring); this call does not return then.
if os.environ.get("KERAS_SYNC_TEST_ZYGOTE"):
    import _zygote

    _zygote.delegate()
