"""Ray-free tests of the pipeline's core pieces: config validation, the streaming learner,
weight swaps between batches, weight broadcast and the group buffer (the task sampler's tests
are in ``test_task_sampler.py``, the trajectory queue's in ``test_trajectory_queue.py``)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from support.reach_episodes import REACH, collect_segments, episodes, make_policy

from envs import env_spec, make_env
from rlvla3.algos.config import AlgoConfig
from rlvla3.config import ConfigError, Named, build
from rlvla3.learner.core import BatchStart, LearnerCore, StreamingStart
from rlvla3.policies import build_policy
from rlvla3.rollout.batcher import DynamicBatcher
from rlvla3.rollout.batching import FixedBatching
from rlvla3.rollout.core import RolloutCore
from rlvla3.run_config import RunConfig, check_resources, load_run_config
from rlvla3.types import WeightsMessage


# ---- config --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.batching.options.b_max=0", "rollout.batching.options.b_max"),
        ("rollout.batching.options.t_max_ms=-1", "rollout.batching.options.t_max_ms"),
        ("rollout.batching.options.b_limit=8", "rollout.batching.options.b_limit"),
        ("pipeline.mode=turbo", "pipeline.mode"),
        ("learner.micro_batch=0", "learner.micro_batch"),
        ("learner.global_batch=10", "learner.global_batch"),
        ("learner.weight_sync=collectve", "learner.weight_sync"),
        ("learner.torch_threads=0", "learner.torch_threads"),
        ("learner.offload=true", "learner.offload"),  # one rank: nothing to offload
        ("algo.clip_eps=1.5", "algo.clip_eps"),
        ("queue.max_staleness=-1", "queue.max_staleness"),
        ("rollout.bmax=3", "rollout.bmax"),
        ("env_workers.num_workers=two", "env_workers.num_workers"),
        ("pipeline.rollout=async", "pipeline.rollout"),
        ("target_success=90", "target_success"),
        ("target_window=100000", "target_window"),
    ],
)
def test_invalid_config_names_the_field(override, field):
    cfg_override = [override]
    if override == "pipeline.rollout=async":
        cfg_override = ["pipeline.mode=sync", override]
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=cfg_override)
    assert err.value.field == field, str(err.value)


def test_no_shipped_preset_is_written_in_an_old_spelling(capsys):
    """A preset as shipped reads without the warning an old field name gets (``groot_libero``
    had ``algo.max_grad_norm``, now ``learner.max_grad_norm``)."""
    from actors.sft.sft_config import upgrade as upgrade_sft
    from rlvla3.config import load_mapping, preset_names
    from rlvla3.run_config import upgrade

    for name in preset_names():
        upgrade(load_mapping(name))
    for name in preset_names("rlvla3.presets.sft"):
        upgrade_sft(load_mapping(name, package="rlvla3.presets.sft"))
    assert "spelled" not in capsys.readouterr().err
    upgrade({"algo": {"max_grad_norm": 1.0}})  # an old spelling still says so
    assert "'algo.max_grad_norm' is spelled 'learner.max_grad_norm'" in capsys.readouterr().err


def test_the_learners_sharding_has_one_name_and_the_old_one_reads_with_a_warning(capsys):
    """``learner.sharding`` (``rl``) and ``sharding`` (``sft``) say how the learners hold the
    model; the old ``strategy`` spellings build the same config with one warning line, and
    the new spelling, given beside an old one, wins."""
    from actors.sft.sft_config import SFTConfig
    from actors.sft.sft_config import upgrade as upgrade_sft

    cfg = load_run_config("smoke", overrides=["learner.strategy=fsdp"])
    assert cfg.learner.sharding == "fsdp" and cfg.learner.engine().sharding == "fsdp"
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "'learner.strategy' is spelled 'learner.sharding'" in err
    both = load_run_config("smoke", overrides=["learner.strategy=fsdp", "learner.sharding=ddp"])
    assert both.learner.sharding == "ddp"
    sft = build(SFTConfig, upgrade_sft({"lake": {"datasets": ["d"]}, "strategy": "fsdp",
                                           "num_learners": 2}))
    assert sft.sharding == "fsdp" and sft.engine().sharding == "fsdp"
    assert "'strategy' is spelled 'sharding'" in capsys.readouterr().err
    with pytest.raises(ConfigError) as bad:
        load_run_config("smoke", overrides=["learner.sharding=zero3"])
    assert bad.value.field == "learner.sharding"


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


def test_a_preset_of_rl_after_sft_starts_from_its_committed_checkpoint_or_refuses():
    """``metaworld_mt10`` ships its SFT checkpoint as ``init_from``; without one it is refused
    in one line naming the field, not run for thousands of steps in which every group fails."""
    cfg = load_run_config("metaworld_mt10")
    assert cfg.needs_init_from and cfg.init_from == "results/metaworld_mt10/mw_sft"
    assert cfg.policy.options["image_size"]  # the checkpoint's options were adopted
    with pytest.raises(ConfigError) as err:
        load_run_config("metaworld_mt10", overrides=["init_from="])
    assert err.value.field == "init_from" and "--set init_from=RUN_DIR" in str(err.value)
    assert not load_run_config("smoke").needs_init_from


def test_more_learners_than_cpus_is_rejected():
    cfg = load_run_config("smoke", overrides=["learner.num_learners=3", "learner.global_batch=96"])
    with pytest.raises(ConfigError) as err:
        check_resources(cfg, cpus_available=2, learners_only=True)
    assert err.value.field == "learner.num_learners"


def test_modes_map_to_strategies():
    modes = {m: load_run_config("smoke", overrides=[f"pipeline.mode={m}"]).choices
             for m in ("sync", "disaggregated", "train_async", "rollout_async", "full")}
    assert modes["sync"].rollout == "lockstep" and modes["sync"].training == "sync"
    assert modes["disaggregated"].rollout == "pipelined"
    assert modes["train_async"].training == "async" and modes["train_async"].rollout == "pipelined"
    assert modes["rollout_async"].rollout == "async" and modes["rollout_async"].learner == "batch"
    assert modes["full"].learner == "streaming"
    one_off = load_run_config("smoke", overrides=["pipeline.mode=full", "pipeline.learner=batch"])
    assert one_off.choices.learner == "batch" and one_off.choices.rollout == "async"


def test_override_and_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: smoke\nlearner:\n  lr: 0.01\n")
    cfg = load_run_config(None, str(path), ["learner.lr=0.02", "seed=7"])
    assert cfg.learner.lr == 0.02 and cfg.seed == 7 and cfg.total_env_steps == 3000
    assert isinstance(build(RunConfig, {}), RunConfig)
    # YAML 1.1 reads 3e-4 (no dot) as a string: a float field still takes it
    assert load_run_config("smoke", overrides=["learner.lr=3e-4"]).learner.lr == 3e-4
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=["learner.lr=fast"])
    assert err.value.field == "learner.lr"


# ---- learner -------------------------------------------------------------------------------
def test_accumulation_and_streaming_equal_full_batch_steps_with_normalisation():
    """Three optimizer steps with batch-level advantage standardisation and the proximal copy
    refreshed every second step (so the second step clips around weights one step old): one
    micro-batch per step, streamed micro-batches over five arrivals and batch-start
    micro-batches over three arrivals give the same parameters."""
    torch.manual_seed(0)
    segments = collect_segments(make_policy(1), 40)
    total = sum(len(s) for s in segments)
    batch = (total // 64) * 16
    assert 3 * batch <= total
    algo = AlgoConfig("ppo", proximal_window=2)
    assert algo.normalize_advantages and algo.proximal == "window"
    results = []
    for micro, start, arrivals in ((batch, BatchStart(), 1), (16, StreamingStart(), 5),
                                      (16, BatchStart(), 3)):
        policy = make_policy(2)
        core = LearnerCore(policy, algo, local_batch=batch, micro_batch=micro, lr=1e-2,
                           start=start)
        for idx in np.array_split(np.arange(len(segments)), arrivals):
            core.add_groups(episodes([segments[i] for i in idx]))
            core.run_available(until_version=3)
        assert core.version == 3 and core.proximal.synced_at == 2
        results.append({k: v.clone() for k, v in policy.state_dict().items()})
    for other in results[1:]:
        for key, value in results[0].items():
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-4)


def test_update_epochs_step_again_on_the_same_batch_and_count_it_once():
    """With ``update_epochs = 2`` one batch gives two optimizer steps, the same parameters as
    training that batch twice with one epoch (same standardised advantages, the proximal copy
    not refreshed in between), whether it streamed in or arrived whole; its decisions count as
    trained once, and the second step needs no new data."""
    segments = collect_segments(make_policy(1), 12)
    batch = sum(len(s) for s in segments)
    results, cores = [], []
    for epochs, micro, start, arrivals in ((1, batch, BatchStart(), 1),
                                              (2, batch, BatchStart(), 1),
                                              (2, 8, StreamingStart(), 4)):
        policy = make_policy(2)
        core = LearnerCore(policy, AlgoConfig("ppo", update_epochs=epochs), local_batch=batch,
                           micro_batch=micro, lr=1e-2, start=start)
        for idx in np.array_split(np.arange(len(segments)), arrivals):
            core.add_groups(episodes([segments[i] for i in idx]))
            core.run_available()
        if epochs == 1:  # the same batch once more, as a second batch
            core.add_groups(episodes(segments))
            core.run_available()
        assert core.version == 2 and core.epoch == 0 and core.buffered == 0
        results.append({k: v.clone() for k, v in policy.state_dict().items()})
        cores.append(core)
    for other in results[1:]:
        for key, value in results[0].items():
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(results[0][k], v) for k, v in make_policy(2).state_dict().items())
    for core in cores[1:]:
        assert core.samples_trained == batch == sum(core.staleness_hist.values())
        assert core.counts["trained_env_steps"] == cores[0].counts["trained_env_steps"] // 2
    with pytest.raises(ValueError, match="update_epochs"):
        AlgoConfig("ppo", update_epochs=0).validate()


def test_a_step_with_a_non_finite_gradient_leaves_the_weights_and_is_counted():
    """A NaN in the data (here one reward) makes the loss and the gradient NaN: the optimizer
    step is skipped and counted, and the weights the servers get stay finite."""
    segments = collect_segments(make_policy(1), 4)
    bad = copy.deepcopy(segments[0])
    bad.rewards[0] = np.nan
    batch = sum(len(s) for s in segments)
    policy = make_policy(2)
    core = LearnerCore(policy, AlgoConfig("ppo"), local_batch=batch, micro_batch=batch, lr=1e-2,
                       start=BatchStart())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    core.add_groups(episodes([bad, *segments[1:]]))
    assert core.run_available() == 1
    assert core.counts["skipped_steps"] == 1
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    core.add_groups(episodes(segments))  # finite data: the next step trains
    core.run_available()
    assert core.counts["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in policy.state_dict().values())
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_kl_learning_rate_moves_outside_its_band_within_its_bounds():
    from rlvla3.learner.kl_control import KlLearningRate

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    control = KlLearningRate(optimizer, 1e-3, target=0.1, factor=2.0, min_scale=0.25,
                             max_scale=4.0)
    assert [control.update(kl) for kl in (0.1, 0.05, 0.2)] == [1e-3] * 3  # in [target/2, 2 x]
    assert [control.update(1.0) for _ in range(3)] == [5e-4, 2.5e-4, 2.5e-4]  # floor lr / 4
    assert control.update(float("nan")) == 2.5e-4  # not finite: too high
    assert [control.update(0.01) for _ in range(5)] == [5e-4, 1e-3, 2e-3, 4e-3, 4e-3]
    assert optimizer.param_groups[0]["lr"] == 4e-3
    with pytest.raises(ValueError, match="target_kl"):
        AlgoConfig("ppo", target_kl=0.0).validate()
    with pytest.raises(ValueError, match="kl_lr_min_scale"):
        AlgoConfig("ppo", target_kl=0.1, kl_lr_max_scale=0.5).validate()


@pytest.mark.parametrize("target, direction", [(1e-12, "down"), (1e6, "up")])
def test_target_kl_adapts_the_rate_when_a_proximal_window_closes(target, direction):
    """With ``target_kl`` the learner compares each closed proximal window's KL per decision
    (averaged over the ranks) with the target: far above it the rate falls, far below it
    rises, by ``kl_lr_factor`` per window, and the steps inside a window leave it alone. The
    rate lives in the optimizer state, so a checkpoint's optimizer state carries it."""
    segments = collect_segments(make_policy(1), 24)
    batch = sum(len(s) for s in segments) // 4
    reduced = []

    def reduce(values):  # one rank: the identity, recorded
        reduced.append(values.copy())
        return values

    algo = AlgoConfig("ppo", proximal_window=2, target_kl=target, kl_lr_factor=2.0)
    core = LearnerCore(make_policy(2), algo, local_batch=batch, micro_batch=batch, lr=1e-3,
                       start=BatchStart(), reduce=reduce)
    stats = []
    core.add_groups(episodes(segments))
    core.run_available(on_step=stats.append, until_version=4)
    factor = 0.5 if direction == "down" else 2.0
    assert [s.lr for s in stats] == pytest.approx([1e-3, 1e-3 * factor, 1e-3 * factor,
                                                   1e-3 * factor**2])
    kl_reductions = [v for v in reduced if len(v) == 2 and v[1] == 1.0]
    assert len(kl_reductions) == 2  # once per closed window, on every rank alike
    assert [s.update_kl is None for s in stats] == [True, False, True, False]
    assert all(s.update_kl > 0 for s in stats[1::2])  # the window had drifted
    assert core.optimizer.state_dict()["param_groups"][0]["lr"] == pytest.approx(
        1e-3 * factor**2)
    fixed = LearnerCore(make_policy(2), AlgoConfig("ppo", proximal_window=2), local_batch=batch,
                        micro_batch=batch, lr=1e-3, start=BatchStart())
    assert fixed.kl_lr is None


