"""The learner group of a run: forms it, and rebuilds it when a rank is lost.

Input: the learner handles (every rank, in rank order) and how long a lost rank may wait for
resources. Output: ``active``, the ranks that train now (rank i = ``active[i]``), and
``rebuilds``, one record per rebuild (what was lost, the version restored, how long it took).

A torch.distributed group cannot take a new member, and a survivor may sit in a collective
that waits on the dead rank for ever (a lost node closes no socket). So a lost rank rebuilds
the whole group: every surviving rank is restarted too (Ray restarts it), every rank restores
the last checkpoint (weights, optimizer state, policy version, RNG) in its constructor, and the
group forms again with a fresh rendezvous. A rank that does not come back within
``wait_s`` (its resources are gone: no node offers them) leaves the group for good; training
goes on with fewer ranks that share each step's ``global_batch`` samples out exactly (64 over
3 ranks: 22, 21, 21; ``rlvla3.learner.core.rank_batches``), each rank's gradient scaled by its share,
so the global batch and the update stay the same. A lone learner needs none of this: Ray restarts it and retries its
``run`` call, and it restores the checkpoint by itself.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.runtime.cluster_state import actor_state

LOSS_ERRORS = (RayActorError, RuntimeError)
"""What a lost rank looks like from the driver: its own calls fail with an actor error, a
survivor's collective with a RuntimeError (gloo: connection closed by peer)."""


class LearnerGroup:
    """The ranks of the learner group (see the module docstring)."""

    def __init__(self, handles: list, names: list[str], queue, wait_s: float):
        self.handles = list(handles)
        self.names = list(names)
        self.queue = queue
        self.wait_s = wait_s
        self.active = list(handles)
        self.rebuilds: list[dict] = []
        self._incarnations: dict[int, str] = {}
        self._rank_of = {i: i for i in range(len(self.handles))}
        """Handle index -> the rank it reports under now (ranks renumber when one leaves)."""

    @property
    def elastic(self) -> bool:
        """Several ranks: a loss needs a rebuild (one rank restarts by itself)."""
        return len(self.handles) > 1

    def form(self, regroup: bool = False) -> None:
        """Open the process group among the active ranks (``regroup``: tell every rank its new
        rank and the group's size)."""
        addr, port = ray.get(self.active[0].address.remote())
        world = len(self.active)
        if regroup:
            ray.get([lr.init_group.remote(addr, port, r, world) for r, lr in enumerate(self.active)])
            self._rank_of = {self.handles.index(lr): r for r, lr in enumerate(self.active)}
        else:
            ray.get([lr.init_group.remote(addr, port) for lr in self.active])
        self._incarnations = {self.handles.index(lr): st.incarnation for lr, st in zip(
            self.active, ray.get([lr.stats.remote() for lr in self.active]), strict=True)}

    def rebuild(self, cause: BaseException | str) -> dict:
        """Restart every rank from the last checkpoint and form the group again, without the
        ranks that cannot come back within ``wait_s``; returns the rebuild's record."""
        start = time.monotonic()
        before = len(self.active)
        for lr in self.active:  # survivors still run their old incarnation: restart them too
            i = self.handles.index(lr)
            if actor_state(lr) == "ALIVE" and self._answers_with(lr, self._incarnations.get(i)):
                ray.kill(lr, no_restart=False)
        back, gone = [], []
        deadline = time.monotonic() + self.wait_s
        for lr in self.active:
            i = self.handles.index(lr)
            if self._comes_back(lr, self._incarnations.get(i), deadline):
                back.append(lr)
            else:
                ray.kill(lr, no_restart=True)  # no resources: leaves the group for good
                gone.append(self.names[i])
                self.queue.learner_buffered.remote(self._rank_of[i], 0)  # it holds nothing now
        if not back:
            raise RuntimeError(f"every learner rank was lost ({', '.join(gone)}) and none came "
                               f"back within {self.wait_s:.0f}s (ray.node_wait_s); cause: {cause}")
        self.active = back
        self.form(regroup=True)
        version = ray.get(self.active[0].version.remote())
        restored = ray.get(self.active[0].stats.remote()).restored_from
        record = {"cause": str(cause).splitlines()[0][:200], "ranks_before": before,
                  "ranks_after": len(back), "left_group": gone, "version": version,
                  "restored_from": restored, "seconds": round(time.monotonic() - start, 1)}
        self.rebuilds.append(record)
        return record

    def lost(self, grace_s: float) -> list[str]:
        """The ranks that are really gone: not alive, or alive as a new incarnation (Ray
        restarted them). A survivor's collective fails as soon as its peer dies, possibly
        before Ray notices the death, so a group that looks whole is watched for ``grace_s``
        before the answer is "none"."""
        deadline = time.monotonic() + grace_s
        while True:
            gone = [self.names[self.handles.index(lr)] for lr in self.active
                    if actor_state(lr) != "ALIVE" or not self._answers_with(
                        lr, self._incarnations.get(self.handles.index(lr)))]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.5)

    @staticmethod
    def _answers_with(lr, incarnation: str | None) -> bool:
        try:
            return ray.get(lr.stats.remote(), timeout=10).incarnation == incarnation
        except (RayActorError, GetTimeoutError):
            return False

    def _comes_back(self, lr, old: str | None, deadline: float) -> bool:
        """Wait until the rank runs a new incarnation (restored in its constructor)."""
        while time.monotonic() < deadline:
            state = actor_state(lr)
            if state == "DEAD":
                return False
            if state == "ALIVE":
                try:
                    if ray.get(lr.stats.remote(), timeout=30).incarnation != old:
                        return True
                except (RayActorError, GetTimeoutError):
                    pass
            time.sleep(0.5)
        return False
