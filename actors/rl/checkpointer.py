"""When an RL run saves its state, and what a resumed run restores beside the learner's.

``Checkpointer`` saves the learners' weights, optimizer state and counters every
``checkpoint_every`` versions and on demand, with each env worker's episode sampler state, so
that ``restore_samplers`` lets a resumed run continue its episode sequence: each task's pass over
its initial states and the task shares go on where they stood, instead of starting again from
the seed and repeating the scenes the run has already trained on. A worker that does not answer
within ``SAMPLER_TIMEOUT_S`` (lost with its node) is saved as None and resumes on a new sequence.
Episodes in flight at the save are not run again on resume. Checkpoints go to the run's storage
(a local path or URI): whole from learner 0 (DDP, one rank), or sharded from every rank at once
(FSDP: each rank writes its shard from its own node; the learner's ``checkpoint_format``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import ray

from rlvla3.checkpoint.files import SavedCheckpoint

SAMPLER_TIMEOUT_S = 10.0


class Checkpointer:
    """Saves learner 0's state every ``every`` versions and on demand; never twice for the same
    version and counters (the final eval's snapshot is the final checkpoint).

    A periodic save runs in the background: the learner pauses only to copy its state, and
    writes (uploads) the copy while it trains on; the run does not wait for it. The next save
    is not started while one is still being written (it is tried at the next tick), and a
    forced save (the final one, one an evaluation needs) waits for both. A background save that
    fails (storage unreachable) is reported and the run goes on; ``latest`` still names the
    last complete checkpoint."""

    def __init__(self, learners: list, workers: list, run_dir: str, every: int, version: int,
                 log: Callable[[str], None] = print):
        self._group(learners)
        self.workers = workers
        self.run_dir = run_dir
        self.every = every
        self.log = log
        self._last_version = version
        self._saved: tuple[int, dict, str] | None = None
        self._pending: tuple[int, dict, ray.ObjectRef] | None = None
        self._others: list[ray.ObjectRef] = []
        """The other ranks' calls of a sharded save."""
        self.written: list[SavedCheckpoint] = []
        self.failed: list[str] = []
        self.pinned: Callable[[], list[str]] = list
        """The checkpoints a reader still loads (the periodic evaluation's): never pruned."""

    def _group(self, learners: list) -> None:
        """The ranks a save asks: every rank for a sharded checkpoint, else rank 0."""
        self.learner0 = learners[0]
        sharded = ray.get(self.learner0.checkpoint_format.remote()) == "sharded"
        self.savers = list(learners) if sharded else [self.learner0]

    def rolled_back(self, learners: list, version: int) -> None:
        """The group was rebuilt from the checkpoint at ``version``: count from there, with the
        group's new ranks."""
        self._group(learners)
        self._last_version = version
        self._saved = None

    def save(self, counters: dict, force: bool = False) -> str | None:
        """Start a save when one is due (``force``: now, and wait for it); returns the
        checkpoint's location once written, else None."""
        version = ray.get(self.learner0.version.remote())
        if self._saved and self._saved[:2] == (version, counters):
            return self._saved[2]
        self._collect(wait=force)
        if not (force or (self.every and version - self._last_version >= self.every)):
            return None
        if self._pending is not None:  # still writing the previous one: try at the next tick
            return None
        samplers, pinned = sampler_states(self.workers), self.pinned()
        refs = [lr.save.remote(self.run_dir, dict(counters), samplers, pinned)
                for lr in self.savers]
        ref = refs[0]
        self._others = refs[1:]
        self._last_version = version
        self._pending = (version, dict(counters), ref)
        if not force:
            return None
        self._collect(wait=True, strict=True)
        assert self._saved is not None  # a strict collect of the pending save sets it or raises
        return self._saved[2]

    def _collect(self, wait: bool, strict: bool = False) -> None:
        """Take the result of the save being written, if it is done (``wait``: wait for it;
        ``strict``: a failed save raises, else it is reported)."""
        if self._pending is None:
            return
        version, counters, ref = self._pending
        if not wait and not ray.wait([ref], timeout=0)[0]:
            return
        self._pending = None
        try:
            saved: SavedCheckpoint = ray.get(ref)
            ray.get(self._others)  # every rank's shard is written (rank 0 waited for them)
        except (ray.exceptions.RayError, OSError) as exc:
            self.failed.append(f"v{version}: {str(exc).splitlines()[0][:200]}")
            self.log(f"warning: the checkpoint at v{version} was not written "
                     f"({self.failed[-1]}); the last complete one stays the latest")
            if strict:
                raise
            return
        self._saved = (version, counters, saved.path)
        self.written.append(saved)
        self.log(f"checkpoint v{saved.version}: {saved.path} ({saved.bytes / 2**20:.1f} MB; "
                 f"learner paused {saved.pause_s * 1000:.0f} ms, written in "
                 f"{saved.write_s:.2f}s while it trained)")

    def summary(self) -> dict:
        """Checkpoints written this leg, and what they cost."""
        self._collect(wait=True)
        pauses = [c.pause_s for c in self.written]
        writes = [c.write_s for c in self.written]
        return {"written": len(self.written), "failed": self.failed,
                "latest": self._saved[2] if self._saved else None,
                "mb": round(self.written[-1].bytes / 2**20, 2) if self.written else None,
                "pause_s_median": round(statistics.median(pauses), 4) if pauses else None,
                "pause_s_max": round(max(pauses), 4) if pauses else None,
                "write_s_median": round(statistics.median(writes), 3) if writes else None}


def sampler_states(workers: list) -> list[dict | None]:
    """Each env worker's sampler state; None for one that does not answer in time."""
    refs = [w.sampler_state.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SAMPLER_TIMEOUT_S)
    states: list[dict | None] = []
    for ref in refs:
        try:
            states.append(ray.get(ref) if ref in ready else None)
        except ray.exceptions.RayError:
            states.append(None)
    return states


def restore_samplers(workers: list, saved: list, salt: int) -> int:
    """Give each env worker the sampler state a checkpoint saved for it; workers without one
    (a checkpoint from before these were saved, more workers than then, a worker lost at the
    save) start new sequences salted by ``salt``. Returns how many continued their sequence."""
    return sum(ray.get([w.restore_sampler.remote(saved[i] if i < len(saved) else None, salt)
                        for i, w in enumerate(workers)]))