@pytest.mark.parametrize("proximal", ["step", "behaviour"])
def test_target_kl_measures_each_step_after_its_update(proximal):
    """Without a window every step is a trust region: the KL is that of the update just
    applied, measured after it. Read in the step's own forward pass it would be exactly 0
    and the rate would grow by the factor every step up to its cap whatever the update did;
    a target far below any real drift must bring the rate down every step."""
    segments = collect_segments(make_policy(1), 24)
    batch = sum(len(s) for s in segments) // 4
    algo = AlgoConfig("ppo", proximal=proximal, target_kl=1e-9, kl_lr_factor=1.5)
    core = LearnerCore(make_policy(2), algo, local_batch=batch, micro_batch=batch // 2,
                       lr=1e-3, start=BatchStart())
    stats = []
    core.add_groups(episodes(segments))
    core.run_available(on_step=stats.append, until_version=4)
    assert [s.lr for s in stats] == pytest.approx([1e-3 / 1.5 ** (k + 1) for k in range(4)])
    assert all(s.update_kl is not None and s.update_kl > 0 for s in stats)


def test_target_kl_measures_the_whole_window():
    """A window of three steps: the KL the controller reads at its close is that between the
    parameters at the window's start and after its third update, on the closing step's last
    micro-batch (not the two steps a forward pass before the last update would see)."""
    from rlvla3.algos.losses import approx_kl

    class Recording(LearnerCore):
        def _drift(self):
            self.probes.append(self._probe[0])
            return super()._drift()

    segments = collect_segments(make_policy(1), 24)
    batch = sum(len(s) for s in segments) // 4
    algo = AlgoConfig("ppo", proximal_window=3, target_kl=1e-3)
    core = Recording(make_policy(2), algo, local_batch=batch, micro_batch=batch, lr=1e-2,
                     start=BatchStart())
    core.probes = []
    start = copy.deepcopy(core.policy)
    stats, versions = [], []

    def on_step(step):
        stats.append(step)
        versions.append(copy.deepcopy(core.policy))

    core.add_groups(episodes(segments))
    core.run_available(on_step=on_step, until_version=3)
    probe = core.probes[0]
    obs, actions, latents = probe.obs, torch.from_numpy(probe.actions), torch.from_numpy(
        probe.latents)
    with torch.no_grad():  # per Gaussian, as the trust region sees them
        before = start.evaluate(obs, actions, latents).log_prob_elements
        kl = [approx_kl(v.evaluate(obs, actions, latents).log_prob_elements, before,
                        before.shape[1])[1] for v in versions]
    assert stats[-1].update_kl == pytest.approx(kl[2], rel=1e-5)  # after the third update
    assert abs(kl[2] - kl[1]) > 1e-3 * kl[2] > 0  # not what two steps had moved
