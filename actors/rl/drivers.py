"""Rollout drivers: how the env workers' slots are driven, chosen by ``pipeline.rollout``.

Input: the env worker and rollout server handles of a run. Output: episodes shipped to the
trajectory queue by the workers; errors of the rollout, raised to the schedule
(``actors.rl.schedule``) that drives it.

- ``LockstepRollout(groups=1)``: all slots of all workers step, then one inference batch for
  all of them, until every slot has finished its episode (synchronous, as colocated RL systems
  do). A group's batch is split evenly over the group's rollout servers (every server when
  there is one group), which answer at once.
- ``LockstepRollout(groups=2)``: the workers split into two groups, each in lockstep; one group
  simulates while the other's batch is inferred (the disaggregated pipeline).
- ``AutoresetRollout``: lockstep for a fixed number of decisions per round; a slot whose episode
  ends resets in place (in the background: the other slots keep stepping, and it rejoins the
  lockstep when its reset is done) and goes on, and an episode still running at the round's
  end continues in the next round (the fixed-horizon design of synchronous VLA-RL systems: no
  slot idles waiting for the round's slowest episode, only for the inference batch).
- ``AsyncRollout``: every slot runs its own loop inside its worker; the rollout server's batcher
  groups requests, and the trajectory queue paces episode starts.

The lockstep drivers run rounds (``RoundRollout``, for the synchronous schedule) or rounds in
the background (``ContinuousRollout``, for the asynchronous one); ``AsyncRollout`` only runs in
the background.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import ray


class RoundRollout(Protocol):
    """A rollout that runs in rounds (the synchronous schedule's)."""

    def run_round(self, workers: Sequence, servers: Sequence) -> None:
        """One round; returns when every slot has done its part (raises a role's error)."""
        ...


class ContinuousRollout(Protocol):
    """A rollout that runs in the background until stopped (the asynchronous schedule's)."""

    def start(self, workers: Sequence, servers: Sequence) -> None:
        """Start the rollout and return at once."""
        ...

    def check(self) -> None:
        """Raise the error of a part of the rollout that ended early."""
        ...

    def stop(self, workers: Sequence, timeout_s: float = 60.0) -> None:
        """Stop the rollout and wait up to ``timeout_s`` for it (errors while stopping are
        not raised: the run is over, and the accounting says where each decision went)."""
        ...


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
        obs: list | None = ray.get([w.begin_episodes.remote() for w in workers])
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
        except BaseException as exc:  # raised by run_round or check
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
        self.check()

    def start(self, workers: Sequence, servers: Sequence) -> None:
        """Run rounds continuously in the background until ``stop``."""
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, args=(w, s, None), daemon=True)
                         for w, s in self._split(workers, servers)]
        for t in self._threads:
            t.start()

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]

    def stop(self, workers: Sequence, timeout_s: float = 60.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)


class AutoresetRollout(LockstepRollout):
    """Lockstep rounds of ``decisions`` steps per slot, episodes resetting in place."""

    def __init__(self, decisions: int):
        super().__init__(groups=1)
        self.decisions = decisions

    def _round(self, workers: list, servers: list) -> None:
        obs: list | None = ray.get([w.continue_episodes.remote() for w in workers])
        for _ in range(self.decisions):
            if obs is None or self._stop.is_set():
                return
            obs = self._step(workers, servers, obs, autoreset=True)


class AsyncRollout:
    """Every env slot runs its own episode loop inside its worker."""

    def __init__(self):
        self._runs: list = []
        """Every worker's ``run`` call."""

    def start(self, workers: Sequence, servers: Sequence) -> None:
        self._runs = [w.run.remote() for w in workers]

    def check(self) -> None:
        ready, _ = ray.wait(self._runs, timeout=0)
        for ref in ready:
            ray.get(ref)  # a worker whose run ended early ended by an exception: raise it

    def stop(self, workers: Sequence, timeout_s: float = 60.0) -> None:
        for w in workers:
            w.stop.remote()
        ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)


ROLLOUT_DRIVERS = {
    "lockstep": lambda decisions: LockstepRollout(groups=1),
    "pipelined": lambda decisions: LockstepRollout(groups=2),
    "autoreset": AutoresetRollout,
    "async": lambda decisions: AsyncRollout(),
}
"""name -> factory taking the decisions per autoreset round."""
