"""Capacity watch: which actors of a run do not run, since when, and what the run does about it.

Input: the ``Topology`` of a running run, whether its rollout is lockstep (every slot must run
for a round to finish) and ``ray.node_wait_s``. It polls every actor's state in the GCS from its
own thread, so a round blocked on a lost actor cannot silence it.

What it decides, after an actor has not run for ``node_wait_s`` (its node left the cluster and
no node offers its resources, or it waits for a node that never comes):
- a rollout server: the run stops with an error that names the server and its resources;
- an env worker: asynchronous rollout goes on with fewer slots (the progress line and the
  summary say how many wait), until none is left: then the run stops; lockstep rollout stops
  at once (a round needs every slot);
- a learner rank: several ranks are rebuilt without it (``LearnerGroup``; the controller does
  that, this only asks for it); a lone learner stops the run.
To stop a run that is blocked inside a round, the actor it waits on is killed for good, so the
round fails at once and the controller raises ``fatal``.

Output: ``fatal`` (the error to raise, or None), ``rebuild_requested``, and ``events``: one per
time an actor did not run (role, index, state, when, seconds until it ran again; ``kind``
``outage`` for an actor that had run, ``start`` for one that waited for its first node): the
recovery and scale-up times of the summary.
"""

from __future__ import annotations

import threading
import time

import ray

from actors.runtime.cluster_state import actor_state
from rlvla3.plan.cluster import describe_demand


class CapacityWatch:
    """Polls the actors' states (see the module docstring)."""

    def __init__(self, topology, demands: dict[str, dict], lockstep: bool, wait_s: float,
                 poll_s: float = 1.0):
        self.topo = topology
        self.demands = demands
        self.lockstep = lockstep
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.fatal: BaseException | None = None
        self.rebuild_requested = threading.Event()
        self.events: list[dict] = []
        self._down: dict[tuple[str, int], dict] = {}
        self._ran: set[tuple[str, int]] = set()
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="capacity")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def outages(self) -> list[dict]:
        """Every outage so far; those still open have ``back_after_s`` None."""
        now = time.monotonic()
        still = [{**{k: v for k, v in e.items() if k != "t"}, "back_after_s": None,
                  "down_for_s": round(now - e["t"], 1)} for e in list(self._down.values())]
        return list(self.events) + still

    def down(self, role: str) -> list[int]:
        return sorted(i for r, i in list(self._down) if r == role)

    def _roles(self) -> dict[str, list]:
        group = self.topo.group
        active = set(map(id, group.active)) if group is not None else None
        learners = [h for h in self.topo.learners if active is None or id(h) in active]
        return {"rollout": self.topo.servers, "env": self.topo.workers, "learner": learners}

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a GCS hiccup must not end the watch
                if self._stop.is_set():
                    return
                print(f"capacity watch: {type(exc).__name__}: {exc}", flush=True)

    def poll(self) -> None:
        now = time.monotonic()
        for role, handles in self._roles().items():
            for i, handle in enumerate(handles):
                index = self.topo.learners.index(handle) if role == "learner" else i
                key = (role, index)
                state = actor_state(handle)
                if state == "ALIVE":
                    self._ran.add(key)
                    if key in self._down:
                        event = self._down.pop(key)
                        event["back_after_s"] = round(now - event["t"], 1)
                        event.pop("t")
                        self.events.append(event)
                    continue
                if key not in self._down:
                    self._down[key] = {"role": role, "index": index, "state": state, "t": now,
                                       "at_s": round(now - self._start, 1),
                                       "kind": "outage" if key in self._ran else "start"}
                elif now - self._down[key]["t"] >= self.wait_s and self.fatal is None:
                    self._decide(role, index, handle)

    def _decide(self, role: str, index: int, handle) -> None:
        need = describe_demand(self.demands[role])
        waited = f"{self.wait_s:.0f}s (ray.node_wait_s)"
        if role == "learner":
            if len(self.topo.group.active) > 1:
                self.rebuild_requested.set()
                return
            self._fail(f"learner 0 has not run for {waited}: its node left the cluster and no "
                       f"node offers {need}", handle)
        elif role == "rollout":
            self._fail(f"rollout server {index} has not run for {waited}: its node left the "
                       f"cluster and no node offers {need}", handle)
        elif self.lockstep:
            self._fail(f"env worker {index} has not run for {waited} and lockstep rounds need "
                       f"every slot: no node offers {need}", handle)
        elif len(self.down("env")) == len(self.topo.workers):
            self._fail(f"no env worker has run for {waited}: no node offers {need}", None)

    def _fail(self, message: str, blocking) -> None:
        self.fatal = RuntimeError(message)
        if blocking is not None:  # wake a round that waits on it
            ray.kill(blocking, no_restart=True)