def test_advantage_normaliser_uses_whole_batches_of_all_ranks():
    from rlvla3.learner.step import AdvantageNormalizer

    other_rank = np.array([2.0, 2.0 * 3.0, 2.0 * 9.0])  # two samples of 3.0 on another rank
    norm = AdvantageNormalizer(True, reduce=lambda m: m + other_rank)
    assert not norm.ready
    norm.seed(np.array([1.0, 1.0]))  # union [1, 1, 3, 3]: mean 2, std 1
    assert (norm.mu, norm.sigma) == pytest.approx((2.0, 1.0))
    # a single good episode in a micro-batch is scaled by the batch's constants, not to zero
    np.testing.assert_allclose(norm.apply(np.array([5.0])), [3.0], rtol=1e-6)
    np.testing.assert_allclose(norm.apply(np.array([1.0])), [-1.0], rtol=1e-6)
    norm.end_step()  # this step's batch [5, 1] + the other rank's [3, 3]: mean 3, var 2
    assert (norm.mu, norm.sigma) == pytest.approx((3.0, np.sqrt(2.0)))
    off = AdvantageNormalizer(False, reduce=lambda m: m)
    assert off.ready and off.apply(np.array([5.0]))[0] == 5.0


def test_streaming_starts_micro_batches_before_the_batch_is_complete():
    """The first step waits for its whole batch (its statistics seed the normaliser); later
    steps stream."""
    segments = collect_segments(make_policy(1), 16)
    half = sum(len(s) for s in segments[:8])
    total = sum(len(s) for s in segments)
    algo = AlgoConfig("ppo")
    streaming = LearnerCore(make_policy(2), algo, half, 4, 1e-3, StreamingStart())
    batch = LearnerCore(make_policy(2), algo, half, 4, 1e-3, BatchStart())
    for core in (streaming, batch):
        core.add_groups(episodes(segments[:8]))
        assert core.run_available() == 1
        core.add_groups(episodes(segments[8:12]))
        core.run_available()
    # streaming took micro-batches of the second batch (not trained until its step is taken)
    assert streaming.samples_trained == half and streaming.in_step > 0
    assert streaming.version == 1
    assert batch.samples_trained == half and batch.in_step == 0
    for core in (streaming, batch):
        core.add_groups(episodes(segments[12:]))
        core.run_available()
        assert core.buffered == total - core.samples_trained and core.in_step == 0


