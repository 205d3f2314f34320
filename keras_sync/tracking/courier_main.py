"""The courier's entry point: ``python -m keras_sync.tracking.courier_main SPOOL_DIR PARENT_PID``.

A module of its own because ``keras_sync.tracking`` imports `keras_sync.tracking.courier`: run
with ``-m`` itself, that module would be imported twice and Python would warn about it
(``RuntimeWarning: 'keras_sync.tracking.courier' found in sys.modules``) on every fit's stderr.
"""

import sys

from keras_sync.tracking.courier import main

if __name__ == "__main__":
    sys.exit(main(sys.argv))
