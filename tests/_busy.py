"""CPU-bound processes beside a test (as a user's input pipeline or another job would be).

Each loop ends with the test's process: when pytest is killed (a timeout of the whole run), its
`finally` does not run, and loops that outlived it held both cores for an hour once.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

# Polls its parent: when the test process dies, the loop's parent changes and the loop ends.
_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


@contextlib.contextmanager
def busy_loops(n: int = 2) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy loops for the block; killed after it, and ending by themselves if the test dies."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
