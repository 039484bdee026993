"""VLA policy: the Policy protocol, act/evaluate log-prob consistency, SFT, checkpoints."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    StateSnapshot,
    load_policy,
    read_meta,
    save_checkpoint,
    save_run_checkpoint,
)
from rlvla3.config import ConfigError, Named
from rlvla3.model import flow
from rlvla3.policies import build_policy
from rlvla3.policies.vla import VLAPolicy, build_vla_policy
from rlvla3.protocols import Policy

SPEC = libero_like_spec(image_size=32, chunk_len=6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _obs(n=4, seed=0):
    return libero_like_batch(SPEC, n, np.random.default_rng(seed))


@pytest.mark.parametrize("logprob", ["flow_sde", "flow_noise", "ode_gaussian"])
def test_evaluate_recomputes_the_behaviour_log_prob(logprob):
    policy = build_vla_policy(SPEC, {"preset": "tiny", "logprob": logprob, "denoise_steps": 3})
    assert isinstance(policy, Policy)
    obs, _ = _obs()
    out = policy.act(obs)
    assert out.actions.shape == (4, SPEC.chunk_len, SPEC.action_dim)
    assert out.latents.shape == (4, *policy.latent_shape) and out.latents.dtype == np.float32
    np.testing.assert_array_equal(out.latents[:, -1], out.actions)
    ev = policy.evaluate(obs, torch.tensor(out.actions), torch.tensor(out.latents))
    np.testing.assert_allclose(ev.log_prob.detach().numpy(), out.log_prob, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(ev.value.detach().numpy(), out.value, atol=1e-6)
    assert torch.isfinite(ev.entropy).all()
    # A chain displaced from the sampled one is far less likely under the same weights.
    moved = torch.tensor(out.latents)
    moved[:, 1:] += 2.0
    other = policy.evaluate(obs, moved[:, -1], moved).log_prob.detach().numpy()
    assert (other < out.log_prob - 10).all()
    # The learner's view is differentiable in the action expert and the value head.
    (ev.log_prob.sum() + ev.value.sum()).backward()
    assert policy.net.expert_layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert policy.net.value_head[0].weight.grad.abs().sum() > 0
    if logprob == "flow_noise":
        assert policy.net.noise_head.weight.grad.abs().sum() > 0


def test_sampling_noise_streams_are_seeded_per_policy_copy():
    """Two copies with the same weights (two rollout servers) draw different noise once each
    is given its own stream; the same stream reproduces."""
    a, b = build_vla_policy(SPEC, {"preset": "tiny"}), build_vla_policy(SPEC, {"preset": "tiny"})
    obs, _ = _obs(n=2)
    np.testing.assert_array_equal(a.act(obs).actions, b.act(obs).actions)  # one default stream
    a.seed_sampling(11)
    b.seed_sampling(12)
    first = a.act(obs).actions
    assert not np.allclose(first, b.act(obs).actions)
    a.seed_sampling(11)
    np.testing.assert_array_equal(a.act(obs).actions, first)


def test_deterministic_act_is_repeatable_and_sampling_is_not():
    policy = build_vla_policy(SPEC, {"preset": "tiny"})
    obs, _ = _obs(n=2)
    a = policy.act(obs, deterministic=True)
    b = policy.act(obs, deterministic=True)
    np.testing.assert_array_equal(a.actions, b.actions)  # ODE from zero noise
    c = policy.act(obs)
    assert not np.allclose(c.actions, policy.act(obs).actions)  # fresh noise each call
    assert np.isfinite(c.log_prob).all() and np.isfinite(c.value).all()
    # Deterministic chains are the Euler means: each step has zero residual from its mean.
    ev = policy.evaluate(obs, torch.tensor(a.actions), torch.tensor(a.latents))
    np.testing.assert_allclose(ev.log_prob.detach().numpy(), a.log_prob, rtol=1e-5, atol=1e-3)


def test_init_noise_zero_samples_around_the_deterministic_chain():
    """``init_noise: 0`` starts sampled chains where deterministic acting does (zero noise):
    the SDE steps are the only randomness, so with a small ``noise_level`` the sampled actions
    stay near the evaluated ones, while full-scale starting noise moves them far. The recorded
    chain's log-probability is still what the learner recomputes."""
    obs, _ = _obs(n=3)
    spread = {}
    for init in (0.0, 1.0):
        policy = build_vla_policy(SPEC, {"preset": "tiny", "noise_level": 0.01,
                                         "init_noise": init})
        mode = policy.act(obs, deterministic=True)
        out = policy.act(obs)
        assert not np.array_equal(out.actions, mode.actions)  # still a stochastic policy
        spread[init] = np.abs(out.actions - mode.actions).max()
        if init == 0.0:
            assert (out.latents[:, 0] == 0).all()
        ev = policy.evaluate(obs, torch.tensor(out.actions), torch.tensor(out.latents))
        np.testing.assert_allclose(ev.log_prob.detach().numpy(), out.log_prob, rtol=1e-5,
                                   atol=1e-3)
    assert spread[0.0] < 0.1 * spread[1.0], spread
    with pytest.raises(ConfigError, match="init_noise"):
        build_vla_policy(SPEC, {"preset": "tiny", "init_noise": -1})


