"""End-to-end runs of the RL pipeline on a real local Ray cluster, in every ablation mode."""

from __future__ import annotations

import json
import random
import sys
import time

import pytest
import ray
from ray import cloudpickle
from safetensors.torch import load_file
from support.tiny_runs import TINY_RUN

from actors.rl.controller import Controller
from rlvla3.checkpoint.files import load_policy, read_meta
from rlvla3.checkpoint.trust import resolve_checkpoint
from rlvla3.run_config import load_run_config
from rlvla3.weight_sync import parameter_sum

SMALL = [*TINY_RUN, "log_every_s=1.0", "checkpoint_every=0"]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run in actors


def proximal_copy(learner) -> tuple[int, float, float]:
    """Runs inside a learner (``__ray_call__``): the version its proximal copy holds, the sum
    of the copy's parameters and of the policy's."""
    window = learner.core.proximal
    return window.synced_at, parameter_sum(window.engine.shadow), parameter_sum(learner.policy)


def run(tmp_path, name: str, overrides: list[str], resume: bool = False) -> tuple[dict, Controller]:
    cfg = load_run_config("smoke", overrides=SMALL + overrides)
    controller = Controller(cfg, tmp_path / name, resume=resume, quiet=True)
    try:
        summary = controller.run()
    finally:
        controller.shutdown()
    return summary, controller


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "sync_autoreset", "disaggregated", "train_async",
                                  "rollout_async", "full"])
def test_every_mode_runs_end_to_end(ray_cluster, tmp_path, mode):
    summary, _ = run(tmp_path, mode, [f"pipeline.mode={mode}", "total_env_steps=500"])
    assert summary["mode"] == mode
    assert summary["env_steps"] >= 500
    assert summary["stopped_by"] == "total_env_steps=500"
    assert summary["episodes"] > 0
    assert summary["policy_version"] >= 1, "the learner never stepped"
    assert summary["dropped_faults"] == 0
    # every decision the env slots produced is in exactly one place, summed across actors
    accounting = summary["accounting"]
    assert accounting["unaccounted"] == 0, accounting
    # counted by other counters than the accounting's: the learner's version (each step trains
    # exactly one global batch of 32; a step under way at the stop trains nothing), the env
    # steps behind the trained decisions (1 or 2 each: reach's chunk is 2), and the lengths
    # of the episodes the slots finished (the rest of the produced decisions are running)
    assert summary["trained_decisions"] == 32 * summary["policy_version"] > 0
    trained = summary["trained_decisions"]
    assert trained <= summary["trained_env_steps"] <= 2 * trained
    finished = summary["episode_lengths"]["produced"]
    assert finished["count"] * finished["mean"] == pytest.approx(
        summary["decisions"] - accounting["running"], abs=0.005 * finished["count"] + 1)
    assert summary["trained_env_steps_per_s"] <= summary["env_steps_per_s"]
    run_dir = tmp_path / mode
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["env_steps"] == summary["env_steps"]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1
    assert any((run_dir / "tb").iterdir())
    policy, meta = load_policy(run_dir)
    assert meta.version == summary["policy_version"]
    if mode in ("sync", "disaggregated"):
        # lockstep: one batch holds every slot of the group (4 in sync, 2 per pipelined
        # group); bootstrap requests of episodes cut at the same step may batch across groups
        group = 4 if mode == "sync" else 2
        assert group in summary["batch_size_hist"]
        assert max(summary["batch_size_hist"]) <= 4
        assert summary["dropped_stale"] == 0


