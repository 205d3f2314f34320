"""The courier's entry point: ``python -m keras_sync.tracking.courier_main SPOOL_DIR PARENT_PID``.

A module of its own: ``keras_sync.tracking`` imports `keras_sync.tracking.courier`, which run
with ``-m`` itself would be imported twice (a RuntimeWarning on every fit's stderr).
"""

import sys

from keras_sync.tracking.courier import main

if __name__ == "__main__":
    sys.exit(main(sys.argv))
