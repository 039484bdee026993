"""The learner core with queue items as units: GRPO groups of any size, staleness judged per
group by its oldest decision, advantage standardisation over recent batches, a step abandoned by
the ranks' agreement, and the proximal window's refresh cadence (Ray-free)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from support.reach_episodes import collect_segments, episodes, make_policy

from rlvla3.algos.config import AlgoConfig
from rlvla3.learner.core import BatchStart, LearnerCore, StreamingStart
from rlvla3.learner.step import AdvantageNormalizer
from rlvla3.weight_sync import parameter_sum


def _group(segments, versions_by_episode, returns):
    """One GRPO group: ``segments`` re-stamped with one policy version per episode and the
    given returns (the last reward of each episode)."""
    out = []
    for seg, version, ret in zip(segments, versions_by_episode, returns, strict=True):
        rewards = np.zeros(len(seg), np.float32)
        rewards[-1] = ret
        out.append(replace(seg, policy_versions=np.full(len(seg), version, np.int64),
                           rewards=rewards, key=segments[0].key))
    return out


def test_staleness_keeps_or_discards_a_grpo_group_whole_by_its_oldest_decision():
    """A success ends early, so its decisions are its group's oldest. A floor that reaches it
    discards the whole group (counted) instead of taking the success and training the failures
    alone with their negative advantages; a group already started is finished."""
    segments = collect_segments(make_policy(1), 8)
    algo = AlgoConfig("grpo", group_size=4)
    core = LearnerCore(make_policy(2), algo, 10_000, 4, 1e-3, StreamingStart(), max_staleness=2)
    core.version = 5
    stale = _group(segments[:4], [2, 4, 4, 5], [1.0, 0.0, 0.0, 0.0])  # success at v2: 3 behind
    fresh = _group(segments[4:], [3, 4, 5, 5], [1.0, 1.0, 0.0, 0.0])
    core.add_groups([stale, fresh])
    assert core.buffered == sum(len(s) for s in fresh)
    assert core.counts["discarded_decisions"] == sum(len(s) for s in stale)
    assert core.counts["discarded_groups"] == 1
    # what is buffered is the fresh group with its zero-sum advantages, complete
    assert core.buffer.peek(core.buffered).advantages.sum() == pytest.approx(0.0, abs=1e-4)

    started = LearnerCore(make_policy(2), algo, 8, 4, 1e-3, StreamingStart(), max_staleness=2)
    started.add_groups([fresh])
    started.run_available(until_version=1)  # takes the group's first 8 decisions
    started.version = 6  # its oldest decision (v3) is now 3 behind: but it was started
    started._discard_stale()
    assert started.counts["discarded_decisions"] == 0
    assert started.buffered == sum(len(s) for s in fresh) - 8


def test_short_and_singleton_grpo_groups_train_and_are_counted():
    segments = collect_segments(make_policy(1), 3)
    algo = AlgoConfig("grpo", group_size=4)
    core = LearnerCore(make_policy(2), algo, 4, 4, 1e-3, BatchStart())
    core.add_groups([_group(segments[:2], [0, 0], [1.0, 0.0]), _group(segments[2:], [0], [1.0])])
    assert core.counts["short_groups"] == 2 and core.counts["singleton_groups"] == 1
    assert core.counts["received_groups"] == 2
    total = core.buffered
    tail = core.buffer.peek(total).advantages[-len(segments[2]):]
    np.testing.assert_array_equal(tail, 0.0)  # a group of one has nothing to compare with
    core.run_available()
    assert core.samples_trained == (total // 4) * 4


def test_advantage_standardisation_over_recent_batches_is_stable_with_sparse_successes():
    """Batches of 1-3 episodes, one episode in ten a success (+4 above the failures): taking
    mean and std from the previous batch alone, a batch after a success-free one puts a new
    success at ~+14 and the batch means swing by several standard deviations; the default
    average over recent batches keeps the standardised batch means near 0."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(400):
        n = int(rng.integers(1, 4))
        batches.append(np.concatenate([rng.normal(-0.3, 0.3, 64 // n)
                                       + (4.0 if rng.random() < 0.1 else 0.0)
                                       for _ in range(n)]))

    def batch_means(decay: float) -> np.ndarray:
        norm = AdvantageNormalizer(True, lambda m: m, decay)
        norm.seed(batches[0])
        means = []
        for b in batches:
            means.append(norm.apply(b).mean())
            norm.end_step()
        return np.array(means[20:])

    previous, default = batch_means(0.0), batch_means(AlgoConfig("ppo").advantage_ema)
    assert default.std() < 0.4 * previous.std(), (default.std(), previous.std())
    assert abs(default.mean()) < 0.2 < abs(previous.mean())


def test_a_step_abandoned_by_the_ranks_agreement_trains_nothing_and_keeps_its_data():
    """A full local batch, but another rank abandons the step (it flushed at a stop): no
    optimizer step, nothing counted as trained, every decision back in the buffer, stop
    agreed. Training later takes the same step as a core that never saw the abandon."""
    segments = collect_segments(make_policy(1), 6)
    batch = 16
    peer = {"flags": np.array([1.0, 1.0, 0.0, 1.0])}  # the other rank: abandon, stop

    def reduce(values: np.ndarray) -> np.ndarray:  # the step agreement is the 4-vector
        return values + peer["flags"] if len(values) == 4 else values

    algo = AlgoConfig("ppo")
    core = LearnerCore(make_policy(2), algo, batch, 8, 1e-2, StreamingStart(), reduce=reduce)
    core.add_groups(episodes(segments))
    received = core.buffered
    weights = parameter_sum(core.policy)
    assert core.run_available() == 0
    assert core.version == 0 and core.samples_trained == 0 and core.in_step == 0
    assert core.buffered == received and core.stop_agreed
    assert core.counts["abandoned_steps"] == 1 and parameter_sum(core.policy) == weights
    assert all(p.grad is None for p in core.policy.parameters())
    peer["flags"] = np.array([0.0, 0.0, 0.0, 1.0])
    assert core.run_available(until_version=1) == 1 and not core.stop_agreed
    plain = LearnerCore(make_policy(2), algo, batch, 8, 1e-2, StreamingStart())
    plain.add_groups(episodes(segments))
    plain.run_available(until_version=1)
    assert core.samples_trained == plain.samples_trained == batch
    for (k, a), b in zip(core.policy.state_dict().items(), plain.policy.state_dict().values(),
                         strict=True):
        torch.testing.assert_close(a, b, msg=k)


def test_flush_leaves_a_partial_accumulation_untrained():
    """Half a batch accumulated, no more data: ``flush`` runs the step's collectives with a
    zero-weight stand-in and abandons the step; the half batch is buffered again."""
    segments = collect_segments(make_policy(1), 3)
    total = sum(len(s) for s in segments)
    core = LearnerCore(make_policy(2), AlgoConfig("ppo"), total + 8, 8, 1e-2, StreamingStart())
    core.normalizer.seed(np.zeros(1))  # let the stream start before the batch is whole
    core.add_groups(episodes(segments))
    core.run_available()
    assert core.in_step == (total // 8) * 8 > 0
    assert core.flush()
    assert core.in_step == 0 and core.buffered == total and core.samples_trained == 0
    assert core.version == 0 and core.counts["abandoned_steps"] == 1
    empty = LearnerCore(make_policy(2), AlgoConfig("ppo"), 8, 8, 1e-2, StreamingStart())
    assert not empty.flush()  # no sample to stand in with


def test_the_proximal_copy_is_refreshed_every_window_steps_and_only_then():
    segments = collect_segments(make_policy(1), 20)
    policy = make_policy(2)
    core = LearnerCore(policy, AlgoConfig("ppo", proximal_window=3), 8, 8, 1e-2, BatchStart())
    core.add_groups(episodes(segments))
    seen = []
    for version in range(1, 8):
        core.run_available(until_version=version)
        same = parameter_sum(core.engine.shadow) == parameter_sum(policy)
        seen.append((version, core.proximal.synced_at, same))
    assert seen == [(1, 0, False), (2, 0, False), (3, 3, True), (4, 3, False), (5, 3, False),
                    (6, 6, True), (7, 6, False)]


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_a_resumed_ppo_learner_steps_as_the_uninterrupted_one(tmp_path, sharded):
    """A PPO step depends on more than weights, Adam and the version: the advantage
    normaliser's running moments, the proximal copy (window 2: at version 3 it holds version
    2's parameters) and the learning rate ``target_kl`` adapts. A learner restored
    from a checkpoint at version 3 (whole, as rank 0 of DDP writes it, or sharded, as FSDP
    ranks do: the same ``LearnerCore`` copies the learner actor saves) takes the next two
    steps exactly as the learner that saved it."""
    from rlvla3.checkpoint.files import (
        CheckpointMeta,
        save_run_checkpoint,
        save_sharded_run_checkpoint,
    )
    from rlvla3.config import Named
    from rlvla3.engine.group import Ranks
    from rlvla3.learner.samples import Samples, prepare_samples

    algo = AlgoConfig("ppo", proximal_window=2, advantage_ema=0.9, target_kl=1e-4)
    data = Samples.concat([prepare_samples(item, algo)
                           for item in episodes(collect_segments(make_policy(1), 60))])
    batch = 16
    assert len(data) >= 5 * batch

    def train(core, steps):
        for step in steps:
            core.buffer.add(data.select(np.arange(step * batch, (step + 1) * batch)))
            core.run_available(until_version=step + 1)

    def learner(seed):
        return LearnerCore(make_policy(seed), algo, batch, 8, 1e-3, BatchStart())

    straight = learner(2)
    train(straight, range(3))
    state = straight.state()
    assert state.normalizer.average is not None and state.proximal_synced_at == 2
    assert straight.engine.lr != 1e-3  # target_kl moved it
    choice = Named("small", {"channels": 8, "hidden": 32})
    meta = CheckpointMeta(choice, straight.policy.spec, straight.version,
                          learner=state.as_json())
    run = tmp_path / "run"
    if sharded:
        straight.take_snapshot()
        version, tensors, state = straight.pop_snapshot()
        save_sharded_run_checkpoint(run, tensors, replace(meta, learner=state.as_json()),
                                    Ranks(), straight.engine.optimizer_meta(),
                                    torch.get_rng_state())
    else:
        copy = straight.copy_whole()
        save_run_checkpoint(run, copy.weights, replace(meta, learner=copy.state.as_json()),
                            copy.optimizer, rng=copy.rng, shadow=copy.shadow)
    train(straight, range(3, 5))

    resumed = learner(7)  # other initial weights: everything must come from the checkpoint
    assert resumed.restore(str(run)).version == 3
    assert resumed.state() == state
    train(resumed, range(3, 5))
    assert resumed.version == straight.version == 5
    assert resumed.engine.lr == straight.engine.lr
    for (name, a), b in zip(straight.policy.state_dict().items(),
                            resumed.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=name)
