"""Schedules: how a run's rollout and training take turns, each owning its loop.

Input: a rollout driver (``actors.rl.drivers``) and the run it drives, seen through
``Run`` (the controller: its topology, its limits, its progress ticks, its answer to a lost
learner). Output: the run's loop until ``Run.done()``, and the stop's record.

Two schedules, chosen by ``pipeline.training`` (a mode picks one):
- ``SyncSchedule``: one rollout round, then every learner trains on what was collected, then
  the new weights reach the servers before the next round. The round bounds what is in flight
  and how old it gets, so the queue must hold a whole round (a queue smaller than the slots
  would make every producer wait on a learner that waits for the round to end) and neither the
  learners nor the queue apply a staleness bound (a round trained over several optimizer steps
  is PPO's minibatching, its trust region the proximal policy). It needs a rollout with rounds.
- ``AsyncSchedule``: rollout and learners run at once (the rollout in the background, every
  learner rank in its ``run`` loop); staleness is bounded by pacing, the queue's capacity and
  the learners' bound. Its loop watches for failures between progress ticks, and it stops in
  order, within ``learner.stop_timeout_s``, saying what happened:
  1. admissions close: no new episode starts; episodes already running go on and are shipped,
     so the learners still get the data that finishes their step under way;
  2. the learners are asked to stop: the ranks leave together, at their next step agreement;
     a rank that gets no more data abandons the step under way on every rank (its decisions go
     back to the buffers, untrained: ``LearnerCore.flush``);
  3. if they did not all leave in time (a rank stuck outside the agreement), or a rank left
     with an error (it crashed while stopping), the learner group is killed: the run ends at
     its last checkpoint, and says so (``killed``, or ``failed`` with each rank's error). No
     final checkpoint is attempted: it would wait for the step lock of a rank stuck in a
     collective, or save the state of a group one of whose ranks failed mid-step;
  4. the queue closes (producers waiting on a full queue are released; what they put from
     then on is counted as discarded at stop) and the rollout stops.

Invariant: a learner group rebuilt after a lost rank (``Run.learner_failed``) trains on under
the same schedule: the asynchronous one restarts every rank's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import ray
from ray.exceptions import RayTaskError

from actors.rl.drivers import ROLLOUT_DRIVERS, ContinuousRollout, RoundRollout
from actors.rl.topology import Topology
from actors.roles.learner_group import LOSS_ERRORS
from rlvla3.run_config import RunConfig
from rlvla3.types import EnvSpec


class Run(Protocol):
    """What a schedule drives: the controller's side of the loop."""

    @property
    def topology(self) -> Topology: ...

    @property
    def learners(self) -> list:
        """The learner ranks that train now (a rebuilt group may have fewer)."""
        ...

    def done(self) -> bool:
        """Whether the run ends now (a limit is spent or a stop was asked)."""
        ...

    def tick_if_due(self) -> None:
        """Write a progress row if one is due."""
        ...

    def check_capacity(self) -> bool:
        """Raise the run's fatal capacity error, if any; True when a learner rank that did not
        run for ``ray.node_wait_s`` was rebuilt away."""
        ...

    def learner_failed(self, exc: BaseException) -> None:
        """A learner rank failed: rebuild the group (the caller's loop goes on) or raise."""
        ...

    def log(self, text: str) -> None: ...


class Schedule(Protocol):
    """A run's loop (see the module docstring)."""

    concurrent: bool
    """Rollout and training overlap: the queue is bounded and staleness is bounded."""

    def run(self, run: Run) -> dict | None:
        """Drive ``run`` until it is done; the stop's record (None: nothing was under way)."""
        ...


