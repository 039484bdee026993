"""Pure parts of an RL run's ``summary.json``: figures computed from the final snapshot.

Input: the monitor's last snapshot of every role's record (``rlvla3.role_stats``), the
pre-flight memory estimate, the run config. Output: summary fields: the batch-size histogram over all rollout
servers, estimated against measured peak memory per role, where LIBERO training episodes
started, the learner group's strategy and ranks (``learner_group``, and ``learner_line`` for
the console); and ``trained_nothing``, the line a run that ended without an optimizer step ends
with. Nothing here talks to Ray or writes a file; the controller assembles the summary.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.runtime.process_memory import ProcessMemory
from rlvla3.role_stats import Role, RolloutServerStats, Snapshot
from rlvla3.run_config import RunConfig
from rlvla3.types import EnvSpec


def batch_size_hist(servers: Iterable[RolloutServerStats]) -> dict[int, int]:
    """How many batches each rollout-server batch size had, over all servers."""
    sizes: dict[int, int] = {}
    for s in servers:
        for k, v in s.batch_sizes.items():
            sizes[int(k)] = sizes.get(int(k), 0) + v
    return dict(sorted(sizes.items()))


def memory_report(estimated: dict[str, float], snap: Snapshot) -> dict:
    """The pre-flight estimate next to the peak RSS each role measured (MB; own process
    plus children such as simulator processes), and their ratio."""
    def peak(stats: Iterable[Role]) -> float:
        return round(sum(s.memory.total_peak_mb for s in stats), 1)

    measured = {"learner": peak(snap.learners), "rollout": peak(snap.servers),
                "env": peak(snap.workers),
                "driver": ProcessMemory().sample().rss_peak_mb}  # its children are Ray's
    return {"estimated_mb": {k: round(v, 1) for k, v in estimated.items()},
            "measured_peak_mb": measured,
            "ratio": {k: round(estimated[k] / v, 3) for k, v in measured.items()
                      if v and estimated.get(k)}}


STRATEGY_WORDS = {
    "single": "one rank: the whole model, no process group",
    "ddp": "DDP: each rank holds the whole model, gradients all-reduced",
    "fsdp": "FSDP2: weights, gradients and Adam state sharded over the ranks, sharded "
            "checkpoints",
}
"""What each learner engine (``rlvla3.engine``) is, in words."""


def learner_sharding(cfg: RunConfig, ranks: int) -> str:
    """The engine ``ranks`` learner ranks run (``learner.sharding`` resolved by the
    pre-flight; one rank: ``single``)."""
    return "single" if ranks == 1 else cfg.learner.sharding


def learner_line(cfg: RunConfig) -> str:
    """The console line that says how the learners train."""
    n = cfg.learner.num_learners
    strategy = learner_sharding(cfg, n)
    extra = ", host offload" if strategy == "fsdp" and cfg.learner.offload else ""
    return (f"learners: {n} rank{'' if n == 1 else 's'}, {strategy} ({STRATEGY_WORDS[strategy]}"
            f"{extra}; learner.sharding)")


def learner_group(cfg: RunConfig, ranks: int, engines: Iterable[str], rebuilds: list[dict]
                  ) -> dict:
    """``summary.json``'s ``learner_group``: the engine the ranks report running (the
    configured one until a rank has published weights), their number, rebuilds."""
    running = sorted({e for e in engines if e})
    return {"strategy": running[0] if len(running) == 1 else learner_sharding(cfg, ranks),
            "ranks": ranks, "offload": cfg.learner.offload, "rebuilds": rebuilds}


def split_note(cfg: RunConfig) -> dict:
    """LIBERO: where training episodes started and whether they overlap evaluation's."""
    if cfg.env.name != "libero":
        return {}
    from envs.libero.split import split_note as libero_split_note

    return {"split": libero_split_note(cfg.env, cfg.env_workers.init_state_ids)}