def test_no_sample_dropped_or_reused_across_steps():
    segments = collect_segments(make_policy(1), 10)
    total = sum(len(s) for s in segments)
    core = LearnerCore(make_policy(2), AlgoConfig("ppo"), 7, 3, 1e-3, StreamingStart())
    core.add_groups(episodes(segments))
    steps = core.run_available()
    assert steps == total // 7
    assert core.samples_trained == steps * 7
    assert core.buffered == total - core.samples_trained - core.in_step
    assert core.counts["trained_env_steps"] > 0
    assert sum(core.staleness_hist.values()) == core.samples_trained


def test_learning_signal_improves_the_objective():
    """A few PPO steps on fixed data raise the log-prob of positive-advantage actions."""
    segments = collect_segments(make_policy(1), 16)
    policy = make_policy(1)
    core = LearnerCore(policy, AlgoConfig("ppo"), 32, 32, 3e-3, BatchStart())
    core.add_groups(episodes(segments))
    from rlvla3.learner.samples import prepare_samples

    samples = prepare_samples(segments, AlgoConfig("ppo"))
    before = core.loss(core.with_proximal(samples))[0].item()
    while core.buffered >= 32:
        core.run_available()
        core.add_groups(episodes(segments))
        if core.version >= 6:
            break
    assert core.loss(core.with_proximal(samples))[0].item() < before


