"""The evaluation protocol as a reusable piece: episodes of one policy spread over eval workers.

Role: ``rlvla3 eval`` and periodic evaluation during RL runs evaluate the same way, through
this module:

- ``protocol_env(env, placements)``: the env options evaluation uses: the benchmark's own
  evaluation states (LIBERO's bundled initial states, MetaWorld's and Isaac Lab's test split)
  whatever the training env samples, or the training distribution when an evaluation asks for
  it (``rlvla3 eval --placements fresh``).
- ``protocol_jobs(num_tasks, init_ids)``: the (env task, initial state) episodes, state-major
  (every task's state 0, then every task's state 1, ...), so a partial evaluation covers all
  tasks evenly.
- ``make_eval_workers(env, n, seed, placements=..., numerics=...)``: ``EvalWorker`` actors on
  ``protocol_env(env, placements)``, their processes started with the environment of
  ``numerics`` (``pinned`` by default: neither the policy's arithmetic nor the simulator's
  linear algebra depends on the host CPU, ``rlvla3.numerics``).
- ``EvalRound(workers, jobs, checkpoint)``: hands each free worker its next episode and never
  blocks: ``poll(timeout_s)`` returns the episodes finished since the last call, ``done``
  says when all have. A worker that is lost (killed for memory, crashed, its node gone) costs
  no episode: it is replaced (when the round can spawn workers) and its episode runs again,
  up to ``retries`` times, before the episode is recorded with ``fault``; an episode's
  outcome is never decided by the infrastructure while it can still run. A worker whose
  constructor raised (a checkpoint that does not load) is not lost but could never run:
  the round stops with ``EvalSetupError`` before any episode is counted. A worker stays on the task it just ran while that task's next episode is at most
  ``lead_states`` initial states ahead of the queue (``next_job``): changing task builds
  another simulator (a reset takes 5.2 s here instead of 2.8 s), and state-major order would
  otherwise change task at every episode.
- ``summarise(outcomes, tasks)``: per task and for the suite, successes with Wilson 95%
  intervals (``rlvla3.confidence``) over the episodes that ran to their end, the faults apart, and
  each episode's outcome.
- ``evaluate_checkpoint(...)``: the blocking form of the above, returning ``summarise``'s dict.

Invariant: an episode is identified by (suite task, initial state); ``summarise`` keys tasks by
their *suite* task id, so results of different runs pair up for ``rlvla3 eval --compare``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.eval.worker import ActionSource, EpisodeOutcome, EvalWorker
from rlvla3.confidence import rate
from rlvla3.config import Named
from rlvla3.numerics import PINNED_BLAS

Job = tuple[int, int]
"""(env task id, initial state id)."""


def protocol_env(env: Named, placements: str = "bundled") -> Named:
    """``env`` as evaluation runs it: on its evaluation states (LIBERO's bundled ones,
    MetaWorld's and Isaac Lab's test split; ``envs.eval_env``), or on ``placements``."""
    from envs import eval_env

    return eval_env(env, placements)


def protocol_jobs(num_tasks: int, init_ids: Sequence[int]) -> list[Job]:
    """Every (task, initial state) pair, state-major."""
    return [(t, k) for k in init_ids for t in range(num_tasks)]


def next_job(queue: Sequence[Job], last_task: int | None, lead: int,
             rank: Mapping[int, int]) -> int:
    """Index in ``queue`` (state-major, ``rank``: initial state -> its place in that order) of
    the episode a worker that last ran ``last_task`` takes next: the first one of that task at
    most ``lead`` states after the queue's first episode, else the first episode."""
    if last_task is not None and queue:
        limit = rank[queue[0][1]] + lead
        for i, (task, state) in enumerate(queue):
            if rank[state] > limit:
                break
            if task == last_task:
                return i
    return 0


def make_eval_workers(
    env: Named, n: int, seed: int = 0, num_cpus: float = 1.0, source: ActionSource | None = None,
    placements: str = "bundled", numerics: str = "pinned", blas: str = PINNED_BLAS,
) -> list[Any]:
    """``n`` ``EvalWorker`` actors on ``protocol_env(env, placements)`` (simulators start in
    the actors), in processes started for ``numerics`` (with NumPy's ``blas`` kernels when
    pinned)."""
    import ray

    from rlvla3.numerics import env_vars

    remote = ray.remote(num_cpus=num_cpus)(EvalWorker).options(
        runtime_env={"env_vars": env_vars(numerics, blas)})
    source = source or ActionSource("random")
    scenes = protocol_env(env, placements)
    return [remote.remote(scenes, source, seed + w, numerics=numerics, blas=blas)
            for w in range(n)]


