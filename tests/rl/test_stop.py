"""The stop sequence of an asynchronous run with two learner ranks, at every phase of a step,
asked of the running controller: it ends within 30 s with the controller's final checkpoint,
both ranks at one version, and a step that was not taken counts nothing as trained (its
decisions are buffered again); a rank that fails while stopping is reported and no final
checkpoint is taken. The data is fed to the queue by hand, so each phase is reached for sure
(real Ray, real DDP over gloo, real queue)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import ray
from ray import cloudpickle
from support.tiny_runs import TINY_RUN

from actors.rl.controller import Controller
from envs import env_spec, make_env
from rlvla3.checkpoint.files import read_meta
from rlvla3.checkpoint.trust import locate_checkpoint
from rlvla3.config import Named
from rlvla3.episode.tasks import TaskSampler
from rlvla3.policies import build_policy
from rlvla3.rollout.core import RolloutCore, collect_episodes
from rlvla3.run_config import load_run_config
from rlvla3.types import SegmentInfo

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


def failing_flush(learner) -> None:
    """Runs inside a learner (``__ray_call__``): abandoning the step under way raises, as a
    rank that crashes while the run stops would."""

    def flush():
        raise RuntimeError(f"injected: rank {learner.rank} failed while stopping")

    learner.core.flush = flush


class Running:
    """``Controller.run`` in a thread, the queue fed by the test: the controller's own stop
    sequence, final tick, checkpoint and ``summary.json``."""

    def __init__(self, cfg, run_dir):
        import threading

        self.controller = Controller(cfg, run_dir, quiet=True)
        self.topo = self.controller.build()
        ray.get(self.topo.queue.close_admissions.remote())  # the data comes from the test only
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.summary = self.controller.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self.error = exc

    def stats(self) -> list:
        return ray.get([lr.stats.remote() for lr in self.topo.learners])

    def stop(self, timeout_s: float = 90.0) -> dict:
        self.controller.request_stop("test")
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the run did not end"
        if self.error is not None:
            raise self.error
        return self.summary


def _config(micro_batch: int, *extra: str):
    return load_run_config("smoke", overrides=[
        *TINY_RUN, "learner.num_learners=2", "learner.num_cpus=0.5", "pipeline.mode=full",
        f"learner.micro_batch={micro_batch}", "checkpoint_every=0", "watchdog_s=0",
        "log_every_s=1", *extra])


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
    """A stop asked of the running controller (as a signal asks it): its stop sequence, then
    its own final checkpoint and summary."""
    run_dir = tmp_path / phase
    data = episodes(4 + fed)
    running = Running(_config(micro_batch), run_dir)
    try:
        learners = running.topo.learners
        feed(running.topo.queue, data[:4])  # one whole step for both ranks
        wait_for(lambda: all(s.version == 1 for s in running.stats()), "the first step")
        if phase == "stepping":
            ray.get(learners[0].__ray_call__.remote(slow_loss, 3.0))
        feed(running.topo.queue, data[4:])
        if phase == "stepping":
            time.sleep(1.0)
        else:
            # both episodes of "accumulating" may reach one rank (its request was in flight):
            # that rank then waits with a full batch, which the stop must abandon all the same
            reached = {16} if fed == 3 else {8, 16}
            wait_for(lambda: sum(s.buffered + s.in_step for s in running.stats())
                     == 8 * fed and max(s.in_step for s in running.stats()) in reached,
                     f"the {phase} phase")
        start = time.monotonic()
        summary = running.stop()
        elapsed = time.monotonic() - start
        after = running.stats()
    finally:
        running.controller.shutdown()
    record = summary["stop"]
    print(f"{phase}: stop sequence {record['seconds']}s, with the final checkpoint "
          f"{elapsed:.1f}s")
    assert record["learners"] == "stopped together", record
    assert elapsed < 30.0, f"the stop took {elapsed:.1f}s"
    assert [s.version for s in after] == [version, version]
    saved = locate_checkpoint(run_dir)  # the controller's final save
    assert read_meta(saved).version == version == summary["policy_version"]
    assert summary["stopped_by"] == "test"
    # trained: exactly the steps taken; the abandoned step's decisions are buffered again
    assert sum(s.samples_trained for s in after) == 32 * version
    assert sum(s.in_step for s in after) == 0
    assert sum(s.buffered for s in after) == buffered


def test_a_rank_that_fails_while_stopping_is_reported_and_no_final_checkpoint_is_taken(
        ray_cluster, tmp_path):
    """Both ranks crash while they abandon the step under way: their calls end in errors,
    which a wait counts as done. The stop says so with each rank's error, and the run ends at
    its last checkpoint (none here) instead of saving the state of a failed group."""
    run_dir = tmp_path / "failed"
    data = episodes(5)
    running = Running(_config(8, "learner.stop_timeout_s=20"), run_dir)
    try:
        for lr in running.topo.learners:
            ray.get(lr.__ray_call__.remote(failing_flush))
        feed(running.topo.queue, data[:4])
        wait_for(lambda: all(s.version == 1 for s in running.stats()), "the first step")
        # one episode: whichever rank pulls it accumulates its one micro-batch (two episodes
        # fed together may both reach one rank, which then waits with a full batch instead)
        feed(running.topo.queue, data[4:])
        wait_for(lambda: sorted(s.in_step for s in running.stats()) == [0, 8], "accumulating")
        summary = running.stop()
    finally:
        running.controller.shutdown()
    record = summary["stop"]
    assert record["learners"] == "failed", record
    assert len(record["errors"]) == 2 and all("injected" in e for e in record["errors"])
    assert record["final_checkpoint"].startswith("none")
    assert not (run_dir / "checkpoints").exists() or not any(
        (run_dir / "checkpoints").glob("step-*"))
