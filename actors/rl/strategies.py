"""Rollout and training strategies: how the controller drives env workers and learners.

Each strategy is an object chosen by ``pipeline`` config; the controller's loop never branches on
a mode name. Rollout strategies:
- ``LockstepRollout(groups=1)``: all slots of all workers step, then one inference batch for all
  of them, until every slot has finished its episode (synchronous, as colocated RL systems do).
  A group's batch is split evenly over the group's rollout servers (every server when there
  is one group), which answer at once.
- ``LockstepRollout(groups=2)``: the workers split into two groups, each in lockstep; one group
  simulates while the other's batch is inferred (the disaggregated pipeline).
- ``AutoresetRollout``: lockstep for a fixed number of decisions per round; a slot whose episode
  ends resets in place (in the background: the other slots keep stepping, and it rejoins the
  lockstep when its reset is done) and goes on, and an episode still running at the round's
  end continues in the next round (the fixed-horizon design of synchronous VLA-RL systems: no
  slot idles waiting for the round's slowest episode, only for the inference batch).
- ``AsyncRollout``: every slot runs its own loop; the rollout server's batcher groups requests,
  and the trajectory queue paces episode starts.
Training strategies:
- ``SyncTraining``: one rollout round, then every learner trains on what was collected, then the
  new weights reach the servers before the next round. The round bounds what is in flight and
  how old it gets, so the queue must hold a whole round (a queue smaller than the slots would
  make every producer wait on a learner that waits for the round to end) and neither the
  learners nor the queue apply a staleness bound (a round trained over several optimizer steps
  is PPO's minibatching, its trust region the proximal policy).
- ``AsyncTraining``: rollout and learners run at once; staleness is bounded by pacing, the
  queue's capacity and the learners' per-decision bound.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class TrainingStop:
    """How the learner ranks left their training loop when asked to stop."""

    left: bool
    """Every rank's loop returned within the timeout (with or without an error)."""
    errors: tuple[str, ...] = ()
    """One line per rank whose loop ended in an error (``rank K: Type: message``)."""


class LockstepRollout:
    """Lockstep groups of env workers, driven from threads of the controller."""

    def __init__(self, groups: int):
        self.groups = groups
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def _split(self, workers: Sequence, servers: Sequence) -> list[tuple[list, list]]:
        """Each group's workers and servers (the servers are shared out when there are enough,
        else groups take turns on them)."""
        n = min(self.groups, len(workers))
        return [(list(workers[g::n]),
                 list(servers[g::n]) if len(servers) >= n else [servers[g % len(servers)]])
                for g in range(n)]

    def _round(self, workers: list, servers: list) -> None:
        """Every slot of ``workers`` runs one episode, in lockstep."""
        obs = ray.get([w.begin_episodes.remote() for w in workers])
        while obs is not None and not self._stop.is_set():
            obs = self._step(workers, servers, obs, autoreset=False)

    @staticmethod
    def _step(workers: list, servers: list, obs: list, autoreset: bool) -> list | None:
        """One inference batch for every live slot (split over ``servers``), then one step of
        each; returns the new observations per worker (None for a finished slot), or None when
        no slot was live."""
        flat = [(wi, si, o) for wi, slots in enumerate(obs) for si, o in enumerate(slots)
                if o is not None]
        if not flat:
            return None
        jobs = [(server, flat[i::len(servers)]) for i, server in enumerate(servers)
                if flat[i::len(servers)]]
        answers = ray.get([server.act_batch.remote([o for _, _, o in part])
                           for server, part in jobs])
        flat = [item for _, part in jobs for item in part]
        chunks = [chunk for answer in answers for chunk in answer]
        per_worker = [[None] * len(slots) for slots in obs]
        for (wi, si, _), chunk in zip(flat, chunks, strict=True):
            per_worker[wi][si] = chunk
        return ray.get([w.step_slots.remote(c, autoreset)
                        for w, c in zip(workers, per_worker, strict=True)])

    def _loop(self, workers: list, servers: list, rounds: int | None) -> None:
        try:
            done = 0
            while not self._stop.is_set() and (rounds is None or done < rounds):
                self._round(workers, servers)
                done += 1
        except BaseException as exc:  # surfaced by the controller's monitor
            self.errors.append(exc)

    def run_round(self, workers: Sequence, servers: Sequence) -> None:
        """One round (every slot one episode), all groups at once; returns when all are done."""
        self._stop.clear()
        threads = [threading.Thread(target=self._loop, args=(w, s, 1), daemon=True)
                   for w, s in self._split(workers, servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]

    def start(self, workers: Sequence, servers: Sequence) -> None:
        """Run rounds continuously in the background until ``stop``."""
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, args=(w, s, None), daemon=True)
                         for w, s in self._split(workers, servers)]
        for t in self._threads:
            t.start()

    def stop(self, workers: Sequence, timeout_s: float = 60.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)


