"""Faults that must not end a run, and faults that must end it at once with their own error, on
a real local Ray cluster: a GRPO run whose simulator steps raise (groups shortened, trained),
and a learner error while every rank is alive (no rebuild loop)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import ray
from ray import cloudpickle
from support.tiny_runs import TINY_RUN

from actors.rl.controller import Controller
from actors.rl.failures import LearnerFailures, RebuildLimitReached
from rlvla3.run_config import load_run_config

SMALL = [*TINY_RUN, "log_every_s=1.0", "checkpoint_every=0"]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injections run in actors


def raise_on_every_nth_step(worker, every: int) -> int:
    """Runs inside an env worker (``__ray_call__``): every ``every``-th step of each of its
    simulators raises, as an in-process simulator that crashes would."""
    for env in worker.envs:
        calls = [0]

        def step(actions, original=env.step, calls=calls):
            calls[0] += 1
            if calls[0] % every == 0:
                raise RuntimeError("simulator exploded (injected)")
            return original(actions)

        env.step = step
    return len(worker.envs)


def test_grpo_run_with_raising_simulator_steps_trains_the_shortened_groups(ray_cluster,
                                                                           tmp_path):
    cfg = load_run_config("smoke", overrides=SMALL + [
        "algo.name=grpo", "algo.group_size=4", "total_env_steps=3000"])
    controller = Controller(cfg, tmp_path / "raising", quiet=True)
    try:
        topo = controller.build()
        ray.get([w.__ray_call__.remote(raise_on_every_nth_step, 50) for w in topo.workers])
        summary = controller.run()
        learner = ray.get(topo.learners[0].stats.remote())
    finally:
        controller.shutdown()
    assert summary["stopped_by"] == "total_env_steps=3000"
    assert summary["dropped_faults"] > 0
    assert learner.short_groups > 0, learner  # groups that lost a member still trained
    assert summary["trained_decisions"] == 32 * summary["policy_version"] > 0
    assert summary["accounting"]["unaccounted"] == 0, summary["accounting"]


def fail_like_an_out_of_memory(learner, after_version: int) -> None:
    """Runs inside a learner (``__ray_call__``): its loss raises once the version is reached,
    and again at every call after that (as a CUDA out-of-memory would)."""
    original = learner.core.loss

    def loss(batch):
        if learner.core.version >= after_version:
            raise RuntimeError("CUDA out of memory (injected)")
        return original(batch)

    learner.core.loss = loss


def test_a_learner_error_with_every_rank_alive_ends_the_run_with_that_error(ray_cluster,
                                                                           tmp_path):
    """No rank was lost: rebuilding the group would restore the last checkpoint and meet the
    same error again (an endless loop that loses progress each time). The run ends with the
    original error instead, within the grace the controller gives a loss to show."""
    cfg = load_run_config("smoke", overrides=SMALL + [
        "learner.num_learners=2", "learner.num_cpus=0.5", "total_env_steps=100000",
        "checkpoint_every=1"])
    controller = Controller(cfg, tmp_path / "oom", quiet=True)
    outcome: dict = {}
    try:
        topo = controller.build()
        ray.get(topo.learners[0].__ray_call__.remote(fail_like_an_out_of_memory, 2))

        def run() -> None:
            try:
                outcome["summary"] = controller.run()
            except BaseException as exc:  # noqa: BLE001 - the error the test expects
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        start = time.monotonic()
        thread.start()
        thread.join(timeout=180)
        ended_s = time.monotonic() - start
        rebuilds = list(topo.group.rebuilds)
    finally:
        controller.request_stop("test over")
        thread.join(timeout=60)
        controller.shutdown()
    assert "summary" not in outcome, f"the run went on (rebuilds: {rebuilds})"
    assert "CUDA out of memory (injected)" in str(outcome.get("error")), outcome
    assert rebuilds == [] and ended_s < 180


def test_rebuilds_need_a_lost_rank_and_stay_within_their_budget():
    now = [0.0]
    failures = LearnerFailures(max_rebuilds=2, window_s=100.0, clock=lambda: now[0])
    oom = RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError) as info:
        failures.check(oom, [])  # every rank alive: the original error, as it was
    assert info.value is oom
    failures.check(oom, ["learner0"])
    now[0] = 50.0
    failures.check(oom, ["learner1"])
    with pytest.raises(RebuildLimitReached, match="2 rebuilds in the last 100s") as info:
        failures.check(oom, ["learner0"])
    assert info.value.__cause__ is oom
    now[0] = 120.0  # the first rebuild left the window
    failures.check(oom, ["learner0"])
