"""Collecting the roles' stats across actor restarts (see ``actors.observe.monitor``).

Input: the actor handles of one role. Output: one record per actor (``rlvla3.role_stats``)
whose counters never go down: an actor that Ray restarted reports a new incarnation whose
counters start from zero, so its predecessor's last counters are added back (the record's
``CARRIED``), and what died with it (the record's ``held()``: an env worker's running
episodes, a learner's buffered samples) is counted as lost.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Generic, TypeVar

import ray

from actors.observe.figures import add_counts
from rlvla3.role_stats import Role

R = TypeVar("R", bound=Role)


class WaitingForActors(RuntimeError):
    """None of a role's actors has run yet (they wait for resources)."""


class RoleStats(Generic[R]):
    """Stats of one role's actors across restarts (see the module docstring).

    An actor that does not run (restarting after its process or node died, waiting for a node
    to be placed on, or dead) is not waited for: its entry keeps its last counters with nothing
    in flight, ``state`` says why, and what it held is counted as lost at once. ``down`` lists
    the indices that do not run now."""

    def __init__(self, role: str):
        self.role = role
        self.restarts = 0
        self.lost: dict[str, int] = {}
        self.down: dict[int, str] = {}
        self._seen: dict[int, dict] = {}
        self._pending: dict[int, ray.ObjectRef] = {}

    def collect(self, handles: list, timeout_s: float = 60.0) -> list[R]:
        from actors.runtime.cluster_state import actor_state

        for i, h in enumerate(handles):  # one call in flight per actor
            if i not in self._pending:
                self._pending[i] = h.stats.remote()
        refs = [self._pending[i] for i in range(len(handles))]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=min(timeout_s, 1.0))
        ready = set(done)
        late = [i for i, ref in enumerate(refs) if ref not in ready]
        for i in late:  # slow, or not running at all: only a running actor is waited for
            state = actor_state(handles[i])
            if state == "ALIVE" and i not in self.down:
                if ray.wait([refs[i]], timeout=timeout_s)[0]:
                    ready.add(refs[i])
                    continue
                raise TimeoutError(f"{self.role} {i} is alive but did not answer its stats "
                                   f"call within {timeout_s:.0f}s")
            if state != "ALIVE":
                self._went_down(i, state)
        answered: dict[int, R] = {}
        for i, ref in enumerate(refs):
            if ref in ready:
                del self._pending[i]
                try:
                    st = ray.get(ref)
                except ray.exceptions.RayActorError:  # this incarnation died
                    state = actor_state(handles[i])
                    self._went_down(i, "RESTARTING" if state == "ALIVE" else state)
                    continue
                self.down.pop(i, None)
                seen = self._seen.get(i)
                if seen is not None and seen["incarnation"] != st.incarnation:
                    self._count_restart(seen)
                    if not seen.get("lost"):
                        self._lose(seen)
                carry = seen["carry"] if seen is not None else {}
                self._seen[i] = {"incarnation": st.incarnation, "last": st, "carry": carry}
                answered[i] = replace(st, **{k: add_counts(getattr(st, k), v)
                                             for k, v in carry.items()}, state="ALIVE")
        return [answered[i] if i in answered else self._as_down(i) for i in range(len(refs))]

    def incarnation(self, i: int) -> str | None:
        """The incarnation actor ``i`` last answered as (None: never seen)."""
        seen = self._seen.get(i)
        return None if seen is None else seen["incarnation"]

    def _went_down(self, i: int, state: str) -> None:
        self.down[i] = state
        seen = self._seen.get(i)
        if seen is not None and state != "DEAD":
            self._count_restart(seen)  # Ray restarts it: counted now, even if the run ends first
        if seen is not None and not seen.get("lost"):
            self._lose(seen)

    def _count_restart(self, seen: dict) -> None:
        """One restart per incarnation that went away, whether first seen as Ray restarting
        it or as its successor answering."""
        if not seen.get("restart_counted"):
            seen["restart_counted"] = True
            self.restarts += 1

    def _lose(self, seen: dict) -> None:
        """Count what the actor held, and keep its counters (its successor starts at zero)."""
        seen["lost"] = True
        last = seen["last"]
        for key, n in last.held().items():
            self.lost[key] = self.lost.get(key, 0) + n
        for key in last.CARRIED:
            value = getattr(last, key)
            seen["carry"][key] = add_counts(seen["carry"].get(key, {} if isinstance(value, dict)
                                                              else 0), value)

    def _as_down(self, i: int) -> R:
        """The record of an actor that does not run: its counters so far, nothing in flight
        (an actor never seen running, e.g. one waiting for a new node, counts zeros)."""
        seen = self._seen.get(i)
        if seen is None:
            if not self._seen:
                raise WaitingForActors(f"no {self.role} runs yet ({self.down.get(i)})")
            seen = {"last": type(next(iter(self._seen.values()))["last"])(), "carry": {}}
        return replace(seen["last"].at_rest(), **seen["carry"], state=self.down.get(i, "DEAD"))