# ---- rollout ---------------------------------------------------------------------------------
def test_each_server_and_incarnation_samples_its_own_noise():
    from actors.roles.rollout_server import sampling_seed

    first = [sampling_seed(0, server) for server in range(3)]
    restarted = [sampling_seed(0, 0, incarnation) for incarnation in ("a1b2", "c3d4")]
    assert len(set(first + restarted)) == 5
    assert sampling_seed(0, 1) == first[1]  # a run's first incarnations are reproducible
    obs = make_env(REACH).reset(0, 0)
    acts = []
    for seed in (first[0], first[1], first[0]):
        policy = make_policy(3)
        policy.seed_sampling(seed)
        acts.append(RolloutCore(policy).act_batch([obs])[0].actions)
    assert not np.allclose(acts[0], acts[1])
    np.testing.assert_array_equal(acts[0], acts[2])


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
        batcher = DynamicBatcher(core.act_batch, FixedBatching(4, 0.001),
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


def test_a_rollback_is_a_lineage_no_late_offer_undoes():
    """A lane at version 20 is rolled back to a restored learner's version 12 (a new lineage).
    Offers the old learner sent before it died arrive late, before and after the swap: none of
    them replaces the rollback, and the restored learner's next versions (13, 14, ... below
    the old 20) are applied as usual."""
    policy = make_policy(0)
    weights = {k: v.detach().numpy() for k, v in policy.state_dict().items()}
    core = RolloutCore(policy)
    core.offer_weights(WeightsMessage(20, weights))
    assert core.swap_pending() and core.version == 20
    restored = 7_000  # the restored learner's lineage (later than the run's first, 0)
    core.offer_weights(WeightsMessage(12, weights, lineage=restored), force=True)
    core.offer_weights(WeightsMessage(21, weights))  # late, from before the rollback
    assert core.swap_pending() and (core.version, core.lineage) == (12, restored)
    core.offer_weights(WeightsMessage(22, weights))  # later still
    core.offer_weights(WeightsMessage(23, weights), force=True)
    assert not core.swap_pending() and core.version == 12
    core.offer_weights(WeightsMessage(13, weights, lineage=restored))
    assert core.swap_pending() and core.version == 13
    core.offer_weights(WeightsMessage(14, weights, lineage=restored))
    core.offer_weights(WeightsMessage(15, weights, lineage=restored))
    assert not core.swap_pending(min_lead=3) and core.version == 13  # weights_every holds
    # a second rollback offered before the first was applied: versions of its own lineage
    # follow it even though they are below the version the lane still holds
    core.offer_weights(WeightsMessage(9, weights, lineage=restored + 1), force=True)
    core.offer_weights(WeightsMessage(10, weights, lineage=restored + 1))
    core.offer_weights(WeightsMessage(16, weights, lineage=restored))
    assert core.swap_pending(min_lead=3) and (core.version, core.lineage) == (10, restored + 1)


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


def test_group_buffer_takes_micro_batches_without_copying_the_rest_of_an_item():
    """A long queue item (a whole GRPO group) is taken a micro-batch at a time: each take
    copies only the rows it returns, and the item's remainder stays in the arrays it arrived
    in (cutting the remainder off each time copied it again at every micro-batch, images
    included: quadratic in the group's length). Rows still leave in order, none twice, and
    peeks, staleness and put-backs see the remainder."""
    from rlvla3.learner.group_buffer import GroupBuffer
    from rlvla3.learner.samples import Samples, prepare_samples
    from rlvla3.queue.pacing import StalenessBound

    segments = collect_segments(make_policy(1), 12)
    group = prepare_samples(segments, AlgoConfig("ppo"))
    n = len(group)
    buffer = GroupBuffer()
    buffer.add(group)
    buffer.add(group.select(np.arange(3)))  # a second item behind it
    images = next(iter(group.obs.images.values()))
    taken = []
    while buffer.size > 3 + 5:
        batch = buffer.take(5)
        taken.append(batch)
        if len(buffer._items) == 2:  # the long item is still there: in its arrays, uncopied
            head = buffer._items[0].samples
            assert np.shares_memory(next(iter(head.obs.images.values())), images)
    rest = buffer.peek(buffer.size)
    np.testing.assert_array_equal(rest.log_probs[:-3], group.log_probs[5 * len(taken):])
    np.testing.assert_array_equal(buffer.peek_advantages(2), group.advantages[5 * len(taken):][:2])
    assert buffer.discard_stale(StalenessBound(0), 10**9) and buffer.size == n - 5 * len(taken)  # the second item
    buffer.put_back([taken[-1]])
    out = Samples.concat([*taken[:-1], buffer.take(buffer.size)])
    np.testing.assert_array_equal(out.log_probs, group.log_probs)
    np.testing.assert_array_equal(out.actions, group.actions)