@pytest.mark.parametrize("noise_level", [0.1, 0.5, 1.0])
def test_deterministic_chain_follows_the_flow_ode_to_the_action(noise_level):
    """With the exact velocity of a single target action, ``v = (x - a) / t``, Euler steps of
    the ODE land on ``a``; the Flow-SDE mean without its noise would not (it also removes
    the score term's share of the noise)."""
    target = torch.tensor([[[0.7, -0.3, 0.1]]]).repeat(4, 2, 1)

    def step(x, t):
        v = (x - target) / t[:, None, None]
        return flow.sde_step(x, v, t, 1 / 4, noise_level)

    x0 = torch.randn(target.shape, generator=torch.Generator().manual_seed(0))
    chain, _ = flow.sample_chain(step, x0, 4, deterministic=True)
    torch.testing.assert_close(chain[:, -1], target, rtol=0, atol=1e-5)
    noisy, _ = flow.sample_chain(step, x0, 4, deterministic=False,
                                 generator=torch.Generator().manual_seed(1))
    assert (noisy[:, -1] - target).abs().max() > 1e-3


def test_ode_gaussian_samples_only_the_chunk_around_the_evaluated_one():
    """Under ``ode_gaussian`` the sampled chain is the deterministic one except its last
    state, which scatters around the evaluated chunk with std ``noise_level``; a chunk far
    from the ODE's output is correspondingly unlikely."""
    std = 0.05
    policy = build_vla_policy(SPEC, {"preset": "tiny", "logprob": "ode_gaussian",
                                     "noise_level": std, "init_noise": 0.0, "seed": 2})
    obs, _ = _obs(n=6)
    mode, out = policy.act(obs, deterministic=True), policy.act(obs)
    np.testing.assert_array_equal(out.latents[:, :-1], mode.latents[:, :-1])
    spread = (out.latents[:, -1] - mode.latents[:, -1]).std()
    assert 0.8 * std < spread < 1.2 * std, spread  # 252 draws of N(0, std^2)
    assert (mode.log_prob > out.log_prob).all()  # the mode is the density's peak
    moved = torch.tensor(out.latents)
    moved[:, -1] += 3 * std
    ev = policy.evaluate(obs, moved[:, -1], moved).log_prob.detach().numpy()
    assert (ev < out.log_prob - 100).all()  # 4.5 nats per element, 42 elements


