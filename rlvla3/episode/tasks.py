"""Which episode an env slot runs next: seeded episode keys, each task at its share.

``TaskSampler`` hands out ``EpisodeKey``s (task, fixed initial state) in a seeded order, each key
``repeat`` times in a row, so that GRPO groups (episodes of one key) form inside one env worker,
on its next free slots. Each task gets its share of the new keys at every point of a run: equal
(``EvenTasks``), or with ``InformativeTasks`` one that follows how often that task's groups are
mixed (some successes, some failures) now. Its ``state`` (JSON) goes into each RL checkpoint,
and ``restore`` continues it in a resumed run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from rlvla3.types import EpisodeKey


class TaskSampler:
    """Seeded, endless sequence of episode keys; each key repeated ``repeat`` times.

    Tasks get shares of the new keys (``EvenTasks``: equal; ``InformativeTasks``: by how often
    their groups teach) and a credit count keeps each task's keys within 2 of its summed shares
    (about ``lead`` x slots + 2 with a lead) at every point of a run, however short: every new key adds each task's
    share to its credit and the chosen task pays one. Each task goes through all its initial
    states, in a new seeded order, before repeating one. A key's copies come before any new
    key: once a key is handed out, its remaining copies go to the next callers, whatever task
    they ask for, so the ``repeat`` episodes of a GRPO group start on the worker's next free
    slots, ``ceil(repeat / slots)`` episodes of a slot apart at most, and the group is trained
    while its first member is still fresh. ``next(task)`` keeps a caller on ``task`` when a
    new key starts while that task has run at most ``lead`` keys ahead of its shares, else
    gives it the task owed most: a LIBERO reset that changes task builds another simulator
    (5.2 s here against 2.8 s), so an env slot that stays on its task spends that on
    episodes. (Balance is what a run needs first: with a sticky slot and no bound, the 4 slots
    of a short 10-task GRPO run trained 5 of the 10 tasks.)"""

    def __init__(self, task_ids: Sequence[int], init_state_ids: Sequence[int], seed: int,
                 repeat: int = 1, lead: int = 0,
                 weighting: InformativeTasks | EvenTasks | None = None):
        tasks, states = list(dict.fromkeys(task_ids)), list(init_state_ids)
        if not tasks or not states:
            raise ValueError("TaskSampler needs at least one task id and one initial state id")
        if lead < 0:
            raise ValueError(f"lead must be >= 0, got {lead}")
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.repeat = repeat
        self.lead = lead
        self.weighting = weighting if weighting is not None else EvenTasks(tasks)
        self._copies: list[EpisodeKey] = []
        """The copies still to hand out of the key started last."""
        self._credit = {t: 0.0 for t in tasks}
        """The keys each task is owed (its shares summed, less the keys it started)."""
        self._states: dict[int, list[int]] = {t: [] for t in tasks}
        """Each task's initial states not yet started in its own pass, next last."""
        self._state_ids = states

    def next(self, task: int | None = None) -> EpisodeKey:
        if self._copies:
            return self._copies.pop()
        key = self._new_key(task)
        self._copies = [key] * (self.repeat - 1)
        return key

    def put_back(self, key: EpisodeKey) -> None:
        """A key ``next`` gave that was not run (its slot ran a GRPO group's redraw instead):
        it is the next one handed out, so no group loses a member."""
        self._copies.append(key)

    def _new_key(self, task: int | None) -> EpisodeKey:
        """A new key on a task chosen by credit: the caller's own task while it is at most
        ``lead`` keys ahead of its shares (no simulator rebuild), else the task owed most."""
        for t, share in self.weighting.shares().items():
            self._credit[t] += share
        if task is None or self._credit.get(task, -np.inf) <= -self.lead:
            most = max(self._credit.values())  # ties (at the start) broken by the seed
            owed = [t for t, c in self._credit.items() if c >= most - 1e-9]
            task = owed[int(self.rng.integers(len(owed)))]
        self._credit[task] -= 1.0
        states = self._states[task]
        if not states:
            states.extend(self._state_ids[i] for i in self.rng.permutation(len(self._state_ids)))
        return EpisodeKey(task, states.pop())

    def observe(self, task: int, success: bool) -> None:
        """An episode of ``task`` ended (informative weighting learns the tasks' success)."""
        self.weighting.observe(task, success)

    # ---- resuming ----------------------------------------------------------------------------
    def state(self) -> dict:
        """Where the sequence stands, as JSON: a run resumed from a checkpoint continues each
        task's pass over its states and the task shares instead of starting them again."""
        return {
            "tasks": list(self._credit), "state_ids": list(self._state_ids),
            "rng": self.rng.bit_generator.state,
            "credit": list(self._credit.values()),
            "states": [list(s) for s in self._states.values()],
            "copies": [[k.task_id, k.init_state_id] for k in self._copies],
            "weighting": self.weighting.state(),
        }

    def restore(self, state: dict | None, salt: int = 0) -> bool:
        """Continue the sequence ``state`` saved. Without a state, or with one saved for other
        tasks or initial states, start a new seeded sequence salted by ``salt`` (a resumed or
        restarted worker then does not repeat the keys its first sequence began with); returns
        whether ``state`` was restored."""
        if not state or state.get("tasks") != list(self._credit) or \
                state.get("state_ids") != list(self._state_ids):
            self.rng = np.random.default_rng([self.seed, salt])
            return False
        self.rng.bit_generator.state = state["rng"]
        self._credit = dict(zip(self._credit, map(float, state["credit"]), strict=True))
        self._states = {t: [int(i) for i in s]
                        for t, s in zip(self._states, state["states"], strict=True)}
        self._copies = [EpisodeKey(int(t), int(i)) for t, i in state["copies"]]
        self.weighting.restore(state.get("weighting") or {})
        return True


