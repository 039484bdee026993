"""Periodic evaluation during an RL run, beside rollout and training (never pausing them).

Every ``eval_every`` policy versions the controller hands this collaborator a checkpoint path;
it evaluates that snapshot deterministically on ``eval_init_state_ids`` of every training task
in its own actor, and a later tick collects the result. At the end of a run the final policy is
evaluated too, unless that version already was, so a short run always reports one.

Output per evaluation: ``{"version", "episodes", "success_rate", "wall_s"}`` appended to
``results``, logged, and written to TensorBoard by the caller.
"""

from __future__ import annotations

import time

import ray

from rlvla3.run_config import RunConfig


class PeriodicEval:
    """At most one evaluation in flight; results in ``results``."""

    def __init__(self, cfg: RunConfig, num_tasks: int):
        self.cfg = cfg
        self.tasks = list(cfg.env_workers.task_ids) or list(range(num_tasks))
        self.results: list[dict] = []
        self._running: tuple | None = None
        self._last_version = 0

    def due(self, version: int, final: bool = False) -> bool:
        cfg = self.cfg
        step = 1 if final else cfg.eval_every
        return bool(cfg.eval_every and cfg.eval_init_state_ids and self._running is None
                    and version - self._last_version >= step)

    def start(self, version: int, checkpoint: str) -> None:
        """Evaluate the snapshot at ``checkpoint`` (of ``version``) in a new actor."""
        from actors.eval_worker import ActionSource, EvalWorker

        worker = ray.remote(EvalWorker).options(num_cpus=0).remote(
            self.cfg.env, ActionSource("checkpoint", checkpoint), self.cfg.seed)
        refs = [worker.run_episode.remote(t, s) for t in self.tasks
                for s in self.cfg.eval_init_state_ids]
        self._running = (version, worker, refs, time.monotonic())
        self._last_version = version

    def collect(self, wait_s: float = 0.0) -> dict | None:
        """The finished evaluation's result, or None while it runs (or when none does)."""
        if self._running is None:
            return None
        version, worker, refs, started = self._running
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) < len(refs):
            return None
        outcomes = ray.get(refs)
        ray.kill(worker)
        self._running = None
        result = {"version": version, "episodes": len(outcomes),
                  "success_rate": sum(o.success for o in outcomes) / len(outcomes),
                  "wall_s": round(time.monotonic() - started, 1)}
        self.results.append(result)
        return result

    def cancel(self) -> None:
        if self._running is not None:
            ray.kill(self._running[1])
            self._running = None
