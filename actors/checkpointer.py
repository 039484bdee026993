"""When an RL run saves its state, and what a resumed run restores beside the learner's.

``Checkpointer`` saves learner 0's weights, optimizer state and counters every
``checkpoint_every`` versions and on demand, with each env worker's episode sampler state, so
that ``restore_samplers`` lets a resumed run continue its episode sequence: each task's pass over
its initial states and the task shares go on where they stood, instead of starting again from
the seed and repeating the scenes the run has already trained on. A worker that does not answer
within ``SAMPLER_TIMEOUT_S`` (lost with its node) is saved as None and resumes on a new sequence.
Episodes in flight at the save are not run again on resume.
"""

from __future__ import annotations

from pathlib import Path

import ray

SAMPLER_TIMEOUT_S = 10.0


class Checkpointer:
    """Saves learner 0's state every ``every`` versions and on demand; never twice for the same
    version and counters (the final eval's snapshot is the final checkpoint)."""

    def __init__(self, learner0, workers: list, run_dir: Path, every: int, version: int):
        self.learner0 = learner0
        self.workers = workers
        self.run_dir = run_dir
        self.every = every
        self._last_version = version
        self._saved: tuple[int, dict, str] | None = None

    def rolled_back(self, learner0, version: int) -> None:
        """The group was rebuilt from the checkpoint at ``version``: count from there, with the
        group's new rank 0."""
        self.learner0 = learner0
        self._last_version = version
        self._saved = None

    def save(self, counters: dict, force: bool = False) -> str | None:
        version = ray.get(self.learner0.version.remote())
        if self._saved and self._saved[:2] == (version, counters):
            return self._saved[2]
        if force or (self.every and version - self._last_version >= self.every):
            path = ray.get(self.learner0.save.remote(str(self.run_dir), dict(counters),
                                                     sampler_states(self.workers)))
            self._last_version = version
            self._saved = (version, dict(counters), path)
            return path
        return None


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
