"""When a learner error rebuilds the learner group, and when it ends the run.

Input: an error that reached the controller from the learner group (a rank's own call, or a
survivor's collective), the group (which ranks are really gone) and the budget
``learner.max_rebuilds`` per ``learner.rebuild_window_s``. Output: permission to rebuild, or
the original error raised again.

A rebuild restarts every rank from the last checkpoint and loses the steps since. That is right
when a rank's process or node died (its actor is not alive, or answers as a new incarnation)
and wrong for an error of the training itself (a CUDA out-of-memory, a shape mismatch, a bug),
which comes back after every restore: rebuilt on every ``RuntimeError``, such a run would loop
for ever, losing progress each time. So:

- an error while every rank is alive as the incarnation the group formed with (watched for
  ``LOSS_GRACE_S``, since a survivor's collective fails before Ray notices a death) ends the
  run with that error;
- a loss rebuilds at most ``max_rebuilds`` times within any ``rebuild_window_s`` seconds; one
  more ends the run with the error, saying how many rebuilds came before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

LOSS_GRACE_S = 15.0
"""How long a group that looks whole is watched for a lost rank after an error."""


class RebuildLimitReached(RuntimeError):
    """The learner group was lost more often than ``learner.max_rebuilds`` allows."""


class LearnerFailures:
    """Decides, per learner error, between a rebuild and the end of the run."""

    def __init__(self, max_rebuilds: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_rebuilds = max_rebuilds
        self.window_s = window_s
        self.clock = clock
        self._rebuilds: deque[float] = deque()

    def check(self, cause: BaseException | str, lost: list[str]) -> None:
        """Return if the group may be rebuilt for ``cause``; otherwise raise: ``cause`` itself
        when no rank is gone (``lost`` empty), ``RebuildLimitReached`` (from ``cause``) when
        the budget is spent."""
        if not lost:
            if isinstance(cause, BaseException):
                raise cause
            raise RuntimeError(f"learner group: {cause}, but every rank is alive")
        now = self.clock()
        while self._rebuilds and now - self._rebuilds[0] > self.window_s:
            self._rebuilds.popleft()
        if len(self._rebuilds) >= self.max_rebuilds:
            error = RebuildLimitReached(
                f"learner group lost {', '.join(lost)} after {len(self._rebuilds)} rebuilds in "
                f"the last {self.window_s:.0f}s (learner.max_rebuilds={self.max_rebuilds}, "
                f"learner.rebuild_window_s={self.window_s:g}); cause: "
                f"{str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__}")
            if isinstance(cause, BaseException):
                raise error from cause
            raise error
        self._rebuilds.append(now)
