"""Keep Ray's own chatter off a job's terminal, so that the job's own lines stand out.

Role: a Ray driver prints what its workers write (``log_to_driver``). Ray's libraries write
there too, and on every run: Ray Train's controller announces each worker group, Ray Data
each dataset's execution, the core worker warns about Ray's own actors (Ray Train's
``PreemptionWatcher``, Ray Data's ``MapWorker``) that keep constructor arguments in the object
store, Ray Data warns that Ray Train's own ingest options are deprecated. None of it is about
the user's job and none of it can be changed from here, so ``install_log_filter`` drops those
lines, and only those, before they are printed: ``NOISE`` lists each with why it is harmless.
Ray Train also prints a failed training function's traceback twice, from the worker and from
its controller, before ``trainer.fit()`` raises the same error in the driver: from a process's
``TRAIN_FAILURE`` line on, its lines are dropped, and the job reports the error once (one line
for bad data, the driver's traceback otherwise). Everything else a worker writes (our roles'
lines, a dataset's skipped samples, any other error) still reaches the terminal unchanged.

Colour only on a terminal: when the driver's stderr is not one (a log file, a pipe),
``plain_when_redirected`` turns Ray's colour codes off (Ray's own switch,
``RAY_COLOR_PREFIX=0``) and the filter strips those Ray and libraries add regardless (Ray's
"repeated Nx across cluster" note, a library's coloured warnings).

What can be silenced where it starts is silenced there instead: robosuite's macro-file
warning (``envs.libero.simulator``), Ray Data's execution banner
(``DataContext.print_on_execution_start``), the placement-group cleaner of Ray Train that
asked whichever Ray runs on the host instead of its own (``actors.runtime.bootstrap``).

Invariant: a line is dropped only when one of ``NOISE``'s patterns matches it or its process
began a ``TRAIN_FAILURE`` report (whose error the driver then raises); the patterns name Ray's
components or messages, never a message of this project.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

NOISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"core_worker\.cc:\d+: Actor with class name: '(PreemptionWatcher|MapWorker\()"),
     "Ray Train's preemption watcher and Ray Data's map workers pass constructor arguments "
     "through the object store; Ray warns that it could not restart them, which it never has "
     "to within a job (our own roles are wired by name and never trigger this)"),
    (re.compile(r"RayDeprecationWarning: `ExecutionOptions\.exclude_resources`"
                r"|^\s+self\.exclude_resources = exclude_resources$"),
     "Ray Train sets a Ray Data option that Ray Data itself deprecates (and the source line "
     "the warning quotes)"),
    (re.compile(r"^(Requesting resources: |Attempting to start training worker group |"
                r"Started training worker group of size |- \(ip=\S+, pid=\d+\) world_rank=|"
                r"Setting up process group for: |Reporting training result \d+: )"),
     "Ray Train's controller and workers announcing each step of starting a worker group and "
     "each report: the job prints its own progress"),
    (re.compile(r"^(Progress bars disabled\. To enable|.{0,3}\s*Dataset \S+ execution finished "
                r"in [\d.]+ seconds$)"),
     "Ray Data: the lake turns its progress bars off on purpose; a dataset's end of execution"),
)
"""(pattern, why it is harmless) of every worker line that is not printed."""


TRAIN_FAILURE = re.compile(r"^(Error in training function:|\[FailurePolicy\] RAISE)")
"""Where Ray Train starts printing a failed training function (worker, then controller)."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""A colour or style code."""


def is_noise(line: str) -> bool:
    """Whether a line a worker wrote is one of ``NOISE``."""
    return any(pattern.search(line) for pattern, _ in NOISE)


class LogFilter:
    """What the driver prints of its workers' lines: ``NOISE`` dropped, a process's lines
    dropped from its ``TRAIN_FAILURE`` on, colour codes stripped unless ``colour``."""

    def __init__(self, colour: bool):
        self.colour = colour
        self.failed: set[Any] = set()
        """Processes (pid) that began reporting a failed training function."""

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any] | None:
        """A batch of worker lines (Ray's dict: ``lines``, ``pid``, ``actor_name``, ...) as it
        is printed; None when nothing is left."""
        pid = batch.get("pid")
        lines = []
        for line in batch.get("lines", ()):
            if pid not in self.failed and TRAIN_FAILURE.search(ANSI.sub("", line)):
                self.failed.add(pid)
            if pid in self.failed or is_noise(line):
                continue
            lines.append(line if self.colour else ANSI.sub("", line))
        return {**batch, "lines": lines} if lines else None


def _filtered(handler: Callable[[dict[str, Any]], None],
              keep: LogFilter) -> Callable[[dict[str, Any]], None]:
    def handle(batch: dict[str, Any]) -> None:
        kept = keep(batch)
        if kept is not None:
            handler(kept)

    handle.__wrapped__ = handler  # type: ignore[attr-defined]
    return handle


def install_log_filter() -> bool:
    """Wrap the driver's printer of worker lines (after ``ray.init``) in a ``LogFilter``
    (colour kept when stderr is a terminal); returns whether a printer was found (none when
    ``log_to_driver=False``)."""
    from ray._private import ray_logging

    keep = LogFilter(colour=sys.stderr.isatty())
    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    with dispatcher._lock:
        found = False
        handlers = []
        for name, handler in dispatcher.handlers:
            if name == "ray_print_logs" and not hasattr(handler, "__wrapped__"):
                handler, found = _filtered(handler, keep), True
            handlers.append((name, handler))
        dispatcher.handlers = handlers
    return found


def plain_when_redirected(stream: Any = None) -> None:
    """No colour codes in the worker lines Ray prints unless ``stream`` (stderr) is a
    terminal; a choice the user made in ``RAY_COLOR_PREFIX`` stays."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