def test_ode_gaussian_policy_gradient_moves_the_deterministic_chunk():
    """Raising the log-probability of sampled chunks with a positive advantage (a policy
    gradient step) moves the chunk deterministic evaluation acts with toward them, by a
    step measured in the action noise, at a learning rate of the SFT runs' order."""
    policy = build_vla_policy(SPEC, {"preset": "tiny", "logprob": "ode_gaussian",
                                     "noise_level": 0.1, "init_noise": 0.0, "seed": 4})
    obs, _ = _obs(n=4, seed=1)
    before = policy.act(obs, deterministic=True).latents[:, -1]
    target = torch.tensor(before + 0.3)  # a better chunk, 3 noise stds away in every element
    chain = torch.zeros(4, *policy.latent_shape)  # starts at zero, as init_noise 0 samples
    chain[:, -1] = target
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
    for _ in range(30):
        opt.zero_grad()
        (-policy.evaluate(obs, target, chain).log_prob.mean()).backward()
        opt.step()
    after = policy.act(obs, deterministic=True).latents[:, -1]
    gap_before = np.abs(before - target.numpy()).mean()
    assert np.abs(after - target.numpy()).mean() < 0.5 * gap_before


def test_sft_training_reduces_the_flow_matching_loss():
    policy = build_vla_policy(SPEC, {"preset": "tiny", "seed": 3})
    obs, actions = _obs(n=6, seed=5)
    actions = torch.tensor(actions)
    mask = torch.ones(6, SPEC.chunk_len, dtype=torch.bool)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(actions.shape, generator=g), torch.rand(6, generator=g)
    first = policy.flow_losses(obs, actions, noise, t).mean().item()
    torch.manual_seed(0)
    for _ in range(40):
        opt.zero_grad()
        policy.sft_loss(obs, actions, mask).backward()
        opt.step()
    assert policy.flow_losses(obs, actions, noise, t).mean().item() < 0.9 * first


def test_sft_loss_averages_only_valid_steps():
    policy = build_vla_policy(SPEC, {"preset": "tiny"})
    obs, actions = _obs(n=2, seed=6)
    actions = torch.tensor(actions)
    mask = torch.zeros(2, SPEC.chunk_len, dtype=torch.bool)
    mask[0, :4] = True  # row 1 is all padding
    torch.manual_seed(0)
    loss = policy.sft_loss(obs, actions, mask)
    torch.manual_seed(0)
    noise, t = torch.randn(actions.shape), flow.sample_time(2, torch.device("cpu"))
    x_t, target = flow.flow_matching_target(actions, noise, t)
    pb, cache = policy._prefix(obs)
    v, _ = policy.net.velocity(cache, policy.net.suffix_layout(pb, 1), x_t, t)
    expected = (v - target)[0, :4].pow(2).mean()
    torch.testing.assert_close(loss, expected)


def test_policy_round_trips_through_checkpoint(tmp_path):
    options = {"preset": "tiny", "logprob": "flow_noise", "seed": 7}
    policy = build_policy(Named("vla", options), SPEC)
    assert isinstance(policy, VLAPolicy)
    obs, _ = _obs(n=3)
    out = policy.act(obs)
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("vla", options), SPEC, 5))
    loaded, meta = load_policy(tmp_path / "ck")
    assert meta.version == 5 and isinstance(loaded, VLAPolicy)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, msg=k)
    ev = loaded.evaluate(obs, torch.tensor(out.actions), torch.tensor(out.latents))
    np.testing.assert_allclose(ev.log_prob.detach().numpy(), out.log_prob, rtol=1e-5, atol=1e-3)


def test_saves_from_several_threads_of_one_process_all_land(tmp_path):
    """A periodic save and an explicit one can meet on the same version (two calls into one
    learner actor): each lands whole, ``latest`` names a loadable one, old ones are pruned."""
    import threading

    options = {"preset": "tiny", "seed": 3}
    policy = build_policy(Named("vla", options), SPEC)
    weights = StateSnapshot({k: v.clone() for k, v in policy.state_dict().items()})
    errors: list[BaseException] = []

    def save(version: int) -> None:
        try:
            save_run_checkpoint(tmp_path, weights, CheckpointMeta(Named("vla", options), SPEC,
                                                                 version))
        except BaseException as exc:  # collected: a thread's exception would pass unseen
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(v,)) for v in (4, 4, 4, 5, 5, 6, 6, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert read_meta(tmp_path).version == 6
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # a version saved again goes to a new directory, never over one `latest` may name; the
    # newest copy of each of the two newest versions is kept
    assert kept == ["latest", "step-00000005-1", "step-00000006-2"]
    loaded, _ = load_policy(tmp_path)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, msg=k)


