"""Pure parts of an RL run's ``summary.json``: figures computed from the final snapshot.

Input: the monitor's last snapshot of every role's record (``rlvla3.role_stats``), the
pre-flight memory estimate, the run config. Output: summary fields: the batch-size histogram over all rollout
servers, estimated against measured peak memory per role, where LIBERO training episodes
started; and ``trained_nothing``, the line a run that ended without an optimizer step ends
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


def split_note(cfg: RunConfig) -> dict:
    """LIBERO: where training episodes started and whether they overlap evaluation's."""
    if cfg.env.name != "libero":
        return {}
    from envs.libero.split import split_note as libero_split_note

    return {"split": libero_split_note(cfg.env, cfg.env_workers.init_state_ids)}


def trained_nothing(summary: dict, cfg: RunConfig, spec: EnvSpec) -> str:
    """Empty when this leg of the run trained (one optimizer step is enough); otherwise one line
    that says the run trained nothing, what it produced, and what the first optimizer step
    needs: ``learner.global_batch`` decisions of finished episodes and, under GRPO, whole
    groups of ``algo.group_size`` episodes of up to ``spec.max_decisions x chunk_len`` env
    steps each. A budget below that ends with the initial weights in the last checkpoint."""
    leg = summary.get("this_leg", {})
    if leg.get("trained_decisions", summary.get("trained_decisions", 0)):
        return ""
    steps, episodes = leg.get("env_steps", summary.get("env_steps", 0)), leg.get("episodes", 0)
    longest = spec.max_decisions * spec.chunk_len
    need = f"learner.global_batch={cfg.learner.global_batch} decisions of finished episodes"
    if cfg.algo.name == "grpo":
        need += (f" in whole GRPO groups of {cfg.algo.group_size} episodes (up to "
                 f"{cfg.algo.group_size * longest} env steps a group, episodes of up to "
                 f"{longest})")
    else:
        need += f" (episodes of up to {longest} env steps)"
    return (f"trained nothing: no optimizer step in {steps} env steps ({episodes} episode"
            f"{'' if episodes == 1 else 's'} finished; stopped by {summary.get('stopped_by')}), so its last checkpoint holds the "
            f"weights it started from; the first step needs {need}: raise total_env_steps or "
            f"max_minutes")
