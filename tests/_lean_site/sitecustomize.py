"""Test processes only (tests/conftest.py puts this folder first on PYTHONPATH): no scikit-learn.

Keras imports scikit-learn (and with it SciPy) at start-up when it is installed, for its optional
`keras.wrappers` (MLflow's full install brings it); keras-sync never uses those wrappers. That import
costs ~1.3 CPU-s of the ~6 CPU-s each TensorFlow process here spends starting, and the suite starts
a few hundred. `None` in `sys.modules` makes `import sklearn` raise ImportError, which Keras treats
as "not installed". A test that needed scikit-learn would fail loudly with that ImportError.
"""

import os
import sys

sys.modules.setdefault("sklearn", None)

# KERAS_SYNC_TEST_PROCS=FILE: every process appends "<cpu s> <tf> <argv>" at exit (which processes the
# suite starts and what each costs; `tf` = 1 when it imported TensorFlow).
if os.environ.get("KERAS_SYNC_TEST_PROCS"):
    import atexit as _atexit

    def _log_process() -> None:
        import resource

        u = resource.getrusage(resource.RUSAGE_SELF)
        line = (f"{u.ru_utime + u.ru_stime:.1f} {int('tensorflow' in sys.modules)} {os.getpid()} "
                f"{os.getcwd()[-40:]} {' '.join(sys.argv)[:200]}\n")
        with open(os.environ["KERAS_SYNC_TEST_PROCS"], "a") as fh:
            fh.write(line)

    _atexit.register(_log_process)
