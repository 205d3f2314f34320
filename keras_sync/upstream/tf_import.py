"""Import TensorFlow without its C++ start-up INFO lines, which TF_CPP_MIN_LOG_LEVEL does not stop.

TensorFlow 2.21 logs through absl before absl is initialised, and such early lines ignore
``TF_CPP_MIN_LOG_LEVEL``. On CPUs with AMX/AVX512-VNNI (where oneDNN is on by default) every
import then prints, twice (two shared libraries)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1796123769.122809    8780 port.cc:153] oneDNN custom operations are on. ...
    I0000 00:00:1796123769.182773    8780 cpu_feature_guard.cc:227] This TensorFlow binary is ...

(measured on TF 2.21.0, Intel Xeon with amx_bf16; the same TF on a CPU without AMX printed
nothing). `import_tensorflow` holds file descriptor 2 while TensorFlow is imported and writes back
every line but those INFO lines and absl's banner, when the log level asks for that (the user's
``TF_CPP_MIN_LOG_LEVEL``, else keras-sync's default 1). Warnings, errors and a failed import's
output are written back as they came.

`quiet_device_datasets` removes the cause of one warning TensorFlow prints on every run over 2+
local devices (Mirrored), later, when `fit` makes its input iterator::

    W0000 00:00:1796302045.168537   24163 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will
    not be optimized because the dataset does not implement the AsGraphDefInternal() method needed
    to apply optimizations.

TensorFlow's `MultiDeviceIterator` feeds each device from a generator dataset (plus a prefetch),
and tf.data tries its default graph rewrites on it, which need a graph the generator cannot give:
nothing is rewritten, and it says so. Those per-device datasets are made with the default rewrites
off, which changes nothing they do; the user's own pipeline, and every other line, is untouched.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

_INFO = re.compile(rb"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.\-]+:\d+\] ")
_BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
#: An INFO line's continuation (cpu_feature_guard's second line): kept with it.
_CONTINUATION = re.compile(rb"^(To enable the following instructions|other operations, rebuild)")


def quiet_lines(raw: bytes) -> bytes:
    """``raw`` without TensorFlow's early INFO lines (and their continuation lines) and absl's banner."""
    out, dropping = [], False
    for line in raw.splitlines(keepends=True):
        bare = line.rstrip(b"\r\n")
        if bare == _BANNER or _INFO.match(bare):
            dropping = True
            continue
        if dropping and _CONTINUATION.match(bare):
            continue
        dropping = False
        out.append(line)
    return b"".join(out)


_QUIET_MARK = "_keras_sync_quiet"


def quiet_device_datasets() -> bool:
    """Build TensorFlow's per-device datasets without the rewrites that cannot apply (and warn).

    Not when TF_CPP_MIN_LOG_LEVEL is 0 (every line asked for), nor when the internal moved
    (`keras_sync.upstream.internals`: then the line shows, nothing else changes). True when in place.
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() in ("", "0"):
        return False
    from keras_sync.upstream import internals as _internals

    name = "tensorflow.python.data.ops.multi_device_iterator_ops:_create_device_dataset"
    if not _internals.available(name):
        return False
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops as m

    original = m._create_device_dataset
    if getattr(original, _QUIET_MARK, False):
        return True

    def _create_device_dataset(*args: object, **kwargs: object) -> object:
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        return original(*args, **kwargs).with_options(options)

    setattr(_create_device_dataset, _QUIET_MARK, True)
    m._create_device_dataset = _create_device_dataset
    return True


def import_tensorflow() -> None:
    """``import tensorflow``, without its start-up INFO lines unless TF_CPP_MIN_LOG_LEVEL is 0."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() in (
        "",
        "0",
    ):
        import tensorflow

        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (embedded interpreter): import as is
        import tensorflow

        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            raw = held.read()
            failed = "tensorflow" not in sys.modules
            text = raw if failed else quiet_lines(raw)
            if text:
                os.write(2, text)
