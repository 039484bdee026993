"""The stop sequence of an asynchronous run with two learner ranks, at every phase of a step:
it ends within 30 s with a final checkpoint, both ranks at one version, and a step that was not
taken counts nothing as trained (its decisions are buffered again). The data is fed to the
queue by hand, so each phase is reached for sure (real Ray, real DDP over gloo, real queue)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import ray
from ray import cloudpickle
from tiny_runs import TINY_RUN

from actors.rl.checkpointer import Checkpointer
from actors.rl.controller import Controller
from actors.rl.stop import stop_async_run
from actors.roles.trajectory_queue import SegmentInfo
from envs import env_spec, make_env
from rlvla3.checkpoint import read_meta
from rlvla3.config import Named
from rlvla3.episode import TaskSampler
from rlvla3.policies import build_policy
from rlvla3.rollout import RolloutCore, collect_episodes
from rlvla3.run_config import load_run_config

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injection runs in an actor
EPISODE = 8
"""Decisions per fed episode: a rank's local batch (16) is two of them."""


def episodes(n: int) -> list:
    """``n`` real reach episodes of the tiny run's shapes, cut to ``EPISODE`` decisions."""
    reach = Named("reach", {"image_size": 16})
    policy = build_policy(Named("small", {"channels": 8, "hidden": 32}), env_spec(reach))
    out = []
    for seg in collect_episodes(make_env(reach), RolloutCore(policy),
                                TaskSampler(range(4), range(5), 0), 3 * n, "test"):
        if len(seg) >= EPISODE and len(out) < n:
            rows = np.arange(EPISODE)
            steps = seg.decision_steps()[rows]
            out.append(replace(seg, obs=seg.obs.select(rows), actions=seg.actions[rows],
                               latents=seg.latents[rows], rewards=seg.rewards[rows],
                               log_probs=seg.log_probs[rows], values=seg.values[rows],
                               policy_versions=seg.policy_versions[rows], step_counts=steps,
                               env_steps=int(steps.sum()), terminated=False, truncated=True))
    assert len(out) == n
    return out


def feed(queue, segments: list) -> None:
    for seg in segments:
        info = SegmentInfo(seg.source, seg.key, len(seg), seg.env_steps, 0,
                           seg.episode_return, False, 0)
        ray.get(queue.put.remote(info, [seg], None, True))


def slow_loss(learner, seconds: float) -> None:
    """Runs inside a learner (``__ray_call__``): every micro-batch takes ``seconds`` longer."""
    original = learner.core.loss

    def loss(batch):
        time.sleep(seconds)
        return original(batch)

    learner.core.loss = loss


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.1)


@pytest.mark.parametrize(("phase", "micro_batch", "fed", "version", "buffered"), [
    # one rank holds its whole batch in the gradient all-reduce, the other half a batch
    ("full_batch_waiting", 16, 3, 1, 24),
    # both ranks accumulated one micro-batch of two and wait for more
    ("accumulating", 8, 2, 1, 16),
    # both ranks have their batch and are computing the step (slowly) when asked
    ("stepping", 16, 4, 2, 0),
])
def test_two_learners_stop_within_30s_with_a_final_checkpoint(ray_cluster, tmp_path, phase,
                                                              micro_batch, fed, version,
                                                              buffered):
    cfg = load_run_config("smoke", overrides=[
        *TINY_RUN, "learner.num_learners=2", "learner.num_cpus=0.5", "pipeline.mode=full",
        f"learner.micro_batch={micro_batch}", "checkpoint_every=0", "watchdog_s=0"])
    controller = Controller(cfg, tmp_path / phase, quiet=True)
    data = episodes(4 + fed)
    try:
        topo = controller.build()
        learners = topo.learners

        def stats() -> list[dict]:
            return ray.get([lr.stats.remote() for lr in learners])

        ray.get(topo.queue.close_admissions.remote())  # the data comes from this test only
        controller.rollout.start(topo.workers, topo.servers)
        controller.training.start(learners)
        feed(topo.queue, data[:4])  # one whole step for both ranks
        wait_for(lambda: all(s["version"] == 1 for s in stats()), "the first step")
        if phase == "stepping":
            ray.get(learners[0].__ray_call__.remote(slow_loss, 3.0))
        feed(topo.queue, data[4:])
        if phase == "stepping":
            time.sleep(1.0)
        else:
            wait_for(lambda: sum(s["buffered"] + s["in_step"] for s in stats()) == 8 * fed
                     and max(s["in_step"] for s in stats()) == (16 if fed == 3 else 8),
                     f"the {phase} phase")
        start = time.monotonic()
        record = stop_async_run(topo, controller.training, controller.rollout,
                                cfg.learner.stop_timeout_s, lambda line: None)
        saved = Checkpointer(learners[0], topo.workers, tmp_path / phase, 0, 0).save(
            {"env_steps": 0}, force=True)
        elapsed = time.monotonic() - start
        print(f"{phase}: stop sequence {record['seconds']}s, with the final checkpoint "
              f"{elapsed:.1f}s")
        after = stats()
    finally:
        controller.shutdown()
    assert record["learners"] == "stopped together", record
    assert elapsed < 30.0, f"the stop took {elapsed:.1f}s"
    assert [s["version"] for s in after] == [version, version]
    assert read_meta(saved).version == version
    # trained: exactly the steps taken; the abandoned step's decisions are buffered again
    assert sum(s["samples_trained"] for s in after) == 32 * version
    assert sum(s["in_step"] for s in after) == 0
    assert sum(s["buffered"] for s in after) == buffered