def test_an_older_version_saved_after_a_newer_one_leaves_latest_on_the_newer(tmp_path):
    """The order two threads reach the lock in is not the order of their versions: a save of
    version 4 after 6 and 5 is pruned at once, and ``latest`` stays on 6 (it never names a
    pruned checkpoint)."""
    options = {"preset": "tiny", "seed": 3}
    weights = build_policy(Named("vla", options), SPEC)
    for version in (6, 5, 4):
        save_run_checkpoint(tmp_path, weights, CheckpointMeta(Named("vla", options), SPEC, version))
        assert read_meta(tmp_path).version == 6
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step-00000005", "step-00000006"]


def test_a_pinned_checkpoint_outlives_newer_saves_and_copies_of_its_version(tmp_path):
    """A periodic evaluation loads the snapshot it was given while the run goes on saving: a
    later copy of the same version (the final save) or newer versions must not prune it."""
    options = {"preset": "tiny", "seed": 3}
    weights = build_policy(Named("vla", options), SPEC)

    def save(version, pinned=()):
        return save_run_checkpoint(tmp_path, weights, CheckpointMeta(Named("vla", options), SPEC,
                                                                     version), pinned=pinned)

    reading = save(12)
    for version in (12, 13, 14):
        save(version, pinned=[reading])
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step-00000012", "step-00000013", "step-00000014"]
    save(15)  # the evaluation is done: nothing pinned, the usual pruning
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step-00000014", "step-00000015"]


def test_shape_overrides_build_the_model_and_travel_with_the_checkpoint(tmp_path):
    options = {"preset": "tiny", "shapes": {"vision_depth": 2, "vision_width": 48}}
    policy = build_policy(Named("vla", options), SPEC)
    assert len(policy.net.vision.layers) == 2
    assert policy.net.vision.patch_embedding.out_channels == 48
    obs, _ = _obs(n=2)
    assert np.isfinite(policy.act(obs, deterministic=True).actions).all()
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("vla", options), SPEC, 1))
    loaded, _ = load_policy(tmp_path / "ck")
    assert len(loaded.net.vision.layers) == 2
    with pytest.raises(ConfigError, match="shapes.vision_size"):
        build_vla_policy(SPEC, {"shapes": {"vision_size": 2}})
    with pytest.raises(ConfigError, match="shapes.vision_width"):
        build_vla_policy(SPEC, {"shapes": {"vision_width": 33}})  # 2 vision heads
    with pytest.raises(ConfigError, match="shapes.depth"):
        build_vla_policy(SPEC, {"shapes": {"depth": 0}})
    stem = build_vla_policy(SPEC, {"shapes": {"conv_stem": 3}})  # tiny's patch is 8 = 2 ** 3
    assert sum(isinstance(m, torch.nn.Conv2d) for m in stem.net.vision.modules()) == 3
    loss = stem.sft_loss(obs, torch.zeros(2, SPEC.chunk_len, SPEC.action_dim),
                         torch.ones(2, SPEC.chunk_len, dtype=torch.bool))
    loss.backward()
    assert stem.net.vision.patch_embedding[0].weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="shapes.conv_stem"):
        build_vla_policy(SPEC, {"shapes": {"conv_stem": 2}})


