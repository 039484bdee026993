"""Keep stdout clean for ``--json`` output.

Ray prints task-retry notices and actor logs on the driver's stdout, some of them from C++, so a
benchmark or job that promises one JSON object on stdout sends everything else to stderr at the
file descriptor level while it runs, then prints its JSON on the real stdout. ``json_text``
writes that object as strict JSON: a figure that is not a number (NaN before anything was
measured, an infinite ratio) is ``null``, which every JSON reader accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


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


def json_main(args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict]) -> int:
    """Run a benchmark's ``measure(args)`` with stdout kept for its JSON result (``--json``),
    shut Ray down inside the redirect (its exit notices go to stderr too), then print the
    JSON; returns the exit status, 0."""
    import ray

    with stdout_to_stderr(args.json):
        out = measure(args)
        ray.shutdown()
    print(json.dumps(out))
    return 0


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """``value`` as strict JSON on one line: non-finite floats become ``null``."""
    return json.dumps(_finite(value), allow_nan=False)