class EvalRound:
    """Episodes ``jobs`` on ``workers``, one at a time per worker; see the module docstring."""

    def __init__(
        self,
        workers: Sequence[Any],
        jobs: Sequence[Job],
        checkpoint: str | None = None,
        record: frozenset[Job] | set[Job] = frozenset(),
        lead_states: int = 4,
        spawn: Callable[[], Any] | None = None,
        retries: int = 2,
        trace: bool = False,
    ):
        """``record``: episodes that return their frames; ``trace``: every episode returns its
        per-decision trace (``actors.eval.trace``). ``lead_states``: how many initial states a
        worker may run ahead of the queue on the task it is on (0: strictly in ``jobs`` order).
        ``spawn``: makes a worker to replace one that was lost (killed for memory, crashed, its
        node gone); ``retries``: how often an episode whose worker was lost runs again before it
        is recorded as a fault."""
        self.queue = list(jobs)
        self._spawn = spawn
        self._retries = retries
        self._lost: dict[Job, int] = {}
        """Times each episode's worker was lost under it."""
        self.replaced = 0
        """Workers spawned to replace lost ones."""
        self._source = None if checkpoint is None else ActionSource("checkpoint", checkpoint)
        self._lead = lead_states
        self._rank = {state: i for i, state in enumerate(dict.fromkeys(k for _, k in jobs))}
        self._last_task: dict[Any, int] = {}
        self.total = len(self.queue)
        self.record = set(record)
        self.trace = trace
        self.outcomes: list[EpisodeOutcome] = []
        self.started = time.perf_counter()
        self._pending: dict[Any, tuple[Any, Job]] = {}
        self.workers = list(workers)
        self._swaps: dict[Any, Any] = {}
        for worker in self.workers:
            self._start(worker)

    def _start(self, worker: Any) -> None:
        if self._source is not None:  # actor calls run in order: the swap precedes episodes
            self._swaps[worker] = worker.set_source.remote(self._source)
        self._submit(worker)

    def _lose(self, worker: Any, job: Job, exc: Exception) -> EpisodeOutcome | None:
        """``worker`` is gone: replace it when a spawner is given, and run ``job`` again
        (None) until it has lost ``retries`` workers, then record it as a fault. A worker
        whose constructor raised was never there: ``EvalSetupError``, nothing recorded."""
        if getattr(exc, "actor_init_failed", False):
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise EvalSetupError(f"an eval worker could not start: {lines[-1]}")
        self.workers.remove(worker)
        self._swaps.pop(worker, None)
        lost = self._lost[job] = self._lost.get(job, 0) + 1
        if lost <= self._retries:
            self.queue.insert(0, job)
        if self._spawn is not None and self.replaced < 2 * self.total + 2:
            self.replaced += 1
            replacement = self._spawn()
            self.workers.append(replacement)
            self._start(replacement)
        busy = {w for w, _ in self._pending.values()}
        for idle in [w for w in self.workers if w not in busy]:
            self._submit(idle)
        if lost <= self._retries:
            return None
        return _fault(*job, f"eval worker lost {lost} times: {type(exc).__name__}")

    def _submit(self, worker: Any) -> None:
        if self.queue:
            job = self.queue.pop(
                next_job(self.queue, self._last_task.get(worker), self._lead, self._rank))
            self._last_task[worker] = job[0]
            ref = worker.run_episode.remote(*job, job in self.record, self.trace)
            self._pending[ref] = (worker, job)

    @property
    def done(self) -> bool:
        return not self._pending and not self.queue

    def poll(self, timeout_s: float = 0.0, before_next: Any = None) -> list[EpisodeOutcome]:
        """Episodes finished within ``timeout_s`` (0: only those already done).

        ``before_next(worker, outcome)``, if given, runs before the worker gets its next
        episode (e.g. to ask the worker something while it is idle)."""
        import ray

        if not self._pending:
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=timeout_s)
        lost_kinds = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError,
                      ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)
        finished = []
        for ref in ready:
            worker, (task_id, init_id) = self._pending.pop(ref)
            if worker in self._swaps:  # it ran before the episode: a bad checkpoint raises here
                try:
                    ray.get(self._swaps.pop(worker))
                except lost_kinds:
                    pass  # the episode's own result says the worker was lost
            try:
                outcome: EpisodeOutcome = ray.get(ref)
            except lost_kinds as exc:
                lost = self._lose(worker, (task_id, init_id), exc)
                if lost is not None:
                    finished.append(lost)
                continue
            except ray.exceptions.RayTaskError as exc:  # e.g. a reset that kept failing
                outcome = _fault(task_id, init_id, str(exc).strip().splitlines()[-1])
            finished.append(outcome)
            if before_next is not None:
                before_next(worker, outcome)
            self._submit(worker)
        if not self.workers and self.queue:
            finished += [_fault(t, k, "no eval worker left") for t, k in self.queue]
            self.queue.clear()
        self.outcomes += finished
        return finished

    def wait(self) -> list[EpisodeOutcome]:
        """Block until every episode has finished; returns all outcomes."""
        while not self.done:
            self.poll(timeout_s=1.0)
        return self.outcomes

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