def trained_nothing(summary: dict, cfg: RunConfig, spec: EnvSpec) -> str:
    """Empty when this leg of the run trained and its weights moved; otherwise one line that
    says why not (a run that ends with it exits 1):

    - no optimizer step: what the run produced and what the first step needs,
      ``learner.global_batch`` decisions of finished episodes and, under GRPO, whole groups of
      ``algo.group_size`` episodes of up to ``spec.max_decisions x chunk_len`` env steps each;
      when every complete GRPO group was uniform (every member failed or every one succeeded,
      skipped under ``algo.skip_uniform_groups``) it says so with the count, since a larger
      budget would not change that;
    - steps taken but ``weights_moved`` (measured from ``init_from``) is 0: the weights are
      the ones the run started from, with the reason where the steps show it (every decision
      without a gradient: advantages of exactly 0)."""
    leg = summary.get("this_leg", {})
    if leg.get("trained_decisions", summary.get("trained_decisions", 0)):
        return _unmoved(summary)
    steps, episodes = leg.get("env_steps", summary.get("env_steps", 0)), leg.get("episodes", 0)
    stopped = (f"{steps} env steps ({episodes} episode{'' if episodes == 1 else 's'} finished; "
               f"stopped by {summary.get('stopped_by')})")
    groups = summary.get("groups", {})
    uniform, received = groups.get("uniform_skipped", 0), groups.get("received", 0)
    if cfg.algo.name == "grpo" and uniform and not received:
        return (f"trained nothing: all {uniform} GRPO group{'' if uniform == 1 else 's'} of "
                f"{cfg.algo.group_size} that completed in {stopped} were uniform (every member "
                f"failed or every one succeeded) and skipped (algo.skip_uniform_groups: equal "
                f"returns leave no advantage to learn from); its last checkpoint holds the "
                f"weights it started from: start from a policy that succeeds on some episodes "
                f"(init_from), or raise algo.group_size or algo.redraw_rounds (now "
                f"{cfg.algo.redraw_rounds}: more episodes of a uniform group's key)")
    longest = spec.max_decisions * spec.chunk_len
    need = f"learner.global_batch={cfg.learner.global_batch} decisions of finished episodes"
    if cfg.algo.name == "grpo":
        need += (f" in whole GRPO groups of {cfg.algo.group_size} episodes (up to "
                 f"{cfg.algo.group_size * longest} env steps a group, episodes of up to "
                 f"{longest})")
    else:
        need += f" (episodes of up to {longest} env steps)"
    skipped = (f"; {uniform} uniform GRPO group{'' if uniform == 1 else 's'} skipped"
               if uniform else "")
    return (f"trained nothing: no optimizer step in {stopped}{skipped}, so its last checkpoint "
            f"holds the weights it started from; the first step needs {need}: raise "
            f"total_env_steps or max_minutes")


def _unmoved(summary: dict) -> str:
    """The line of a run whose optimizer steps left the weights where ``init_from`` put them
    (``weights_moved`` 0 at its 7 decimals), else empty."""
    if summary.get("weights_moved") != 0:  # None: not measured (no init_from, or killed)
        return ""
    objective = summary.get("objective", {})
    no_grad = objective.get("no_grad_fraction", {}).get("p10")
    why = (": every decision of every step gave no gradient (advantages of exactly 0, as GRPO "
           "groups whose members all failed or all succeeded have; algo.skip_uniform_groups: "
           "true leaves them out)" if no_grad is not None and no_grad >= 1.0 else
           ": check learner.lr and the steps' grad_norm in steps.jsonl")
    return (f"the weights did not move: {objective.get('steps', 0)} optimizer steps (to version "
            f"{summary.get('policy_version')}) left them where init_from put them "
            f"(weights_moved 0){why}")


def groups_by_task_line(summary: dict) -> str:
    """One line: each task's settled GRPO groups, mixed / all failed / all succeeded (empty
    without GRPO groups); a task with none mixed gave the updates nothing but an anchor."""
    rows = summary.get("groups", {}).get("by_task", {})
    if not rows:
        return ""
    cells = [f"{task} {r['mixed']}/{r['all_failed']}/{r['all_succeeded']}"
             for task, r in rows.items()]
    barren = [task for task, r in rows.items() if not r["mixed"]]
    tail = f"; no mixed group: task{'s' if len(barren) > 1 else ''} {', '.join(barren)}" \
        if barren else ""
    return f"GRPO groups by task (mixed/all failed/all succeeded): {', '.join(cells)}{tail}"