@pytest.mark.slow
def test_resume_continues_version_counters_and_episode_sequence(ray_cluster, tmp_path):
    first, controller = run(tmp_path, "r", ["total_env_steps=300"])
    workers = controller.cfg.env_workers.num_workers
    saved = read_meta(tmp_path / "r").samplers
    assert len(saved) == workers and all(s and s["rng"] for s in saved)
    # a checkpoint saved before a counter was kept: that one counts from the resumed leg
    meta_file = resolve_checkpoint(tmp_path / "r") / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["counters"]["trained_env_steps"]
    meta_file.write_text(json.dumps(meta))
    second, resumed = run(tmp_path, "r", ["total_env_steps=700"], resume=True)
    assert second["policy_version"] > first["policy_version"]
    assert second["env_steps"] >= 700
    assert read_meta(tmp_path / "r").counters["env_steps"] == second["env_steps"]
    assert resumed.samplers_continued == workers  # each worker went on from its saved state
    assert read_meta(tmp_path / "r").samplers != saved
    # the summary counts the whole run; this_leg holds the resumed leg's own counts
    leg = second["this_leg"]
    for key in ("env_steps", "episodes", "decisions", "trained_decisions"):
        assert second[key] == first[key] + leg[key] and leg[key] > 0, key
    assert second["counts_from_this_leg"] == ["trained_env_steps"]
    assert second["trained_env_steps"] == leg["trained_env_steps"] > 0
    assert "counts_from_this_leg" not in first and first["this_leg"]["decisions"] == first[
        "decisions"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "full"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_two_learners_stay_in_lockstep(ray_cluster, tmp_path, mode, epochs):
    cfg = load_run_config("smoke", overrides=SMALL + [
        f"pipeline.mode={mode}", "total_env_steps=600", "learner.num_learners=2",
        "learner.global_batch=32", "learner.num_cpus=0.5", f"algo.update_epochs={epochs}"])
    controller = Controller(cfg, tmp_path / mode, quiet=True)
    try:
        summary = controller.run()
        learners = controller.topology.learners
        (v0, sum0), (v1, sum1) = ray.get([lr.checksum.remote() for lr in learners])
    finally:
        controller.shutdown()
    assert summary["policy_version"] >= 1
    assert v0 == v1
    assert sum0 == pytest.approx(sum1, rel=1e-6), "DDP ranks diverged"
    trained = summary["accounting"]["trained"]
    if mode == "sync":  # whole batches, each with all its epochs
        assert summary["policy_version"] == epochs * trained // 32 and trained % 32 == 0
    else:  # a stop may fall between a batch's epochs
        assert epochs * trained // 32 - summary["policy_version"] in range(epochs)
    assert summary["accounting"]["unaccounted"] == 0


@pytest.mark.slow
def test_init_from_starts_with_the_checkpoint_weights(ray_cluster, tmp_path):
    run(tmp_path, "first", ["total_env_steps=300"])
    policy, _ = load_policy(tmp_path / "first")
    expected = parameter_sum(policy)
    cfg = load_run_config("smoke", overrides=SMALL + [f"init_from={tmp_path / 'first'}"])
    controller = Controller(cfg, tmp_path / "second", quiet=True)
    try:
        topo = controller.build()
        version, start = ray.get(topo.learners[0].checksum.remote())
        served = ray.get([s.checksum.remote() for s in topo.servers])
        proximal_at_start = ray.get(topo.learners[0].__ray_call__.remote(proximal_copy))
        # a restore (what a restarted learner does) takes the checkpoint's proximal copy too
        restored = ray.get(topo.learners[0].restore.remote(str(tmp_path / "first")))
        proximal_restored = ray.get(topo.learners[0].__ray_call__.remote(proximal_copy))
        saved_shadow = load_file(str(resolve_checkpoint(tmp_path / "first") /
                                     "shadow.safetensors"))
    finally:
        controller.shutdown()
    assert start == pytest.approx(expected, rel=1e-9)
    assert version == 0
    # the decoupled objective's proximal policy is the checkpoint's, not the initialisation
    assert proximal_at_start == (0, pytest.approx(expected, rel=1e-9),
                                 pytest.approx(expected, rel=1e-9))
    assert restored > 0
    assert proximal_restored[0] == read_meta(tmp_path / "first").learner["proximal_synced_at"]
    assert proximal_restored[1] == pytest.approx(
        sum(float(v.double().sum()) for k, v in saved_shadow.items()
            if v.is_floating_point() and k in dict(policy.named_parameters())), rel=1e-9)
    # the servers act with the checkpoint's weights from the first decision, at version 0 too
    # (not with their own initialisation until the learner's first step)
    assert [v for v, _ in served] == [0] * len(served)
    assert [s for _, s in served] == pytest.approx([expected] * len(served), rel=1e-9)


def test_periodic_eval_on_held_out_initial_states(ray_cluster, tmp_path):
    summary, _ = run(tmp_path, "eval", ["total_env_steps=800", "eval_every=2",
                                        "eval_init_state_ids=[48, 49]"])
    assert summary["evals"], "no evaluation ran"
    for result in summary["evals"]:
        assert result["episodes"] == 4 * 2  # every task x the two held-out initial states
        assert 0.0 <= result["success_rate"] <= 1.0
    assert [r["version"] for r in summary["evals"]] == sorted(r["version"] for r in summary["evals"])
    # the policy the run ends with is always evaluated, however few ticks the run had
    assert summary["evals"][-1]["version"] == summary["policy_version"]


def test_collective_weight_sync(ray_cluster, tmp_path):
    """Weights reach the servers over a broadcast group (gloo here, NCCL on GPUs)."""
    cfg = load_run_config("smoke", overrides=SMALL + [
        "learner.weight_sync=collective", "total_env_steps=600", "rollout.num_servers=2"])
    controller = Controller(cfg, tmp_path / "collective", quiet=True)
    try:
        summary = controller.run()
        topo = controller.topology
        learner_version = ray.get(topo.learners[0].version.remote())
        served = ray.get([s.version.remote() for s in topo.servers])
    finally:
        controller.shutdown()
    assert summary["policy_version"] >= 2
    assert all(v >= 1 for v in served), "servers never received broadcast weights"
    assert max(served) <= learner_version


@pytest.mark.parametrize("mode", ["sync", "full"])
def test_more_slots_than_the_queue_holds(ray_cluster, tmp_path, mode):
    """Four slots, a queue of one episode: synchronous training holds a whole round, the
    asynchronous pipeline waits on backpressure; neither deadlocks."""
    summary, _ = run(tmp_path, mode, [f"pipeline.mode={mode}", "queue.capacity=1",
                                      "total_env_steps=400", "watchdog_s=30"])
    assert summary["env_steps"] >= 400 and summary["policy_version"] >= 1
    assert summary["accounting"]["unaccounted"] == 0


@pytest.mark.slow
def test_pacing_keeps_staleness_bounded_without_discarding(ray_cluster, tmp_path):
    """On this CPU the envs produce far faster than the learner trains. Without pacing the
    backlog ages past a tight staleness bound and decisions are discarded; with pacing the
    slots wait instead and nearly nothing is. Pacing estimates from mean episode lengths, and
    at this bound one 20-decision episode is 1.3% of the run: measured, 0-2.6% paced against
    42-47% unpaced (docs/concepts/pipeline.md), so the bound is a tenth of the unpaced loss."""
    common = ["total_env_steps=3000", "queue.max_staleness=3", "env_workers.slots_per_worker=4"]
    unpaced, _ = run(tmp_path, "unpaced", common + ["queue.pace_lag=0"])
    paced, _ = run(tmp_path, "paced", common)
    figures = json.dumps({name: {k: s[k] for k in ("discarded_decision_fraction", "staleness_p90",
                                                     "staleness_max", "admission_wait_fraction",
                                                     "accounting")}
                          for name, s in (("unpaced", unpaced), ("paced", paced))})
    assert unpaced["discarded_decision_fraction"] > 0.2, figures
    assert paced["discarded_decision_fraction"] <= 0.1 * unpaced["discarded_decision_fraction"], (
        figures)
    assert paced["staleness_p90"] <= 3, figures
    assert paced["admission_wait_fraction"] > 0, figures  # the slots did wait for the learner


def test_autoreset_rounds_step_every_slot(ray_cluster, tmp_path):
    """sync_autoreset: in each of a round's ``round_decisions`` lockstep steps every slot
    either steps or is resetting (in the background, after its episode ended): no slot waits
    for the round's slowest episode, nor for another slot's reset."""
    from actors.rl.drivers import AutoresetRollout

    cfg = load_run_config("smoke", overrides=SMALL + ["pipeline.mode=sync_autoreset",
                                                      "env.options.max_decisions=4"])
    controller = Controller(cfg, tmp_path / "autoreset", quiet=True)
    try:
        topo = controller.build()
        rollout = AutoresetRollout(decisions=7)
        for _ in range(3):
            rollout.run_round(topo.workers, topo.servers)
        stats = ray.get([w.stats.remote() for w in topo.workers])
    finally:
        controller.shutdown()
    slots = sum(s.slots for s in stats)
    decisions = sum(s.decisions for s in stats)
    assert decisions + sum(s.lockstep_skips for s in stats) == 3 * 7 * slots
    assert decisions >= 0.8 * 3 * 7 * slots  # resets of reach take microseconds
    # 21 steps per slot with episodes of at most 4 decisions: every slot reset in place (and
    # sat out at least one step for it) several times
    assert sum(s.episodes for s in stats) >= 3 * slots
    assert all(s.inflight_decisions <= 4 * s.slots for s in stats)


@pytest.mark.slow
def test_grpo_with_two_learners_never_splits_a_group(ray_cluster, tmp_path):
    cfg = load_run_config("smoke", overrides=SMALL + [
        "pipeline.mode=full", "total_env_steps=800", "learner.num_learners=2",
        "learner.global_batch=32", "learner.num_cpus=0.5", "algo.name=grpo",
        "algo.group_size=2"])
    controller = Controller(cfg, tmp_path / "grpo2", quiet=True)
    try:
        summary = controller.run()
        learners = ray.get([lr.stats.remote() for lr in controller.topology.learners])
    finally:
        controller.shutdown()
    assert summary["policy_version"] >= 1
    # every group whole (no fault here), one group per queue item, never two pooled
    assert all(lr.received_episodes == 2 * lr.received_groups for lr in learners), learners
    assert all(lr.short_groups == 0 for lr in learners)
    assert sum(lr.received_episodes for lr in learners) > 0
    assert summary["accounting"]["unaccounted"] == 0


@pytest.mark.slow
def test_grpo_dynamic_sampling_trains_redrawn_groups_whole(ray_cluster, tmp_path):
    """Dynamic sampling on ColorReach with a 0/1 reward (no progress term): an untrained
    policy (about 0.1 success with its wide initial noise) fails most pairs alike; the queue
    draws their keys again on the same env worker, trains the groups that became mixed whole
    (more than 2 episodes) and counts every decision."""
    cfg = load_run_config("smoke", overrides=SMALL + [
        "pipeline.mode=full", "total_env_steps=3000", "algo.name=grpo", "algo.group_size=2",
        "algo.skip_uniform_groups=true", "algo.redraw_rounds=3", "env.options.progress_scale=0",
        "env.options.num_objects=2", "env.options.success_radius=0.12",
        "policy.options.init_log_std=0.3", "queue.max_staleness=16"])
    controller = Controller(cfg, tmp_path / "redraw", quiet=True)
    try:
        summary = controller.run()
        learners = ray.get([lr.stats.remote() for lr in controller.topology.learners])
        queue = ray.get(controller.topology.queue.stats.remote())
    finally:
        controller.shutdown()
    groups = summary["groups"]
    assert groups["redraws"] > 0 and queue.redrawn > 0, (groups, queue)
    assert summary["redrawn_decisions"] == queue.redrawn_decisions > 0
    assert groups["rescued"] == queue.rescued_groups > 0, groups
    # a rescued group reaches the learner whole: first round and redrawn members together
    assert sum(lr.received_episodes for lr in learners) > 2 * sum(
        lr.received_groups for lr in learners), learners
    assert summary["skipped_decisions"] == queue.uniform_decisions
    assert 0 < summary["trained_decision_share"] <= 1
    assert summary["accounting"]["unaccounted"] == 0, summary["accounting"]


@pytest.mark.slow
def test_two_learners_stop_together_whenever_asked(ray_cluster, tmp_path):
    """Stop requests land at arbitrary points of a step, while data keeps arriving unevenly:
    both ranks always leave ``run()`` at the same version, none left in an all-reduce alone."""
    cfg = load_run_config("smoke", overrides=SMALL + [
        "pipeline.mode=full", "learner.num_learners=2", "learner.global_batch=32",
        "learner.num_cpus=0.5"])
    controller = Controller(cfg, tmp_path / "stops", quiet=True)
    rng = random.Random(0)
    try:
        topo = controller.build()
        controller.schedule.rollout.start(topo.workers, topo.servers)
        before = 0
        for _ in range(6):
            refs = [lr.run.remote() for lr in topo.learners]
            time.sleep(rng.uniform(0.3, 2.0))
            for lr in topo.learners:
                lr.stop.remote()
            done, _ = ray.wait(refs, num_returns=2, timeout=60)
            assert len(done) == 2, "a rank never left run(): it waits alone in a collective"
            versions = ray.get([lr.version.remote() for lr in topo.learners])
            assert versions[0] == versions[1], versions
            assert versions[0] > before, "a stop takes one more step, taken by both ranks"
            before = versions[0]
        controller.schedule.rollout.stop(topo.workers)
    finally:
        controller.shutdown()


def test_watchdog_names_what_a_stalled_run_waits_on(ray_cluster, tmp_path, capsys):
    """Every reset sleeps ~8 s (LIBERO latencies x 2.7): the watchdog reports the slots
    resetting instead of staying silent."""
    cfg = load_run_config("smoke", overrides=SMALL + [
        "pipeline.mode=sync", "env.options.latency=data/libero_latency.json",
        "env.options.latency_scale=2.7", "env.options.max_decisions=2", "total_env_steps=8",
        "watchdog_s=2"])
    controller = Controller(cfg, tmp_path / "stalled", quiet=False)
    try:
        controller.run()
    finally:
        controller.shutdown()
    out = capsys.readouterr().out
    assert "watchdog: no env or optimizer step" in out, out
    assert "4 reset" in out, out