def _fault(task_id: int, init_id: int, why: str) -> EpisodeOutcome:
    return EpisodeOutcome(task_id, init_id, False, 0, 0, 0.0, "", fault=why)


def episode_row(outcome: EpisodeOutcome, suite_task: int) -> dict[str, Any]:
    """One episode as results store it (keyed by suite task and initial state)."""
    row: dict[str, Any] = {
        "task": suite_task,
        "init_state": outcome.init_state_id,
        "success": bool(outcome.success),
        "steps": outcome.steps,
        "instruction": outcome.instruction,
    }
    if outcome.fault:
        row["fault"] = outcome.fault
    if outcome.digest:
        row["digest"] = outcome.digest
    return row


def summarise_rows(rows: Sequence[dict[str, Any]], tasks: Sequence[int]) -> dict[str, Any]:
    """Per task (suite ids ``tasks``) and overall success with Wilson intervals, over the
    episodes that ran to their end: an episode a fault ended (a lost worker, a crashed
    simulator) says nothing about the policy, so it is counted in ``faults`` and listed in
    ``by_init_state`` with its ``fault``, never as a failure."""
    per_task: dict[str, dict[str, Any]] = {}
    for task in tasks:
        mine = sorted((r for r in rows if r["task"] == task), key=lambda r: r["init_state"])
        ended = [r for r in mine if not r.get("fault")]
        per_task[str(task)] = {
            "instruction": next((r["instruction"] for r in mine if r["instruction"]), ""),
            **rate(sum(r["success"] for r in ended), len(ended)),
            "faults": len(mine) - len(ended),
            "by_init_state": [
                {k: r[k] for k in ("init_state", "success", "steps", "fault", "digest") if k in r}
                for r in mine
            ],
        }
    counted = [r for r in rows if r["task"] in set(tasks)]
    ended = [r for r in counted if not r.get("fault")]
    rates = [row["success_rate"] for row in per_task.values() if row["episodes"]]
    return {
        "tasks": per_task,
        **rate(sum(r["success"] for r in ended), len(ended)),
        "mean_task_success": sum(rates) / len(rates) if rates else 0.0,
        "env_steps": sum(r["steps"] for r in counted),
        "faults": len(counted) - len(ended),
    }


class EvalSetupError(RuntimeError):
    """An eval worker could not be built (its constructor raised: a checkpoint that does not
    load, an env option the simulator refuses). Building it again fails the same way, so the
    round stops with this error instead of counting its episodes as faults."""


def summarise(outcomes: Sequence[EpisodeOutcome], tasks: Sequence[int]) -> dict[str, Any]:
    """``summarise_rows`` of outcomes whose ``task_id`` indexes ``tasks``."""
    return summarise_rows([episode_row(o, tasks[o.task_id]) for o in outcomes], tasks)


def evaluate_checkpoint(
    workers: Sequence[Any],
    checkpoint: str,
    tasks: Sequence[int],
    init_ids: Sequence[int],
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on every (task, state) episode and summarise (blocking).

    ``tasks``: the suite task ids the workers' env serves, in its order; ``init_ids``:
    bundled initial states. The dict also holds ``seconds`` (wall time of the round)."""
    round_ = EvalRound(workers, protocol_jobs(len(tasks), init_ids), checkpoint)
    outcomes = round_.wait()
    return {**summarise(outcomes, tasks), "seconds": round(round_.seconds, 1)}
