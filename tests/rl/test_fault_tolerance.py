"""Fault tolerance on a real local Ray cluster: kill an env worker, a rollout server or the
learner in the middle of a run; the run must continue, count what it lost, and lose or
duplicate no transition beyond the in-flight episodes it counts."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray
from support.tiny_runs import TINY_RUN

from actors.rl.controller import Controller
from rlvla3.checkpoint.files import read_meta
from rlvla3.checkpoint.trust import listed_files
from rlvla3.run_config import load_run_config

FAST = [*TINY_RUN, "log_every_s=0.5", "checkpoint_every=2"]


def start_run(controller: Controller) -> tuple[threading.Thread, dict]:
    """``controller.run()`` in a thread; its summary, or the error it raised, lands in the dict."""
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = controller.run()
        except BaseException as exc:  # re-raised by summary_of, with the run's own traceback
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def summary_of(result: dict) -> dict:
    if "error" in result:
        raise AssertionError("the run failed") from result["error"]
    return result["summary"]


def run_with_kill(tmp_path, target: str, steps: int = 2500, overrides=(), ahead: int = 0):
    """Run full mode (the default staleness bound); once the policy reached version 3 and a
    checkpoint exists (and then ``ahead`` more versions), kill ``target``; return the summary
    and the final stats of the surviving actors."""
    cfg = load_run_config("smoke", overrides=FAST + [f"total_env_steps={steps}", *overrides])
    controller = Controller(cfg, tmp_path / target, quiet=True)
    topo = controller.build()
    thread, result = start_run(controller)
    try:
        deadline = time.monotonic() + 240
        latest = tmp_path / target / "checkpoints" / "latest"
        while ray.get(topo.learners[0].version.remote()) < 3:
            assert time.monotonic() < deadline, "the run made no progress before the kill"
            time.sleep(0.2)
        if not latest.is_file():  # no periodic checkpoints: take one now
            ray.get(topo.learners[0].save.remote(str(tmp_path / target), {"env_steps": 0}))
        saved = read_meta(tmp_path / target).version
        while ray.get(topo.learners[0].version.remote()) < saved + ahead:
            assert time.monotonic() < deadline, "the run made no progress before the kill"
            time.sleep(0.2)
        victim = {"env_worker": topo.workers[0], "rollout_server": topo.servers[0],
                  "learner": topo.learners[0]}[target]
        killed_at = ray.get(topo.learners[0].version.remote())
        ray.kill(victim, no_restart=False)
        thread.join(timeout=300)
        assert not thread.is_alive(), "the run did not finish after the kill"
        workers = ray.get([w.stats.remote() for w in topo.workers])
        queue = ray.get(topo.queue.stats.remote())
        learner = ray.get(topo.learners[0].stats.remote())
        server_version = ray.get(topo.servers[0].version.remote())
    finally:
        thread.join(timeout=5)
        controller.shutdown()
    return summary_of(result), workers, queue, learner, server_version, killed_at


def assert_transitions_accounted(workers, queue):
    """Every decision an env slot took is in a shipped segment, in an episode still running,
    or in a counted dropped episode; every segment put into the queue was taken or is held."""
    for w in workers:
        assert w.decisions == (w.shipped_decisions + w.inflight_decisions
                                  + w.dropped_decisions)
    assert queue.put_decisions == (queue.got_decisions + queue.queued_decisions
                                      + queue.held_decisions + queue.dropped_stale_decisions
                                      + queue.expired_decisions)
    assert queue.put_decisions + queue.discarded_decisions == sum(
        w.shipped_decisions for w in workers)


@pytest.mark.slow
def test_env_worker_killed_run_continues(ray_cluster, tmp_path):
    summary, workers, queue, _, _, _ = run_with_kill(tmp_path, "env_worker")
    assert summary["env_steps"] >= 2500
    assert summary["restart_counts"]["env_worker"] == 1
    assert summary["restart_counts"]["episodes_lost"] == 2  # the killed worker's two slots
    # the queue owns shipped payloads: none died with their producer, and the learner goes on
    assert summary["lost_segments"] == 0 and summary["policy_version"] > 3
    # the restarted worker works again, and the surviving one lost nothing
    assert workers[0].episodes > 0
    assert queue.put_decisions == (queue.got_decisions + queue.queued_decisions
                                      + queue.dropped_stale_decisions)
    # only the episodes running when the rollout stopped still hold admissions (one per slot):
    # the dead incarnation's two were released
    assert queue.in_flight_episodes <= 4, "the dead worker's admissions were not released"
    w = workers[1]
    assert w.decisions == w.shipped_decisions + w.inflight_decisions + w.dropped_decisions


@pytest.mark.slow
def test_rollout_server_killed_no_transition_lost_or_repeated(ray_cluster, tmp_path):
    summary, workers, queue, learner, server_version, _ = run_with_kill(tmp_path, "rollout_server")
    assert summary["env_steps"] >= 2500
    assert summary["restart_counts"]["rollout_server"] == 1, summary
    assert summary["restart_counts"]["episodes_lost"] == 0
    assert summary["dropped_faults"] == 0
    assert_transitions_accounted(workers, queue)
    # the restarted server serves current weights, not its fresh initialisation
    assert server_version >= learner.version - 1
    assert server_version > 0


@pytest.mark.slow
def test_learner_killed_rolls_back_further_than_the_staleness_bound_and_trains_on(
        ray_cluster, tmp_path):
    """The default staleness bound (8), a checkpoint 12 versions behind the learner when it is
    killed: the restored learner, the queue and the servers follow the version backwards and
    training goes on (nothing is discarded as stale because of the rollback)."""
    # long enough that the restarted learner (a new process importing torch) trains again
    summary, workers, queue, learner, _, killed_at = run_with_kill(
        tmp_path, "learner", 8000, overrides=["checkpoint_every=0"], ahead=12)
    assert summary["restart_counts"]["learner"] == 1
    assert learner.restored_from.startswith("step-")
    restored = int(learner.restored_from.split("-")[1])
    assert killed_at - restored >= 12 > 8  # it went back further than the bound ...
    assert summary["policy_version"] >= restored + 5  # ... and trained on from there
    assert learner.samples_trained > 0  # the restored incarnation itself trained
    assert read_meta(tmp_path / "learner").version == summary["policy_version"]
    assert summary["env_steps"] >= 8000
    assert summary["discarded_decision_fraction"] < 0.05, summary["accounting"]
    assert_transitions_accounted(workers, queue)


def _wait_for(condition, what: str, timeout_s: float = 240.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def _sums_at_one_version(learners, timeout_s: float = 60.0) -> tuple[float, float]:
    """Two ranks' parameter sums, read when both answer at one version: while training goes
    on they can be one optimizer step apart when asked."""
    deadline = time.monotonic() + timeout_s
    while True:
        (v0, sum0), (v1, sum1) = ray.get([lr.checksum.remote() for lr in learners])
        if v0 == v1:
            return sum0, sum1
        assert time.monotonic() < deadline, f"the ranks never answered at one version ({v0}, {v1})"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_learners_rebuild_from_the_checkpoint_then_go_on_with_one(ray_cluster, tmp_path,
                                                                      strategy):
    """Two learner ranks (DDP, or FSDP: sharded checkpoints, each rank restoring its shard).
    Rank 1 dies and comes back: every rank restarts from the last checkpoint (weights,
    optimizer, version) and the group trains on with two ranks. Rank 1 dies for good (its
    resources gone): the group trains on with one rank, from the sharded checkpoint too."""
    cfg = load_run_config("smoke", overrides=FAST + [
        "total_env_steps=100000000", "learner.num_learners=2", "learner.global_batch=32",
        "learner.micro_batch=16", "learner.num_cpus=0.5", "ray.node_wait_s=45",
        f"learner.sharding={strategy}"])
    controller = Controller(cfg, tmp_path / "group", quiet=True)
    topo = controller.build()
    group = topo.group
    thread, result = start_run(controller)
    version = lambda: ray.get(group.active[0].version.remote())  # noqa: E731
    try:
        _wait_for(lambda: version() >= 4 and (tmp_path / "group/checkpoints/latest").is_file(),
                  "a checkpoint at version 4")
        ray.kill(topo.learners[1], no_restart=False)
        _wait_for(lambda: len(group.rebuilds) == 1, "the first rebuild")
        first = group.rebuilds[0]
        assert (first["ranks_before"], first["ranks_after"]) == (2, 2), first
        restored = int(first["restored_from"].split("-")[1])
        assert first["version"] == restored  # every rank went back to the checkpoint ...
        ranks = ray.get([lr.stats.remote() for lr in group.active])
        assert [r.rank for r in ranks] == [0, 1] and all(r.world_size == 2 for r in ranks)
        assert all(r.restored_from == first["restored_from"] for r in ranks)
        _wait_for(lambda: version() >= restored + 3, "training after the rebuild")
        sum0, sum1 = _sums_at_one_version(group.active)
        if strategy == "ddp":  # whole copies: equal; shards: each its half
            assert sum0 == pytest.approx(sum1, rel=1e-6)  # ... and they train in lockstep
        else:
            assert all(r.engine == "fsdp" for r in ray.get(
                [lr.stats.remote() for lr in group.active]))
            assert any(n.startswith("shards/") for n in listed_files(tmp_path / "group"))

        ray.kill(topo.learners[1], no_restart=True)  # its resources are gone for good
        _wait_for(lambda: len(group.rebuilds) == 2, "the second rebuild")
        second = group.rebuilds[1]
        assert (second["ranks_before"], second["ranks_after"]) == (2, 1), second
        assert second["left_group"] == [topo.names["learner"][1]]
        alone = ray.get(group.active[0].stats.remote())
        assert (alone.rank, alone.world_size) == (0, 1)
        resumed = second["version"]
        _wait_for(lambda: version() >= resumed + 3, "training with one rank")
        controller.request_stop()
        thread.join(timeout=300)
        assert not thread.is_alive(), "the run did not stop"
    finally:
        controller.request_stop()
        thread.join(timeout=60)
        controller.shutdown()
    summary = summary_of(result)
    assert summary["learner_group"]["ranks"] == 1
    assert summary["learner_group"]["strategy"] == "single"  # what one rank runs
    assert summary["stopped_by"] == "stop requested"
    assert [r["ranks_after"] for r in summary["learner_group"]["rebuilds"]] == [2, 1]
    assert summary["policy_version"] >= resumed + 3
    assert summary["restart_counts"]["learner"] >= 2  # rank 1, then rank 0 restarted with it
    accounting = summary["accounting"]
    assert accounting["lost_with_restarts"]["with_learner"] > 0  # what the restarted ranks held
    # every decision is placed, up to the episodes still on their way to the queue when the
    # rollout stopped (one per slot at most)
    assert abs(accounting["unaccounted"]) <= 4 * 20, json.dumps(accounting)
    for r in summary["learner_group"]["rebuilds"]:
        print(f"learner group rebuild: {r}")


ISAACLAB = ["env.name=isaaclab", "env.options.task=reach", "env.options.num_envs=2",
            "env.options.image_size=[16, 16]",
            "env.options.chunk_len=4"]
"""The same run on Isaac Lab kit-less: two env workers, each one server of two sub-envs."""


def _isaaclab_servers() -> list:
    import psutil

    return [p for p in psutil.process_iter(["cmdline"])
            if "envs.isaaclab.server" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
def test_isaaclab_env_worker_killed_run_continues(ray_cluster, tmp_path):
    """An env worker holding an Isaac Lab server is killed mid-run: it is restarted with a new
    server, the run goes on with the same accounting as ``test_env_worker_killed_run_continues``,
    and no server outlives it."""
    from envs.isaaclab import setup

    if setup.located() is None:
        pytest.skip("the Isaac Lab environment is not built here (rlvla3 envs setup isaaclab)")
    before = {p.pid for p in _isaaclab_servers()}
    # long enough after the kill for the restarted worker to start its server (tens of seconds)
    summary, workers, queue, _, _, _ = run_with_kill(tmp_path, "env_worker", steps=4000,
                                                     overrides=ISAACLAB)
    assert summary["env_steps"] >= 4000
    assert summary["restart_counts"]["env_worker"] == 1
    assert summary["restart_counts"]["episodes_lost"] == 2  # the killed worker's two slots
    assert summary["lost_segments"] == 0 and summary["policy_version"] > 3
    assert workers[0].episodes > 0  # the restarted worker started a server and ran again
    # the same accounting as test_env_worker_killed_run_continues: the queue lost nothing, the dead
    # incarnation's admissions were released, the surviving worker accounts for every decision
    assert queue.put_decisions == (queue.got_decisions + queue.queued_decisions
                                   + queue.dropped_stale_decisions)
    assert queue.in_flight_episodes <= 4
    w = workers[1]
    assert w.decisions == w.shipped_decisions + w.inflight_decisions + w.dropped_decisions
    deadline = time.monotonic() + 60  # the killed worker's server ends when its pipe closes
    while {p.pid for p in _isaaclab_servers()} - before and time.monotonic() < deadline:
        time.sleep(1)
    assert not {p.pid for p in _isaaclab_servers()} - before, "an Isaac Lab server outlived its run"
