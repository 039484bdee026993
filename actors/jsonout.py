"""Keep stdout clean for ``--json`` output.

Ray prints task-retry notices and actor logs on the driver's stdout, some of them from C++, so a
benchmark that promises one JSON object on stdout sends everything else to stderr at the file
descriptor level while it runs, then prints its JSON on the real stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """While active, file descriptor 1 points at stderr (Python and native writes alike)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