def test_action_scale_standardises_the_flow_and_maps_actions_back():
    mean, std = [0.2, -0.1, 0.0, 0.0, 0.01, 0.0, 0.3], [0.5, 0.4, 0.5, 0.02, 0.05, 0.1, 1.0]
    scaled = build_vla_policy(SPEC, {"seed": 3, "action_mean": mean, "action_std": std})
    raw = build_vla_policy(SPEC, {"seed": 3})
    obs, _ = _obs(n=2)
    m, sd = torch.tensor(mean), torch.tensor(std)
    np.testing.assert_allclose(scaled.act(obs, deterministic=True).actions,
                               (torch.tensor(raw.act(obs, deterministic=True).actions) * sd + m)
                               .numpy(), rtol=1e-5, atol=1e-6)
    actions = torch.randn(2, SPEC.chunk_len, SPEC.action_dim)
    noise, t = torch.randn_like(actions), torch.tensor([0.3, 0.8])
    torch.testing.assert_close(scaled.flow_losses(obs, actions, noise, t),
                               raw.flow_losses(obs, (actions - m) / sd, noise, t))
    with pytest.raises(ConfigError, match="action_std"):
        build_vla_policy(SPEC, {"action_mean": mean, "action_std": std[:3]})
    with pytest.raises(ConfigError, match="action_mean"):
        build_vla_policy(SPEC, {"action_mean": mean[:3], "action_std": std[:3]})


def test_options_are_validated_with_the_field_named():
    with pytest.raises(ConfigError, match="policy.options.logprob"):
        build_vla_policy(SPEC, {"logprob": "gaussian"}, "policy.options")
    with pytest.raises(ConfigError, match="policy.options.denoise_steps"):
        build_vla_policy(SPEC, {"denoise_steps": 0}, "policy.options")
    with pytest.raises(ConfigError, match="policy.options.colour"):
        build_vla_policy(SPEC, {"colour": "red"}, "policy.options")


def _one(state):
    """One observation with ``state`` (the processor's text encoding reads state and text)."""
    obs, _ = _obs(n=1)
    return dataclasses.replace(obs, state=state)


def test_state_range_sets_the_bins_and_travels_with_the_checkpoint(tmp_path):
    dim = SPEC.state_dim
    low, high = [0.5] * dim, [1.5] * dim
    options = {"preset": "tiny", "state_low": low, "state_high": high}
    policy = build_vla_policy(SPEC, options)
    state = np.full((1, dim), 1.2, np.float32)  # beyond the default [-1, 1]: one clipped bin
    inside = policy.processor.encode_text(_one(state))[0][1]
    default = build_vla_policy(SPEC, {"preset": "tiny"}).processor.encode_text(_one(state))[0][1]
    base = 256  # state bin b is token 256 + b (after the 256 byte tokens)
    assert default == [base + 255] * dim and inside == [base + int(0.7 * 256)] * dim
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("vla", options), SPEC, 1))
    loaded, _ = load_policy(tmp_path / "ck")
    assert loaded.processor.encode_text(_one(state))[0][1] == inside
    with pytest.raises(ConfigError, match="policy.options.state_high"):
        build_vla_policy(SPEC, {"state_low": low, "state_high": high[:-1]}, "policy.options")
    with pytest.raises(ConfigError, match="policy.options.state_high"):
        build_vla_policy(SPEC, {"state_low": high, "state_high": low}, "policy.options")
    with pytest.raises(ConfigError, match="policy.options.state_low"):
        build_vla_policy(SPEC, {"state_low": [0.0], "state_high": [1.0]}, "policy.options")


def test_rl_run_from_a_checkpoint_adopts_its_policy_options(tmp_path):
    from rlvla3.run_config import load_run_config

    options = {"preset": "tiny", "image_size": 16, "state_low": [0.0] * 8, "state_high": [2.0] * 8}
    policy = build_vla_policy(SPEC, options)
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("vla", options), SPEC, 3))
    cfg = load_run_config("smoke", overrides=[
        f"init_from={tmp_path / 'ck'}", "policy.name=vla", "policy.options.denoise_steps=2"])
    assert cfg.policy.options == {**options, "denoise_steps": 2}  # the run's own option wins
    other = load_run_config("smoke", overrides=[f"init_from={tmp_path / 'ck'}"])
    assert other.policy.name == "small"  # a different policy: left for check_components


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_pi05_preset_is_refused_on_cpu():
    with pytest.raises(ConfigError, match="CUDA"):
        build_vla_policy(SPEC, {"preset": "pi05"}, "policy.options")


