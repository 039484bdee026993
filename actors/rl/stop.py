"""How an asynchronous RL run stops: in order, within a bound, and saying what happened.

Input: the run's topology, its training and rollout strategies, and ``learner.stop_timeout_s``.
Output: the stop's record for ``summary.json`` (``stop``) and one log line.

The order:
1. Admissions close: no new episode starts; episodes already running go on and are shipped, so
   the learners still get the data that finishes their step under way.
2. The learners are asked to stop. The ranks leave together, at their next step agreement; a
   rank that gets no more data abandons the step under way on every rank (its decisions go back
   to the buffers, untrained: ``LearnerCore.flush``). They have ``stop_timeout_s`` for it.
3. If they did not all leave in time (a rank stuck outside the agreement), or a rank left with
   an error (it crashed while stopping), the learner group is killed: the run ends at its last
   checkpoint, and says so (``killed``, or ``failed`` with each rank's error). No final
   checkpoint is attempted: it would wait for the step lock of a rank stuck in a collective,
   or save the state of a group one of whose ranks failed mid-step.
4. The queue closes (producers waiting on a full queue are released; what they put from then
   on is counted as discarded at stop) and the rollout stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray


def stop_async_run(topology, training, rollout, timeout_s: float,
                   log: Callable[[str], None]) -> dict:
    """Run the stop sequence above; returns its record (``learners``: ``"stopped together"``,
    ``"killed"``, or ``"failed"`` with ``errors``)."""
    start = time.monotonic()
    ray.get(topology.queue.close_admissions.remote())
    learners = list(topology.group.active)
    outcome = training.stop(learners, timeout_s)
    state = "failed" if outcome.errors else "stopped together" if outcome.left else "killed"
    record: dict = {"learners": state, "learner_s": round(time.monotonic() - start, 1)}
    if outcome.errors:
        record["errors"] = list(outcome.errors)
    if state != "stopped together":
        for lr in learners:
            ray.kill(lr, no_restart=True)
        why = (f"learner {'; '.join(outcome.errors)}" if outcome.errors else
               f"the learners did not stop together within {timeout_s:g}s "
               f"(learner.stop_timeout_s)")
        log(f"stop: {why}: the group was killed and the run ends at its last checkpoint")
    ray.get(topology.queue.close.remote())
    rollout.stop(topology.workers)
    record["seconds"] = round(time.monotonic() - start, 1)
    return record
