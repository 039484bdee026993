"""Ray-free tests of the pipeline's core pieces: config validation, the streaming learner,
weight swaps between batches, the trajectory queue's backpressure and staleness filter."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from envs import env_spec, make_env
from rlvla3.algos import AlgoConfig
from rlvla3.batcher import BatcherConfig, DynamicBatcher
from rlvla3.config import ConfigError, Named, build
from rlvla3.episode import TaskSampler
from rlvla3.learner import BatchStart, LearnerCore, StreamingStart
from rlvla3.policies import build_policy
from rlvla3.rollout import RolloutCore, collect_episodes
from rlvla3.run_config import RunConfig, check_resources, load_run_config
from rlvla3.types import EpisodeKey, WeightsMessage

REACH = Named("reach", {"image_size": 16, "max_decisions": 6})


# ---- config --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.b_max=0", "rollout.b_max"),
        ("rollout.t_max_ms=-1", "rollout.t_max_ms"),
        ("pipeline.mode=turbo", "pipeline.mode"),
        ("learner.micro_batch=0", "learner.micro_batch"),
        ("learner.global_batch=10", "learner.global_batch"),
        ("algo.clip_eps=1.5", "algo.clip_eps"),
        ("queue.max_staleness=-1", "queue.max_staleness"),
        ("rollout.bmax=3", "rollout.bmax"),
        ("env_workers.num_workers=two", "env_workers.num_workers"),
        ("pipeline.rollout=async", "pipeline.rollout"),
    ],
)
def test_invalid_config_names_the_field(override, field):
    cfg_override = [override]
    if override == "pipeline.rollout=async":
        cfg_override = ["pipeline.mode=sync", override]
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=cfg_override)
    assert err.value.field == field, str(err.value)


def test_unknown_preset_and_env_and_policy():
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_run_config("nope")
    cfg = load_run_config("smoke", overrides=["env.name=mars"])
    with pytest.raises(ConfigError) as err:
        env_spec(cfg.env)
    assert err.value.field == "env.name"
    with pytest.raises(ConfigError) as err:
        build_policy(Named("giant"), env_spec(REACH))
    assert err.value.field == "policy.name"
    with pytest.raises(ConfigError) as err:
        env_spec(Named("reach", {"image_size": 2}))
    assert err.value.field == "env.options.image_size"


def test_more_learners_than_cpus_is_rejected():
    cfg = load_run_config("smoke", overrides=["learner.num_learners=3", "learner.global_batch=96"])
    with pytest.raises(ConfigError) as err:
        check_resources(cfg, cpus_available=2, learners_only=True)
    assert err.value.field == "learner.num_learners"


def test_modes_map_to_strategies():
    modes = {m: load_run_config("smoke", overrides=[f"pipeline.mode={m}"]).strategies
             for m in ("sync", "disaggregated", "train_async", "rollout_async", "full")}
    assert modes["sync"].rollout == "lockstep" and modes["sync"].training == "sync"
    assert modes["disaggregated"].rollout == "pipelined"
    assert modes["train_async"].training == "async" and modes["train_async"].rollout == "pipelined"
    assert modes["rollout_async"].rollout == "async" and modes["rollout_async"].learner == "batch"
    assert modes["full"].learner == "streaming"
    one_off = load_run_config("smoke", overrides=["pipeline.mode=full", "pipeline.learner=batch"])
    assert one_off.strategies.learner == "batch" and one_off.strategies.rollout == "async"


def test_override_and_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: smoke\nlearner:\n  lr: 0.01\n")
    cfg = load_run_config(None, str(path), ["learner.lr=0.02", "seed=7"])
    assert cfg.learner.lr == 0.02 and cfg.seed == 7 and cfg.total_env_steps == 3000
    assert isinstance(build(RunConfig, {}), RunConfig)


# ---- helpers -----------------------------------------------------------------------------
def collect_segments(policy, n_episodes: int, seed: int = 0):
    """Real episodes of the reach env acted by ``policy`` through a RolloutCore."""
    return collect_episodes(make_env(REACH), RolloutCore(policy),
                            TaskSampler(range(4), range(5), seed), n_episodes, "test")


def make_policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_policy(Named("small", {"channels": 8, "hidden": 32}), env_spec(REACH))


# ---- learner -------------------------------------------------------------------------------
def test_streaming_accumulation_equals_one_full_batch_step():
    torch.manual_seed(0)
    segments = collect_segments(make_policy(1), 12)
    total = sum(len(s) for s in segments)
    batch = (total // 16) * 16
    algo = AlgoConfig("ppo", normalize_advantages=False)
    results = []
    for micro, strategy, arrivals in ((batch, BatchStart(), 1), (16, StreamingStart(), 4),
                                      (16, BatchStart(), 3)):
        policy = make_policy(2)
        core = LearnerCore(policy, algo, local_batch=batch, micro_batch=micro, lr=1e-2,
                           strategy=strategy)
        chunks = np.array_split(np.arange(len(segments)), arrivals)
        steps = 0
        for idx in chunks:
            core.add_segments([segments[i] for i in idx])
            steps += core.run_available()
        assert steps == 1 and core.version == 1
        results.append({k: v.clone() for k, v in policy.state_dict().items()})
    for other in results[1:]:
        for key, value in results[0].items():
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-4)


def test_streaming_starts_micro_batches_before_the_batch_is_complete():
    segments = collect_segments(make_policy(1), 8)
    total = sum(len(s) for s in segments)
    algo = AlgoConfig("ppo")
    streaming = LearnerCore(make_policy(2), algo, total, 4, 1e-3, StreamingStart())
    batch = LearnerCore(make_policy(2), algo, total, 4, 1e-3, BatchStart())
    for core in (streaming, batch):
        core.add_segments(segments[:4])
        core.run_available()
    assert streaming.samples_trained > 0 and streaming.version == 0
    assert batch.samples_trained == 0
    for core in (streaming, batch):
        core.add_segments(segments[4:])
        assert core.run_available() == 1
        assert core.buffered == 0 and core.samples_trained == total


def test_no_sample_dropped_or_reused_across_steps():
    segments = collect_segments(make_policy(1), 10)
    total = sum(len(s) for s in segments)
    core = LearnerCore(make_policy(2), AlgoConfig("ppo"), 7, 3, 1e-3, StreamingStart())
    core.add_segments(segments)
    steps = core.run_available()
    assert steps == total // 7
    assert core.samples_trained == steps * 7 + core.micro_done
    assert core.buffered == total - core.samples_trained


def test_grpo_learner_holds_episodes_until_their_group_is_complete():
    """Asynchronous slots finish a group's episodes at different times, interleaved with other
    groups: nothing of a group is trained on before all of it has arrived."""
    policy = make_policy(1)
    env, core = make_env(REACH), RolloutCore(policy)
    a = collect_episodes(env, core, TaskSampler([0], [0], 0), 3, "test")
    b = collect_episodes(env, core, TaskSampler([1], [2], 0), 3, "test")
    learner = LearnerCore(make_policy(2), AlgoConfig("grpo", group_size=3), 4, 2, 1e-3,
                          StreamingStart())
    learner.add_segments([a[0], b[0]])
    learner.add_segments([b[1], a[1]])
    assert learner.buffered == 0 and learner.held_episodes == 4
    learner.add_segments([a[2]])  # group a is whole: released, with its own advantages
    assert learner.buffered == sum(len(s) for s in a) and learner.held_episodes == 2
    learner.add_segments([b[2]])
    assert learner.buffered == sum(len(s) for s in a + b) and learner.held_episodes == 0


def test_learning_signal_improves_the_objective():
    """A few PPO steps on fixed data raise the log-prob of positive-advantage actions."""
    segments = collect_segments(make_policy(1), 16)
    policy = make_policy(1)
    core = LearnerCore(policy, AlgoConfig("ppo"), 32, 32, 3e-3, BatchStart())
    core.add_segments(segments)
    from rlvla3.samples import prepare_samples

    samples = prepare_samples(segments, AlgoConfig("ppo"))
    before = core.loss(samples)[0].item()
    while core.buffered >= 32:
        core.run_available()
        core.add_segments(segments)
        if core.version >= 6:
            break
    assert core.loss(samples)[0].item() < before


# ---- rollout: weights swap only between batches ------------------------------------------
def test_weights_swap_only_between_batches():
    spec = env_spec(REACH)
    policy = make_policy(0)
    core = RolloutCore(policy, deterministic=True)
    obs = make_env(REACH).reset(0, 0)
    versions = {}
    base = copy.deepcopy(policy.state_dict())
    for v in range(1, 6):
        state = {k: t.clone() for k, t in base.items()}
        state["mean_head.2.bias"] = torch.full_like(state["mean_head.2.bias"], float(v))
        state["mean_head.2.weight"] = torch.zeros_like(state["mean_head.2.weight"])
        versions[v] = WeightsMessage(v, {k: t.numpy() for k, t in state.items()})

    async def scenario():
        batcher = DynamicBatcher(core.act_batch, BatcherConfig(b_max=4, t_max_ms=1.0),
                                 between_batches=lambda: asyncio.sleep(0, core.swap_pending()))

        async def offer():
            for v in range(1, 6):
                await asyncio.sleep(0.002)
                core.offer_weights(versions[v])

        results = await asyncio.gather(offer(), *(batcher.submit(obs) for _ in range(200)))
        await batcher.close()
        return results[1:]

    chunks = asyncio.run(scenario())
    seen = set()
    for chunk in chunks:
        seen.add(chunk.policy_version)
        if chunk.policy_version > 0:  # the action is exactly what its tagged version computes
            np.testing.assert_allclose(chunk.actions, chunk.policy_version, atol=1e-6)
    assert len(seen) >= 2
    assert spec.chunk_len == chunks[0].actions.shape[0]


# ---- trajectory queue -------------------------------------------------------------------------
def _info(min_version: int):
    from actors.trajectory_queue import SegmentInfo

    return SegmentInfo("w0/s0", EpisodeKey(0, 0), 3, 6, min_version, 1.0, True)


def test_queue_staleness_filter_and_backpressure():
    from actors.trajectory_queue import TrajectoryQueue
    from rlvla3.run_config import QueueConfig

    async def scenario():
        queue = TrajectoryQueue(QueueConfig(capacity=3, max_staleness=2))
        for v in (0, 1, 3):
            await queue.put(_info(v), [f"ref{v}"])
        blocked = asyncio.create_task(queue.put(_info(4), ["ref4"]))
        await asyncio.sleep(0.05)
        assert not blocked.done(), "a full queue must make put wait (backpressure)"
        queue.set_version(4)
        got = await queue.get(max_items=2, timeout_s=1.0)
        await asyncio.wait_for(blocked, 1.0)
        rest = await queue.get(max_items=10, timeout_s=1.0)
        empty = await queue.get(max_items=10, timeout_s=0.05)
        return got, rest, empty, queue.stats()

    got, rest, empty, stats = asyncio.run(scenario())
    assert [refs[0] for _, refs in got] == ["ref3"]  # versions 0 and 1 are > 2 behind 4
    assert [refs[0] for _, refs in rest] == ["ref4"]
    assert empty == []
    assert stats["dropped_stale"] == 2 and stats["got"] == 2
    assert stats["staleness_hist"] == {0: 1, 1: 1}


def test_weight_broadcaster_delivers_exact_tensors():
    """The collective weight path (gloo on CPU; NCCL on GPUs runs the same code)."""
    import socket
    import threading

    from rlvla3.weight_sync import WeightBroadcaster

    policy = make_policy(3)
    template = policy.state_dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    received = {}

    def receiver(rank: int) -> None:
        channel = WeightBroadcaster(template, "127.0.0.1", port, rank, 3, timeout_s=60)
        received[rank] = [channel.receive() for _ in range(2)]

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightBroadcaster(template, "127.0.0.1", port, 0, 3, timeout_s=60)
    sender.send(template, 7)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in template.items()}
    sender.send(changed, 8)
    for t in threads:
        t.join(60)
    for rank in (1, 2):
        (v1, first), (v2, second) = received[rank]
        assert (v1, v2) == (7, 8)
        for name, tensor in template.items():
            np.testing.assert_array_equal(first[name], tensor.numpy())
            np.testing.assert_array_equal(second[name], changed[name].numpy())