class SyncSchedule:
    """Rollout round, then train, then sync weights; nothing overlaps."""

    concurrent = False

    def __init__(self, rollout: RoundRollout, global_batch: int, max_item: int):
        """``max_item``: the decisions of the largest queue item (a longest episode, or GRPO
        group of them), which one rank takes whole."""
        self.rollout = rollout
        self.global_batch = global_batch
        self.max_item = max_item

    def run(self, run: Run) -> None:
        topo = run.topology
        while not run.done():
            try:
                self.rollout.run_round(topo.workers, topo.servers)
                self._train(run.learners, topo.queue)
            except LOSS_ERRORS as exc:
                run.learner_failed(exc)
            run.tick_if_due()

    def _train(self, learners: Sequence, queue) -> None:
        """Train every full global batch the round produced, on all ranks alike."""
        if len(learners) == 1:
            ray.get(learners[0].train_available.remote())
            return
        queued = ray.get(queue.queued_decisions.remote())
        buffered = sum(ray.get([lr.buffered.remote() for lr in learners]))
        # a margin for items (an episode or a GRPO group) that one rank takes whole
        steps = max(0, (queued + buffered - len(learners) * self.max_item) // self.global_batch)
        _get_all_or_first_error([lr.train_steps.remote(steps) for lr in learners])


def _get_all_or_first_error(refs: list) -> None:
    """Wait for every rank's call, but raise as soon as one rank fails: the others may be
    waiting in a collective for it and would never return."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises that rank's error now


class AsyncSchedule:
    """Learners pull from the queue and train while rollout goes on."""

    concurrent = True

    def __init__(self, rollout: ContinuousRollout, stop_timeout_s: float, poll_s: float = 0.2):
        self.rollout = rollout
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self._training: list = []
        """Every rank's ``run`` call."""

    def run(self, run: Run) -> dict:
        topo = run.topology
        self._start_training(run.learners)
        self.rollout.start(topo.workers, topo.servers)
        while not run.done():
            time.sleep(self.poll_s)
            self._check(run)
            run.tick_if_due()
        return self._stop(run)

    def _start_training(self, learners: Sequence) -> None:
        self._training = [lr.run.remote() for lr in learners]

    def _check(self, run: Run) -> None:
        """Raise what ended a role early; rebuild a lost learner group and train on."""
        if run.check_capacity():
            self._start_training(run.learners)
        self.rollout.check()
        ready, _ = ray.wait(self._training, timeout=0)
        for ref in ready:  # a rank that ended early ended by an exception
            try:
                ray.get(ref)
            except LOSS_ERRORS as exc:
                run.learner_failed(exc)
                self._start_training(run.learners)
                break

    def _stop(self, run: Run) -> dict:
        """The stop sequence (see the module docstring); returns its record (``learners``:
        ``"stopped together"``, ``"killed"``, or ``"failed"`` with ``errors``)."""
        topo = run.topology
        start = time.monotonic()
        ray.get(topo.queue.close_admissions.remote())
        learners = list(topo.group.active)
        for lr in learners:
            lr.stop.remote()
        ready, _ = ray.wait(self._training, num_returns=len(self._training),
                            timeout=self.stop_timeout_s)
        errors = []
        for rank, ref in enumerate(self._training):
            if ref in ready:  # a ref that ended in an exception is ready too: each is read
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the stop record names it
                    errors.append(f"rank {rank}: {one_line(exc)}")
        left = len(ready) == len(self._training)
        state = "failed" if errors else "stopped together" if left else "killed"
        record: dict = {"learners": state, "learner_s": round(time.monotonic() - start, 1)}
        if errors:
            record["errors"] = errors
        if state != "stopped together":
            for lr in learners:
                ray.kill(lr, no_restart=True)
            why = (f"learner {'; '.join(errors)}" if errors else
                   f"the learners did not stop together within {self.stop_timeout_s:g}s "
                   f"(learner.stop_timeout_s)")
            run.log(f"stop: {why}: the group was killed and the run ends at its last checkpoint")
        ray.get(topo.queue.close.remote())
        self.rollout.stop(topo.workers)
        record["seconds"] = round(time.monotonic() - start, 1)
        return record


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an error, its first line (a Ray task error's cause, not the
    traceback Ray wraps around it)."""
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "sync": lambda rollout, cfg, spec: SyncSchedule(
        rollout, cfg.learner.global_batch,
        spec.max_decisions * (cfg.algo.group_size if cfg.algo.name == "grpo" else 1)),
    "async": lambda rollout, cfg, spec: AsyncSchedule(rollout, cfg.learner.stop_timeout_s),
}
"""``pipeline.training`` -> the schedule, from its rollout, the run config and the env spec."""


def make_schedule(cfg: RunConfig, spec: EnvSpec) -> Schedule:
    """The schedule and rollout driver ``cfg.pipeline`` names (a validated config never pairs
    the asynchronous rollout, which has no rounds, with the synchronous schedule)."""
    choices = cfg.choices
    rollout = ROLLOUT_DRIVERS[choices.rollout](cfg.pipeline.round_decisions
                                                     or spec.max_decisions)
    return SCHEDULES[choices.training](rollout, cfg, spec)
