"""Env slots over one Isaac Lab server: each slot an ``Env``, all stepped in one batched call.

Role: an rlvla3 env worker drives slots, one ``Env`` each, every slot in its own thread; an
Isaac Lab server steps all of its ``num_envs`` sub-envs at once. Sub-env ``i`` is slot ``i``:

- ``ServerSlots`` (no threads): ``reset(slot, task, state)`` resets that sub-env onto task
  variant ``task`` and initial layout ``state`` (its split's layout id) and reads its
  observation from the shared segment; ``step(chunks)`` writes the action chunks of the slots
  that asked into the segment, steps the server once and reads each slot's ``StepResult``.
  A server fault truncates every episode of the round (``StepResult.fault``, the last good
  observation); after a restart, a slot whose episode began on the lost server is truncated
  too on its next step (its sub-env is gone), never continued on a fresh scene. A slot in an
  episode that sits out a step (its chunk came after the gather window) is truncated the same
  way on its next step: the simulator stepped its sub-env with the hold action, its episode
  clock ran and the task may have reset it by itself, so nothing after its last observation is
  its own.
- ``LockstepSlots``: lets slot threads share one ``ServerSlots``. A ``step`` blocks until every
  slot in an episode has submitted its chunk (or ``gather_timeout_s`` passed; the round then
  runs without the missing slots, whose episodes end as above, and later rounds no longer wait
  for them), so the simulator is stepped once per round for all.
- ``IsaacLabSlot`` (the ``Env``): one slot's view.

Observations are copied out of the segment for the slot that asked (an image is a few KB);
nothing is pickled per step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np

from envs.isaaclab.client import IsaacLabServer, ServerFault
from envs.isaaclab.wire import FLAG_SUCCESS, FLAG_TERMINATED, FLAG_TRUNCATED
from rlvla3.types import EnvSpec, Observation, StepResult


class ServerSlots:
    """Slot-indexed access to one ``IsaacLabServer``; see the module docstring."""

    def __init__(self, server: IsaacLabServer, spec: EnvSpec, layout_of: Callable[[int], int],
                 variant_of: Callable[[int], int] = int):
        """``layout_of``: initial state id -> the task's layout id (the split); ``variant_of``:
        env task id -> the task's variant."""
        self.server = server
        self.spec = spec
        self.layout_of = layout_of
        self.variant_of = variant_of
        assert server.spec is not None
        self.n = server.spec.num_envs
        self._task: dict[int, int] = {}
        self._born: dict[int, int] = {}
        """Slot -> the server generation its episode started on."""
        self._last: dict[int, Observation] = {}
        self.live: set[int] = set()
        """Slots in an episode: reset, not ended, not held."""
        self._held: set[int] = set()
        """Slots whose sub-env was stepped without their action during their episode."""

    def _observation(self, slot: int) -> Observation:
        layout = self.server.layout
        assert layout is not None and self.server.spec is not None
        images = {cam: layout.image(cam)[slot].copy() for cam in self.spec.cameras}
        return Observation(images=images, state=layout["state"][slot].copy(),
                           instruction=self.server.spec.instructions[self._task[slot]])

    def reset(self, slot: int, task_id: int, init_state_id: int) -> Observation:
        variant = self.variant_of(task_id)
        assert self.server.spec is not None
        if not 0 <= variant < len(self.server.spec.instructions):
            raise IndexError(f"task_id {task_id} out of range "
                             f"0..{len(self.server.spec.instructions) - 1}")
        self.server.reset([slot], [variant], [self.layout_of(init_state_id)])
        self._task[slot] = variant
        self._born[slot] = self.server.generation
        self._last[slot] = self._observation(slot)
        self.live.add(slot)
        self._held.discard(slot)
        return self._last[slot]

    def leave(self, slot: int) -> None:
        """The slot's env is closed: it is in no episode any more."""
        self.live.discard(slot)

    def _fault(self, slot: int, why: str) -> StepResult:
        return StepResult(self._last[slot], 0.0, False, True, False, 0, fault=why)

    def step(self, chunks: Mapping[int, np.ndarray]) -> dict[int, StepResult]:
        """Execute an action chunk on each slot in ``chunks``; the others hold (and a slot in
        an episode among them is truncated on its next step, see the module docstring)."""
        out = self._lost(chunks)
        slots = sorted(s for s in chunks if s not in out)
        if slots:
            self._held |= self.live - set(slots)
            out.update(self._step(slots, chunks))
        for s, result in out.items():
            if result.terminated or result.truncated:
                self.live.discard(s)
                self._held.discard(s)
        self.live -= self._held
        return out

    def _lost(self, chunks: Mapping[int, np.ndarray]) -> dict[int, StepResult]:
        """Fault results for the slots in ``chunks`` whose episode cannot go on."""
        out = {}
        for s in chunks:
            if self._born.get(s) != self.server.generation:
                out[s] = self._fault(s, "Isaac Lab server restarted during the episode")
            elif s in self._held:
                out[s] = self._fault(s, "held past the gather window (env.options."
                                        "gather_timeout_s): the simulator stepped its sub-env "
                                        "without its action, the episode cannot go on")
        return out

    def _step(self, slots: list[int], chunks: Mapping[int, np.ndarray]
              ) -> dict[int, StepResult]:
        """One batched server step for ``slots``."""
        out: dict[int, StepResult] = {}
        assert self.server.layout is not None
        actions = self.server.layout["actions"]
        actions[:] = 0.0
        for s in slots:
            chunk = np.asarray(chunks[s], dtype=np.float32).reshape(-1, actions.shape[-1])
            actions[: len(chunk), s] = chunk[: actions.shape[0]]
        try:
            self.server.step(slots)
        except ServerFault as fault:
            return {s: self._fault(s, str(fault)) for s in slots}
        layout = self.server.layout
        assert layout is not None
        for s in slots:
            flags = layout["flags"][s]
            self._last[s] = self._observation(s)
            out[s] = StepResult(
                obs=self._last[s],
                reward=float(layout["reward"][s]),
                terminated=bool(flags[FLAG_TERMINATED]),
                truncated=bool(flags[FLAG_TRUNCATED]),
                success=bool(flags[FLAG_SUCCESS]),
                steps=int(layout["steps"][s]),
            )
        return out

    def close(self) -> None:
        self.server.close()