class EvenTasks:
    """Equal shares for every task (``task_weighting: uniform``)."""

    def __init__(self, task_ids: Sequence[int]):
        tasks = list(dict.fromkeys(task_ids))
        self._shares = {t: 1.0 / len(tasks) for t in tasks}

    def observe(self, task: int, success: bool) -> None:
        pass

    def shares(self) -> dict[int, float]:
        return self._shares

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


class InformativeTasks:
    """Task shares that follow how informative each task's GRPO groups are now.

    A group of G episodes of one key teaches nothing when all succeed or all fail: its
    advantages are zero (and ``skip_uniform_groups`` drops it). With p a task's recent success
    (over its last ``window`` episodes, Laplace-smoothed: a task not yet seen counts as 1/2), a
    group is mixed with probability ``m = 1 - p^G - (1 - p)^G`` (G at least 2; for G = 2 it is
    2p(1 - p), the variance of one episode's outcome). A task's share is ``floor / tasks`` plus
    ``1 - floor`` times its part of the summed m: a multi-task policy at 0.4 on some tasks and
    0.02 on others spends its episodes where they teach, and the floor keeps every task seen,
    so a task that starts to succeed (or to fail) gets its share back."""

    def __init__(self, task_ids: Sequence[int], group_size: int, window: int = 32,
                 floor: float = 0.1):
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {floor}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.group = max(group_size, 2)
        self.floor = floor
        self.outcomes: dict[int, deque[bool]] = {
            t: deque(maxlen=window) for t in dict.fromkeys(task_ids)
        }

    def observe(self, task: int, success: bool) -> None:
        if task in self.outcomes:
            self.outcomes[task].append(bool(success))

    def state(self) -> dict:
        """Each task's recent outcomes (JSON keys are strings)."""
        return {str(t): list(seen) for t, seen in self.outcomes.items()}

    def restore(self, state: dict) -> None:
        for t, seen in self.outcomes.items():
            seen.clear()
            seen.extend(bool(x) for x in state.get(str(t), []))

    def mixed(self, task: int) -> float:
        """The probability that a group of this task is mixed, at its smoothed recent success."""
        seen = self.outcomes[task]
        p = (sum(seen) + 1.0) / (len(seen) + 2.0)
        return 1.0 - p ** self.group - (1.0 - p) ** self.group

    def shares(self) -> dict[int, float]:
        mixed = {t: self.mixed(t) for t in self.outcomes}
        total, n = sum(mixed.values()), len(mixed)
        return {t: self.floor / n + (1.0 - self.floor) * (m / total if total > 0 else 1.0 / n)
                for t, m in mixed.items()}

