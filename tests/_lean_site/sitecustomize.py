"""Test processes only (tests/conftest.py puts this folder first on PYTHONPATH): no scikit-learn.

Keras imports scikit-learn (and with it SciPy) at start-up when it is installed, for its optional
`keras.wrappers` (MLflow's full install brings it); keras-sync never uses those wrappers. That import
costs ~1.3 CPU-s of the ~6 CPU-s each TensorFlow process here spends starting, and the suite starts
a few hundred. `None` in `sys.modules` makes `import sklearn` raise ImportError, which Keras treats
as "not installed". A test that needed scikit-learn would fail loudly with that ImportError.
"""

import sys

sys.modules.setdefault("sklearn", None)
