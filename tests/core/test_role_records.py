"""Ray-free tests of the roles' records and the figures computed from them: the progress row
keeps the keys ``metrics.jsonl`` and the status actor carry, every decision is accounted for,
an actor that does not run holds nothing, and no role's shell writes its core's fields."""

from __future__ import annotations

import ast
import asyncio
import math
from dataclasses import replace
from pathlib import Path

from actors.observe.figures import accounting, progress_row, waiting_on
from rlvla3.queue.core import QueueCore
from rlvla3.role_stats import EnvWorkerStats, LearnerStats, RolloutServerStats, Snapshot
from rlvla3.run_config import QueueConfig
from rlvla3.types import EpisodeKey, SegmentInfo

ROW_KEYS = [
    "time_s", "env_steps", "env_steps_per_s", "trained_env_steps", "trained_env_steps_per_s",
    "trajectories_per_s", "episodes", "decisions", "trained_decisions", "discarded_decisions",
    "discarded_decision_fraction", "staleness_p50", "staleness_p90", "staleness_max",
    "episode_return", "success_rate", "success_window", "success_by_task", "policy_version",
    "mean_batch_size", "mean_batch_wait_ms", "queue_depth", "expected_lag",
    "in_flight_episodes", "dropped_stale", "uniform_groups_skipped", "skipped_decisions",
    "redrawn_decisions", "trained_decision_share", "groups",
    "dropped_faults", "lost_segments", "restarts", "restart_counts", "busy_env",
    "busy_rollout", "busy_learner", "learner_data_wait", "admission_wait_fraction",
    "env_slots_live", "env_slots_waiting", "actors_down", "learner_ranks", "skipped_steps",
    "loss", "staleness"]
"""The progress row's keys, in order: the contract of ``metrics.jsonl``, ``summary.json`` and
``rlvla3 status``."""


class Recorded:
    """Metrics kept in lists (what Prometheus would receive)."""

    def __init__(self):
        self.events: list[tuple[str, str, float]] = []

    def inc(self, name: str, value: float = 1.0) -> None:
        self.events.append(("inc", name, value))

    def set(self, name: str, value: float) -> None:
        self.events.append(("set", name, value))

    def observe(self, name: str, value: float) -> None:
        self.events.append(("observe", name, value))


def _queue_after_a_run() -> QueueCore:
    """A queue that took 3 episodes of 10 decisions, dropped one as stale and holds one."""
    metrics = Recorded()
    core = QueueCore(QueueConfig(capacity=8, max_staleness=2), metrics)
    for version in (0, 5, 5):
        ticket = core.admit(0, "w0", EpisodeKey(0, 0), 0.0)
        info = SegmentInfo("w0/s0", EpisodeKey(0, 0), 10, 20, version, 1.0, True)
        core.finished(info, ticket)
        core.put(info, ["ref"], 0.0)
    core.set_version(5)
    assert len(core.take(max_items=1)) == 1  # the first is stale: dropped, the second taken
    assert ("inc", "episodes_dropped", 1) in metrics.events
    return core


def test_the_row_keeps_its_keys_and_the_accounting_adds_up():
    queue = _queue_after_a_run().stats()
    assert (queue.dropped_stale_decisions, queue.got_decisions, queue.queued_decisions) == (
        10, 10, 10)
    workers = [EnvWorkerStats(incarnation="a", slots=2, env_steps=70, decisions=35,
                              episodes=3, shipped_decisions=30, inflight_decisions=5,
                              busy_fraction=0.5, recent_episodes=3, recent_success=1 / 3,
                              recent_by_task={"0": [3, 1]}, admit_wait_s=1.0)]
    servers = [RolloutServerStats(requests=35, batches=7, busy_fraction=0.2)]
    learners = [LearnerStats(version=5, samples_trained=8, buffered=2, received_decisions=10,
                             trained_env_steps=16, staleness_hist={0: 4, 3: 4},
                             busy_fraction=0.4, data_wait_fraction=0.5)]
    snap = Snapshot(workers, servers, learners, queue)
    row = progress_row(snap, 10.0, {"env_steps": 100}, {"env_worker": 0, "learner": 0},
                       {"env_worker": {}})
    assert list(row) == ROW_KEYS
    assert row["env_steps"] == 170 and row["env_steps_per_s"] == 7.0  # the leg's rate
    assert row["trained_env_steps_per_s"] == 1.6 and row["mean_batch_size"] == 5.0
    assert row["discarded_decisions"] == 10 and row["staleness_max"] == 3.0
    assert row["success_by_task"] == {"0": {"episodes": 3, "success_rate": 0.3333}}
    assert row["admission_wait_fraction"] == 1.0 / (10.0 * 2)
    assert math.isnan(row["loss"])  # no optimizer step reported yet
    places = accounting(snap, 0, 0, False, False)
    assert places["produced"] == 35 and places["unaccounted"] == 0, places
    # a learner that died holding its buffer: what it took from the queue and never reported
    alone = Snapshot(workers, servers, [LearnerStats(version=5)], queue)
    assert accounting(alone, 0, 0, False, True)["unaccounted"] == 0


