"""Periodic evaluation during an RL run, beside rollout and training (never pausing them).

Every ``eval_every`` policy versions the controller hands this collaborator a checkpoint path;
it evaluates that snapshot with the evaluation protocol of ``rlvla3 eval`` (``actors.eval.rounds``:
deterministic actions, LIBERO on its bundled initial states whatever the training env samples)
on ``eval_init_state_ids`` of every training task, in its own eval workers, and a later tick
collects the result. At the end of a run the final policy is evaluated too, unless that version
already was, so a short run always reports one.

Output per evaluation, appended to ``results``: ``version``, ``episodes``, ``success_rate``
with its Wilson 95% interval ``ci95``, per-task rates, and its cost: ``wall_s`` (beside the
run, not added to it) and the ``env_steps`` the evaluation itself simulated.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from rlvla3.config import Named
from rlvla3.run_config import RunConfig

if TYPE_CHECKING:
    from actors.eval.rounds import EvalRound


def suite_task_ids(env: Named, num_tasks: int) -> list[int]:
    """The benchmark's own ids of the env's tasks, in the env's order (LIBERO selects tasks of
    a suite with ``task_ids``; other envs number theirs from 0)."""
    ids = env.options.get("task_ids") if env.name == "libero" else None
    return list(ids) if ids else list(range(num_tasks))


class PeriodicEval:
    """At most one evaluation in flight; results in ``results``."""

    def __init__(self, cfg: RunConfig, num_tasks: int):
        self.cfg = cfg
        self.tasks = list(cfg.env_workers.task_ids) or list(range(num_tasks))
        self.suite_ids = suite_task_ids(cfg.env, num_tasks)
        self.results: list[dict] = []
        self._workers: list | None = None
        self._running: EvalRound | None = None
        self._checkpoint = ""
        self._version = 0
        self._last_version = 0

    def due(self, version: int, final: bool = False) -> bool:
        cfg = self.cfg
        step = 1 if final else cfg.eval_every
        return bool(cfg.eval_every and cfg.eval_init_state_ids and self._running is None
                    and version - self._last_version >= step)

    def start(self, version: int, checkpoint: str) -> None:
        """Evaluate the snapshot at ``checkpoint`` (of ``version``) on the eval workers."""
        from actors.eval.rounds import EvalRound, make_eval_workers

        if self._workers is None:
            self._workers = make_eval_workers(self.cfg.env, self.cfg.eval_workers, self.cfg.seed,
                                              num_cpus=0)
        jobs = [(t, k) for k in self.cfg.eval_init_state_ids for t in self.tasks]
        self._running = EvalRound(self._workers, jobs, checkpoint)
        self._checkpoint = checkpoint
        self._version = version
        self._last_version = version

    def reading(self) -> list[str]:
        """The checkpoint the evaluation in flight loads (its workers load it as they start),
        which a save must not prune meanwhile."""
        return [self._checkpoint] if self._running is not None else []

    def collect(self, wait_s: float = 0.0) -> dict | None:
        """The finished evaluation's result, or None while it runs (or when none does)."""
        from actors.eval.rounds import summarise

        if self._running is None:
            return None
        deadline = time.monotonic() + wait_s
        self._running.poll(timeout_s=wait_s)
        while not self._running.done and time.monotonic() < deadline:
            self._running.poll(timeout_s=deadline - time.monotonic())
        if not self._running.done:
            return None
        done, self._running = self._running, None
        summary = summarise(done.outcomes, self.suite_ids)
        result = {"version": self._version, "episodes": summary["episodes"],
                  "success_rate": summary["success_rate"], "ci95": summary["ci95"],
                  "tasks": {k: {"success_rate": v["success_rate"], "episodes": v["episodes"]}
                            for k, v in summary["tasks"].items() if v["episodes"]},
                  "faults": summary["faults"], "env_steps": summary["env_steps"],
                  "wall_s": round(done.seconds, 1)}
        self.results.append(result)
        return result

    def cancel(self) -> None:
        """Stop any evaluation and release the eval workers."""
        for worker in self._workers or []:
            ray.kill(worker)
        self._workers, self._running = None, None