def test_rl_core_pipeline_runs_with_the_vla_policy():
    """Rollout core -> recorded episodes -> PPO learner core, with the tiny VLA as the policy."""
    from envs import env_spec, make_env
    from rlvla3.algos.config import AlgoConfig
    from rlvla3.episode.tasks import TaskSampler
    from rlvla3.learner.core import BatchStart, LearnerCore
    from rlvla3.learner.samples import prepare_samples
    from rlvla3.rollout.core import RolloutCore, collect_episodes

    reach = Named("reach", {"image_size": 16, "max_decisions": 6})
    policy = build_policy(Named("vla", {"preset": "tiny", "denoise_steps": 2}), env_spec(reach))
    segments = collect_episodes(make_env(reach), RolloutCore(policy),
                                TaskSampler(range(4), range(5), 0), 6, "test")
    learner = LearnerCore(policy, AlgoConfig("ppo"), 16, 8, 1e-3, BatchStart())
    learner.add_groups([s] for s in segments)
    batch = prepare_samples(segments, AlgoConfig("ppo"))
    with torch.no_grad():  # fresh data: recomputed log-probs = behaviour ones
        ev = policy.evaluate(batch.obs, torch.from_numpy(batch.actions),
                             torch.from_numpy(batch.latents))
    torch.testing.assert_close(ev.log_prob, torch.from_numpy(batch.log_probs), atol=1e-3,
                               rtol=1e-4)
    torch.testing.assert_close(ev.log_prob_elements.sum(-1), ev.log_prob, atol=1e-3, rtol=1e-4)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    assert learner.run_available() >= 1 and learner.version >= 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_ode_gaussian_on_a_padded_chain_scores_only_the_executed_dims():
    """With ``chain: padded`` (pi0.5's 32-wide chain) the action Gaussian is scored on the
    env's action dims alone: the padding dims of the chunk never reach the env, so they are
    not sampled, and changing them changes no log-probability. Under Flow-SDE every dim
    feeds the next step and is scored."""
    spec = libero_like_spec(image_size=56, chunk_len=4)
    policy = build_vla_policy(spec, {"preset": "pi05_tiny", "logprob": "ode_gaussian",
                                     "chain": "padded", "noise_level": 0.05,
                                     "init_noise": 0.0, "seed": 3})  # both start at zero
    assert policy.chain_width == 32 > spec.action_dim
    obs, _ = libero_like_batch(spec, 3, np.random.default_rng(0))
    out, mode = policy.act(obs), policy.act(obs, deterministic=True)
    np.testing.assert_array_equal(out.latents[:, -1, :, spec.action_dim:],
                                  mode.latents[:, -1, :, spec.action_dim:])  # not sampled
    chain = torch.tensor(out.latents)
    with torch.no_grad():
        ev = policy.evaluate(obs, torch.tensor(out.actions), chain)
    assert ev.log_prob_elements.shape == (3, spec.chunk_len * spec.action_dim)
    np.testing.assert_allclose(ev.log_prob.numpy(), out.log_prob, rtol=1e-4, atol=1e-3)
    chain[:, -1, :, spec.action_dim:] += 1.0  # only the padding moves
    with torch.no_grad():
        moved = policy.evaluate(obs, torch.tensor(out.actions), chain)
    torch.testing.assert_close(moved.log_prob, ev.log_prob)
    sde = build_vla_policy(spec, {"preset": "pi05_tiny", "chain": "padded", "seed": 3})
    with torch.no_grad():
        steps = sde.evaluate(obs, torch.tensor(out.actions), torch.tensor(out.latents))
    assert steps.log_prob_elements.shape[1] == sde.cfg.denoise_steps * spec.chunk_len * 32