def test_the_row_and_the_line_show_what_grpo_produced_trained_skipped_and_redrew():
    """Dynamic sampling's decisions in the row (whole-run counts over a resumed leg) and on
    the console line; a run with nothing skipped or redrawn keeps its line as it was."""
    from actors.observe.monitor import RunMonitor

    core = QueueCore(QueueConfig(capacity=8, max_staleness=8), Recorded(), group_size=2,
                     skip_uniform=True, redraw_rounds=1)
    key, other = EpisodeKey(0, 0), EpisodeKey(1, 0)
    for ret in (0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0):  # rescued, then skipped after redraw
        ticket = core.admit(0, "w0", key if ret or core.stats().put < 4 else other, 0.0)
        info = SegmentInfo("w0/s0", core.ticket_key(ticket), 10, 20, 0, ret, ret > 0.5)
        core.put(info, ["ref"], 0.0, core.finished(info, ticket))
    queue = core.stats()
    assert (queue.rescued_groups, queue.redraw_skipped_groups) == (1, 1)
    workers = [EnvWorkerStats(incarnation="a", slots=2, decisions=80, shipped_decisions=80,
                              recent_episodes=8)]
    learners = [LearnerStats(samples_trained=40, received_decisions=40)]
    snap = Snapshot(workers, [RolloutServerStats()], learners, replace(queue, got_decisions=40,
                                                                       queued_decisions=0))
    row = progress_row(snap, 10.0, {"decisions": 20, "trained_decisions": 20,
                                    "skipped_decisions": 10}, {}, {"env_worker": {}})
    assert (row["decisions"], row["trained_decisions"]) == (100, 60)
    assert (row["skipped_decisions"], row["redrawn_decisions"]) == (50, 40)
    assert row["trained_decision_share"] == 0.6
    assert row["groups"]["rescued"] == 1 and row["groups"]["skipped_after_redraws"] == 1
    assert accounting(snap, 0, 0, False, False)["unaccounted"] == 0
    line = RunMonitor.line(None, row, 10.0)
    assert line.endswith(" | decisions 100 trained 60 (60%) skipped 50 redrawn 40")
    plain = {**row, "skipped_decisions": 0, "redrawn_decisions": 0}
    assert "redrawn" not in RunMonitor.line(None, plain, 10.0)


def test_an_actor_at_rest_holds_nothing_and_counts_what_died_with_it():
    worker = EnvWorkerStats(slots=4, decisions=9, inflight_decisions=3, busy_fraction=0.9,
                            phases={"step": 4}, recent_episodes=2)
    rest = worker.at_rest()
    assert (rest.inflight_decisions, rest.busy_fraction, rest.phases) == (0, 0.0, {})
    assert rest.decisions == 9 and worker.held() == {"episodes": 4, "decisions": 3}
    learner = LearnerStats(buffered=5, in_step=3, samples_trained=64)
    assert learner.held() == {"decisions": 8} and learner.at_rest().buffered == 0
    assert RolloutServerStats().held() == {}
    for record in (EnvWorkerStats, LearnerStats, RolloutServerStats):
        assert all(hasattr(record(), name) for name in record.CARRIED)


def test_the_watchdog_names_what_the_run_waits_on():
    queue = _queue_after_a_run().stats()
    workers = [EnvWorkerStats(phases={"admit": 3, "step": 1})]
    line = waiting_on(queue, workers, [LearnerStats(version=5, buffered=7)], 32, 8)
    assert line.startswith("env slots: 3 admit, 1 step; pacing holds new episodes")
    assert "learners: v5, 7 decisions buffered of 32 per step, queue holds 10" in line


def test_the_queue_actor_only_waits():
    """The actor's waiting around its core: a put into a full queue waits until a get."""
    from actors.roles.trajectory_queue import TrajectoryQueue

    async def scenario():
        queue = TrajectoryQueue(QueueConfig(capacity=1, max_staleness=4))
        info = SegmentInfo("w0/s0", EpisodeKey(0, 0), 3, 6, 0, 1.0, True)
        await queue.put(info, ["a"])
        blocked = asyncio.create_task(queue.put(info, ["b"]))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        got = await queue.get(max_items=4, timeout_s=1.0)
        await asyncio.wait_for(blocked, 1.0)
        return got, queue.stats()

    got, stats = asyncio.run(scenario())
    assert [refs for item in got for _, refs in item] == [["a"]]
    assert stats.depth == 1 and stats.producer_wait_s > 0


def test_no_role_shell_assigns_a_field_of_its_core():
    """``actors/roles/`` names, calls and restarts: no assignment to ``<x>.core.<field>``,
    ``core.<field>`` or the rollout server's ``service.<field>`` (the core owns its state)."""
    offenders = []
    for path in sorted((Path(__file__).parents[2] / "actors" / "roles").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for attr in ast.walk(target):
                    if isinstance(attr, ast.Attribute) and {"core", "service"} & set(
                            ast.unparse(attr.value).split(".")):
                        offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    assert not offenders, offenders