class AsyncRollout:
    """Every env slot runs its own episode loop inside its worker."""

    def __init__(self):
        self.refs: list = []
        self.errors: list[BaseException] = []

    def start(self, workers: Sequence, servers: Sequence) -> None:
        self.refs = [w.run.remote() for w in workers]

    def run_round(self, workers: Sequence, servers: Sequence) -> None:
        raise RuntimeError("asynchronous rollout has no rounds; it needs asynchronous training")

    def stop(self, workers: Sequence, timeout_s: float = 60.0) -> None:
        for w in workers:
            w.stop.remote()
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - reported, not raised, at shutdown
                self.errors.append(exc)


class AutoresetRollout(LockstepRollout):
    """Lockstep rounds of ``decisions`` steps per slot, episodes resetting in place."""

    def __init__(self, decisions: int):
        super().__init__(groups=1)
        self.decisions = decisions

    def _round(self, workers: list, servers: list) -> None:
        obs = ray.get([w.continue_episodes.remote() for w in workers])
        for _ in range(self.decisions):
            if obs is None or self._stop.is_set():
                return
            obs = self._step(workers, servers, obs, autoreset=True)


ROLLOUT_STRATEGIES = {
    "lockstep": lambda decisions: LockstepRollout(groups=1),
    "pipelined": lambda decisions: LockstepRollout(groups=2),
    "autoreset": AutoresetRollout,
    "async": lambda decisions: AsyncRollout(),
}
"""name -> factory taking the decisions per autoreset round."""


class SyncTraining:
    """Rollout round, then train, then sync weights; nothing overlaps."""

    concurrent = False

    def __init__(self):
        self.refs: list = []

    def start(self, learners: Sequence) -> None:
        pass

    def after_round(self, learners: Sequence, queue, global_batch: int, max_item: int) -> None:
        """Train every full global batch the round produced, on all ranks alike."""
        if len(learners) == 1:
            ray.get(learners[0].train_available.remote())
            return
        steps = _full_steps(queue, learners, global_batch, max_item)
        _get_all_or_first_error([lr.train_steps.remote(steps) for lr in learners])

    def stop(self, learners: Sequence, timeout_s: float = 120.0) -> TrainingStop:
        return TrainingStop(left=True)


def _get_all_or_first_error(refs: list) -> None:
    """Wait for every rank's call, but raise as soon as one rank fails: the others may be
    waiting in a collective for it and would never return."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises that rank's error now


def _full_steps(queue, learners: Sequence, global_batch: int, max_item: int) -> int:
    """Optimizer steps every rank can take from what is queued and buffered (with a margin for
    items, an episode or a GRPO group of up to ``max_item`` decisions, that one rank takes
    whole)."""
    queued = ray.get(queue.queued_decisions.remote())
    buffered = sum(ray.get([lr.buffered.remote() for lr in learners]))
    margin = len(learners) * max_item
    return max(0, (queued + buffered - margin) // global_batch)


class AsyncTraining:
    """Learners pull from the queue and train while rollout goes on."""

    concurrent = True

    def __init__(self):
        self.refs: list = []

    def start(self, learners: Sequence) -> None:
        self.refs = [lr.run.remote() for lr in learners]

    def after_round(self, learners: Sequence, queue, global_batch: int, max_item: int) -> None:
        pass

    def stop(self, learners: Sequence, timeout_s: float = 120.0) -> TrainingStop:
        """Ask every rank to stop and wait up to ``timeout_s``; says whether every rank left
        ``run()`` and which left it with an error (a ref that ended in an exception is ready
        too: each is read). Ranks leave together at their next step agreement (or abandon the
        step under way together), so rollout must go on until this returns."""
        for lr in learners:
            lr.stop.remote()
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        errors = []
        for rank, ref in enumerate(self.refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the stop record names it
                    errors.append(f"rank {rank}: {one_line(exc)}")
        return TrainingStop(left=len(ready) == len(self.refs), errors=tuple(errors))


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an error, its first line (a Ray task error's cause, not the
    traceback Ray wraps around it)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


TRAINING_STRATEGIES = {"sync": SyncTraining, "async": AsyncTraining}