class LockstepSlots:
    """Lets slot threads step one ``ServerSlots`` together, one batched step per round."""

    def __init__(self, batch: ServerSlots, gather_timeout_s: float):
        self.batch = batch
        self.timeout = gather_timeout_s
        self.cond = threading.Condition()
        self.pending: dict[int, np.ndarray] = {}
        self.results: dict[int, StepResult] = {}
        self.attached = 0
        self.closed = 0

    def reset(self, slot: int, task_id: int, init_state_id: int) -> Observation:
        with self.cond:
            obs = self.batch.reset(slot, task_id, init_state_id)
            self.cond.notify_all()
            return obs

    def step(self, slot: int, chunk: np.ndarray) -> StepResult:
        with self.cond:
            self.pending[slot] = chunk
            self.cond.notify_all()
            self.cond.wait_for(
                lambda: slot in self.results or self.batch.live <= set(self.pending),
                timeout=self.timeout,
            )
            if slot not in self.results:  # this thread runs the round for everyone waiting
                round_ = dict(self.pending)
                self.pending.clear()
                self.results.update(self.batch.step(round_))
                self.cond.notify_all()
            return self.results.pop(slot)


class IsaacLabSlot:
    """One env slot of a shared Isaac Lab server (an ``Env``)."""

    def __init__(self, lockstep: LockstepSlots, slot: int):
        self.lockstep = lockstep
        self.slot = slot
        self.spec = lockstep.batch.spec

    @property
    def restarts(self) -> int:
        """Server restarts so far (shared by the slots of one server)."""
        return self.lockstep.batch.server.restarts

    @property
    def pid(self) -> int | None:
        return self.lockstep.batch.server.pid

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        return self.lockstep.reset(self.slot, task_id, init_state_id)

    def step(self, actions: np.ndarray) -> StepResult:
        return self.lockstep.step(self.slot, actions)

    def describe(self) -> dict:
        return self.lockstep.batch.server.describe()

    def close(self) -> None:
        with self.lockstep.cond:
            self.lockstep.batch.leave(self.slot)
            self.lockstep.closed += 1
            last = self.lockstep.closed == self.lockstep.attached
        if last:
            self.lockstep.batch.close()


def slots_over(batch: ServerSlots, gather_timeout_s: float) -> list[IsaacLabSlot]:
    """All slot views over one ``ServerSlots`` (tools and tests)."""
    lockstep = LockstepSlots(batch, gather_timeout_s)
    lockstep.attached = batch.n
    return [IsaacLabSlot(lockstep, i) for i in range(batch.n)]
