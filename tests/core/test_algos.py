"""PPO / GRPO math against values computed by hand (the arithmetic is written out inline)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlvla3.algos.advantages import gae, grpo_advantages
from rlvla3.algos.config import AlgoConfig
from rlvla3.algos.losses import approx_kl, objective, ppo_loss, value_loss
from rlvla3.config import ConfigError, build
from rlvla3.learner.samples import prepare_samples
from rlvla3.protocols import Evaluation
from rlvla3.types import EpisodeKey, ObsBatch, TrajectorySegment

# --- GAE ------------------------------------------------------------------------------------
# rewards [1, 0, 2], values [0.5, 1.0, 1.5], gamma 0.9, lam 0.8  ->  gamma * lam = 0.72
REWARDS = np.array([1.0, 0.0, 2.0], np.float32)
VALUES = np.array([0.5, 1.0, 1.5], np.float32)


def test_gae_terminated_episode_does_not_bootstrap():
    # V_3 = 0 (terminated; the bootstrap value 2.0 must be ignored)
    # delta_2 = 2 + 0.9*0   - 1.5 = 0.5          A_2 = 0.5
    # delta_1 = 0 + 0.9*1.5 - 1.0 = 0.35         A_1 = 0.35 + 0.72*0.5  = 0.71
    # delta_0 = 1 + 0.9*1.0 - 0.5 = 1.4          A_0 = 1.4  + 0.72*0.71 = 1.9112
    adv, ret = gae(REWARDS, VALUES, terminated=True, bootstrap_value=2.0, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [1.9112, 0.71, 0.5], rtol=1e-6)
    np.testing.assert_allclose(ret, [2.4112, 1.71, 2.0], rtol=1e-6)
    assert adv.dtype == np.float32 and ret.dtype == np.float32


def test_gae_truncated_episode_bootstraps():
    # V_3 = 2.0 (truncated)
    # delta_2 = 2 + 0.9*2.0 - 1.5 = 2.3          A_2 = 2.3
    # delta_1 = 0.35                             A_1 = 0.35 + 0.72*2.3   = 2.006
    # delta_0 = 1.4                              A_0 = 1.4  + 0.72*2.006 = 2.84432
    adv, ret = gae(REWARDS, VALUES, terminated=False, bootstrap_value=2.0, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [2.84432, 2.006, 2.3], rtol=1e-6)
    np.testing.assert_allclose(ret, [3.34432, 3.006, 3.8], rtol=1e-6)


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    # lam = 1: R_0 = 1 + 0.9*0 + 0.81*2 = 2.62, R_1 = 0 + 0.9*2 = 1.8, R_2 = 2 (terminated)
    adv, ret = gae(REWARDS, VALUES, terminated=True, bootstrap_value=0.0, gamma=0.9, lam=1.0)
    np.testing.assert_allclose(ret, [2.62, 1.8, 2.0], rtol=1e-6)
    np.testing.assert_allclose(adv, [2.12, 0.8, 0.5], rtol=1e-6)


# --- GRPO -----------------------------------------------------------------------------------


def test_grpo_advantages_of_a_group():
    # returns [3, 1, 2, 2]: mean 2, deviations [1, -1, 0, 0], var = 2/4, std = 1/sqrt(2)
    adv = grpo_advantages(np.array([3.0, 1.0, 2.0, 2.0]), eps=0.0)
    s2 = math.sqrt(2.0)
    np.testing.assert_allclose(adv, [s2, -s2, 0.0, 0.0], rtol=1e-6)
    # successes / failures: mean 0.5, std 0.5 -> +-1 (eps shifts it slightly)
    adv = grpo_advantages(np.array([1.0, 0.0, 1.0, 0.0]), eps=1e-6)
    np.testing.assert_allclose(adv, [1, -1, 1, -1], rtol=1e-5)


def test_grpo_advantages_of_a_uniform_group_are_zero():
    np.testing.assert_array_equal(grpo_advantages(np.ones(4)), np.zeros(4, np.float32))


# --- PPO policy loss ------------------------------------------------------------------------


def _loss_per_sample(new, behav, adv, clip_eps=0.2, dual_clip=3.0, prox=None):
    """ppo_loss on one sample at a time, with the gradient d loss / d new_log_prob."""
    new_t = torch.tensor([new], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_loss(
        new_t,
        torch.tensor([behav], dtype=torch.float64),
        torch.tensor([adv], dtype=torch.float64),
        clip_eps,
        dual_clip,
        None if prox is None else torch.tensor([prox], dtype=torch.float64),
    )
    loss.backward()
    return loss.item(), new_t.grad.item(), stats


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped", "dual"),
    [
        # A > 0, r = 1.5: min(1.5*1, 1.2*1) = 1.2 -> clipped, no gradient
        (1.5, 1.0, -1.2, 0.0, True, False),
        # A > 0, r = 0.5: min(0.5, 0.8) = 0.5 -> unclipped, d(-r A)/d log pi = -r A = -0.5
        (0.5, 1.0, -0.5, -0.5, False, False),
        # A > 0, r = 1.1 inside the trust region: -1.1 * 2 = -2.2, gradient -2.2
        (1.1, 2.0, -2.2, -2.2, False, False),
        # A < 0, r = 0.5: min(-0.5, -0.8) = -0.8 -> clipped, loss 0.8, no gradient
        (0.5, -1.0, 0.8, 0.0, True, False),
        # A < 0, r = 1.5: min(-1.5, -1.2) = -1.5; dual bound -3 not reached -> loss 1.5, grad 1.5
        (1.5, -1.0, 1.5, 1.5, False, False),
        # A < 0, r = 5: min(-5, -1.2) = -5; max(-5, 3*-1) = -3 -> loss 3, no gradient
        (5.0, -1.0, 3.0, 0.0, False, True),
        # A > 0, r = 5: min(10, 2.4) = 2.4 (dual clip does not apply) -> loss -2.4
        (5.0, 2.0, -2.4, 0.0, True, False),
    ],
)
def test_ppo_clip_and_dual_clip(ratio, adv, loss, grad, clipped, dual):
    behav = -1.3
    got_loss, got_grad, stats = _loss_per_sample(behav + math.log(ratio), behav, adv)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert stats.clip_fraction == float(clipped)
    assert stats.dual_clip_fraction == float(dual)
    assert stats.ratio_mean == pytest.approx(ratio)


def test_ppo_without_dual_clip_is_unbounded_for_negative_advantages():
    # A = -1, r = 5: min(-5, -1.2) = -5 -> loss 5, gradient d(-r A) = r = 5
    loss, grad, _ = _loss_per_sample(math.log(5.0), 0.0, -1.0, dual_clip=None)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)


@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("prox", [None, 0.0])
def test_ppo_loss_stays_finite_for_a_ratio_beyond_float32(adv, prox):
    """A narrow Flow-SDE chain puts log-ratios in the hundreds after one update: exp() of
    them is inf in float32, and inf through the clipped branch made the gradient NaN."""
    new = torch.tensor([200.0, -200.0, 0.1], requires_grad=True)
    behav = torch.tensor([0.0, 0.0, 150.0])  # the last: a behaviour weight of e^-150 or e^150
    prox_t = None if prox is None else torch.zeros(3)
    loss, stats = ppo_loss(new, behav if prox is None else -behav, torch.full((3,), adv), 0.2,
                           3.0, prox_t, 2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert math.isfinite(stats.ratio_max)
    assert all(math.isfinite(k) for k in approx_kl(new.detach(), behav, 1))


def test_ppo_batch_mean_and_stats():
    # ratios [1.5, 0.5, 5.0], advantages [1, -1, -1]:
    # losses [-1.2, 0.8, 3.0] -> mean 2.6 / 3; clip-bounded: samples 0 and 1; dual: sample 2
    # approx_kl = mean(r - 1 - ln r) = (0.5 - ln1.5 + -0.5 - ln0.5 + 4 - ln5) / 3
    ratios = np.array([1.5, 0.5, 5.0])
    loss, stats = ppo_loss(
        torch.tensor(np.log(ratios)),
        torch.zeros(3, dtype=torch.float64),
        torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64),
        0.2,
        3.0,
    )
    assert loss.item() == pytest.approx(2.6 / 3)
    assert stats.clip_fraction == pytest.approx(2 / 3)
    assert stats.dual_clip_fraction == pytest.approx(1 / 3)
    kl = (0.5 - math.log(1.5) - 0.5 - math.log(0.5) + 4.0 - math.log(5.0)) / 3
    assert approx_kl(torch.tensor(np.log(ratios)), torch.zeros(3, dtype=torch.float64), 1) == (
        pytest.approx(kl), pytest.approx(kl))
    # no gradient: the two clipped samples and the dual-clipped one
    assert stats.no_grad_fraction == 1.0
    assert stats.ratio_mean == pytest.approx(7.0 / 3) and stats.ratio_max == pytest.approx(5.0)
    assert stats.behaviour_weight_mean == 1.0


def test_decoupled_ppo_clips_around_the_proximal_policy():
    # behav = ln 0.5, prox = 0 -> w = pi_prox / pi_behav = 2; new = ln 1.5 -> r = 1.5 vs prox.
    # A = 1: inner min(1.5, 1.2) = 1.2 -> loss = -2 * 1.2 = -2.4 (no gradient: clipped).
    # (Against the behaviour policy alone the ratio would be 3 and the loss -1.2.)
    loss, grad, stats = _loss_per_sample(math.log(1.5), math.log(0.5), 1.0, prox=0.0)
    assert loss == pytest.approx(-2.4) and grad == pytest.approx(0.0)
    assert stats.ratio_mean == pytest.approx(1.5)
    assert stats.behaviour_weight_mean == pytest.approx(2.0)
    assert stats.clip_fraction == 1.0

    # behav = 0, prox = ln 0.5 -> w = 0.5; new = ln 0.55 -> r = 1.1 (inside the trust region).
    # A = 1: loss = -0.5 * 1.1 = -0.55; gradient d(-w r A)/d new = -w r A = -0.55.
    loss, grad, _ = _loss_per_sample(math.log(0.55), 0.0, 1.0, prox=math.log(0.5))
    assert loss == pytest.approx(-0.55) and grad == pytest.approx(-0.55)

    # behav = 0, prox = ln 2 -> w = 2; new = ln 10 -> r = 5. A = -1:
    # inner min(-5, -1.2) = -5, dual clip max(-5, -3) = -3 -> loss = -2 * -3 = 6.
    loss, grad, stats = _loss_per_sample(math.log(10.0), 0.0, -1.0, prox=math.log(2.0))
    assert loss == pytest.approx(6.0) and grad == pytest.approx(0.0)
    assert stats.dual_clip_fraction == 1.0


def test_truncated_importance_weight():
    # behav = ln 0.2, prox = 0 -> pi_prox / pi_behav = 5, truncated at c = 2; new = prox (r = 1).
    # A = 1: loss = -2 * 1 = -2; gradient d(-w r A)/d new = -w r A = -2.
    new_t = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_loss(new_t, torch.tensor([math.log(0.2)], dtype=torch.float64),
                           torch.tensor([1.0], dtype=torch.float64), 0.2, 3.0,
                           prox_log_prob=torch.tensor([0.0], dtype=torch.float64), weight_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and new_t.grad.item() == pytest.approx(-2.0)
    assert stats.behaviour_weight_mean == pytest.approx(2.0) and stats.truncated_fraction == 1.0
    # below the cap nothing changes: behav = ln 0.8 -> w = 1.25
    loss, _, stats = _loss_per_sample(0.0, math.log(0.8), 1.0, prox=0.0)
    assert loss == pytest.approx(-1.25) and stats.truncated_fraction == 0.0


def test_objective_proximal_is_the_step_start_parameters():
    """``proximal: step``: the proximal policy is the evaluated parameters
    without gradient, so r = 1 and the gradient is -mean(w * A * grad log pi) with
    w = min(pi_theta / pi_behav, cap): hand-computed on two samples."""
    new = torch.tensor([0.0, math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ev = Evaluation(log_prob=new, value=torch.zeros(2, dtype=torch.float64),
                    entropy=torch.zeros(2, dtype=torch.float64))
    behav = torch.tensor([math.log(0.25), 0.0], dtype=torch.float64)  # w = [4 -> 2 (cap), 0.5]
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    zeros = torch.zeros(2, dtype=torch.float64)
    loss, stats = objective(AlgoConfig("grpo", proximal="step", behaviour_weight_cap=2.0), ev,
                            behav, adv, zeros, zeros)
    loss.backward()
    # loss = -mean(w * A) = -(2 * 1 + 0.5 * -2) / 2 = -0.5
    assert loss.item() == pytest.approx(-0.5)
    # d loss / d new_i = -w_i * A_i / 2 = [-1, 0.5]
    np.testing.assert_allclose(new.grad.numpy(), [-1.0, 0.5])
    assert stats.policy.clip_fraction == 0.0 and stats.policy.ratio_mean == pytest.approx(1.0)

    # classic PPO (proximal: behaviour): r = pi_theta / pi_behav = [4, 0.5]; A = [1, -2]:
    # sample 0: min(4, 1.2) = 1.2 (clipped); sample 1: min(-1, -1.6) = -1.6 (clipped)
    new.grad = None
    loss, stats = objective(AlgoConfig("grpo", proximal="behaviour"), ev, behav, adv, zeros,
                            zeros)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.2 - 1.6) / 2)
    np.testing.assert_allclose(new.grad.numpy(), [0.0, 0.0])
    assert stats.policy.clip_fraction == 1.0


def test_objective_proximal_from_the_learners_window_copy():
    """Default (``proximal: window``): the clip is centred on the log-probabilities of the
    learner's proximal copy, given by the caller; the updates since the copy keep a trust
    region. behav = 0, prox = ln 0.5 -> w = 0.5; new = ln 0.75 -> r = 1.5 against prox.
    A = 1: min(1.5, 1.2) = 1.2 (clipped) -> loss = -0.5 * 1.2 = -0.6, no gradient."""
    new = torch.tensor([math.log(0.75)], dtype=torch.float64, requires_grad=True)
    ev = Evaluation(log_prob=new, value=torch.zeros(1, dtype=torch.float64),
                    entropy=torch.zeros(1, dtype=torch.float64))
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    prox = torch.tensor([math.log(0.5)], dtype=torch.float64)
    loss, stats = objective(AlgoConfig("grpo"), ev, zero, one, zero, zero, prox)
    loss.backward()
    assert loss.item() == pytest.approx(-0.6) and new.grad.item() == pytest.approx(0.0)
    assert stats.policy.clip_fraction == 1.0
    assert stats.policy.behaviour_weight_mean == pytest.approx(0.5)
    with pytest.raises(ValueError, match="window"):
        objective(AlgoConfig("grpo"), ev, zero, one, zero, zero)


def test_decoupled_equals_plain_when_prox_is_behaviour():
    new = torch.tensor([0.3, -0.4, 1.2], dtype=torch.float64)
    behav = torch.tensor([0.1, 0.0, -0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, -0.5], dtype=torch.float64)
    plain, _ = ppo_loss(new, behav, adv, 0.2, 3.0)
    decoupled, _ = ppo_loss(new, behav, adv, 0.2, 3.0, prox_log_prob=behav)
    assert plain.item() == pytest.approx(decoupled.item())


# --- value loss and the combined objective --------------------------------------------------


def test_value_loss_plain_and_clipped():
    new = torch.tensor([1.0, 3.0])
    old = torch.tensor([0.0, 2.0])
    ret = torch.tensor([2.0, 2.0])
    # plain: 0.5 * mean((1-2)^2, (3-2)^2) = 0.5 * 1 = 0.5
    assert value_loss(new, old, ret, None).item() == pytest.approx(0.5)
    # vf_clip 0.5: V_clip = [0.5, 2.5]; errors max(1, 2.25) = 2.25, max(1, 0.25) = 1
    # -> 0.5 * (2.25 + 1) / 2 = 0.8125
    assert value_loss(new, old, ret, 0.5).item() == pytest.approx(0.8125)


def test_objective_combines_terms():
    cfg = AlgoConfig(name="ppo", vf_coef=0.5, ent_coef=0.1)
    evaluation = Evaluation(
        log_prob=torch.zeros(2),
        value=torch.tensor([1.0, 3.0]),
        entropy=torch.tensor([1.0, 2.0]),
    )
    zeros = torch.zeros(2)
    adv = torch.tensor([1.0, -1.0])
    ret = torch.tensor([2.0, 2.0])
    # ratio 1: policy loss = -mean(1, -1) = 0; value loss 0.5; entropy 1.5
    # total = 0 + 0.5 * 0.5 - 0.1 * 1.5 = 0.1
    loss, stats = objective(cfg, evaluation, zeros, adv, ret, zeros, zeros)
    assert loss.item() == pytest.approx(0.1)
    assert stats.value_loss == pytest.approx(0.5) and stats.entropy == pytest.approx(1.5)
    assert "policy/clip_fraction" in stats.as_dict()
    # GRPO has no critic: total = 0 - 0.1 * 1.5 = -0.15
    loss, stats = objective(
        AlgoConfig(name="grpo", ent_coef=0.1), evaluation, zeros, adv, ret, zeros, zeros
    )
    assert loss.item() == pytest.approx(-0.15) and stats.value_loss == 0.0


# --- prepare_samples ------------------------------------------------------------------------


def _segment(key, rewards, values, terminated=True, bootstrap=0.0, version=0):
    t = len(rewards)
    obs = ObsBatch(
        images={"top": np.zeros((t, 4, 4, 3), np.uint8)},
        image_mask={"top": np.ones(t, bool)},
        state=np.zeros((t, 2), np.float32),
        instruction=("reach",) * t,
    )
    return TrajectorySegment(
        key=key,
        source="w0/s0",
        obs=obs,
        actions=np.zeros((t, 2, 3), np.float32),
        latents=np.zeros((t, 0), np.float32),
        rewards=np.asarray(rewards, np.float32),
        log_probs=np.full(t, -1.0, np.float32),
        values=np.asarray(values, np.float32),
        policy_versions=np.full(t, version, np.int64),
        terminated=terminated,
        truncated=not terminated,
        success=terminated,
        bootstrap_value=bootstrap,
        env_steps=2 * t,
    )


def test_prepare_samples_ppo_uses_gae_per_segment():
    cfg = AlgoConfig(name="ppo", gamma=0.9, lam=0.8, normalize_advantages=False)
    a = _segment(EpisodeKey(0, 0), REWARDS, VALUES, terminated=True, bootstrap=2.0)
    b = _segment(EpisodeKey(1, 0), REWARDS, VALUES, terminated=False, bootstrap=2.0, version=3)
    samples = prepare_samples([a, b], cfg)
    assert len(samples) == 6 and len(samples.obs) == 6
    assert samples.actions.shape == (6, 2, 3) and samples.latents.shape == (6, 0)
    # the values of the two GAE tests above, segment after segment
    np.testing.assert_allclose(
        samples.advantages, [1.9112, 0.71, 0.5, 2.84432, 2.006, 2.3], rtol=1e-6
    )
    np.testing.assert_allclose(samples.returns, [2.4112, 1.71, 2.0, 3.34432, 3.006, 3.8], rtol=1e-6)
    np.testing.assert_array_equal(samples.policy_versions, [0, 0, 0, 3, 3, 3])
    np.testing.assert_array_equal(samples.log_probs, np.full(6, -1.0))
    sub = samples.select(np.array([1, 4]))
    np.testing.assert_allclose(sub.advantages, [0.71, 2.006], rtol=1e-6)

    np.testing.assert_array_equal(samples.env_steps, [2] * 6)  # 2 steps per decision
    # standardisation belongs to the optimizer batch (the learner), never to one call
    raw = prepare_samples([a, b], AlgoConfig(name="ppo", gamma=0.9, lam=0.8))
    np.testing.assert_allclose(raw.advantages, samples.advantages)


def test_grpo_episode_weight_equal_gives_each_episode_of_a_group_the_same_weight():
    """A short success and a long failure: by decisions the failure's 4 decisions outweigh the
    success's 1 (4 x -1 against +1); with ``episode_weight: equal`` each episode's decisions
    sum to its advantage times the group's mean length, and the group's total stays 0."""
    k = EpisodeKey(0, 0)
    group = [_segment(k, [1.0], [0.0]), _segment(k, [0.0] * 4, [0.0] * 4)]
    by_decisions = prepare_samples(group, AlgoConfig(name="grpo", group_size=2))
    equal = prepare_samples(group, AlgoConfig(name="grpo", group_size=2, episode_weight="equal"))
    np.testing.assert_allclose(by_decisions.advantages, [1, -1, -1, -1, -1], atol=1e-5)
    np.testing.assert_allclose(equal.advantages, [2.5, -0.625, -0.625, -0.625, -0.625], atol=1e-5)
    assert abs(equal.advantages[:1].sum() + equal.advantages[1:].sum()) < 1e-5
    assert by_decisions.advantages.sum() < -2.9  # the length bias the option removes
    with pytest.raises(ConfigError, match="episode_weight"):
        AlgoConfig(name="ppo", episode_weight="equal").validate()
    with pytest.raises(ConfigError, match="episode_weight"):
        AlgoConfig(name="grpo", episode_weight="episode").validate()  # type: ignore[arg-type]


def test_grpo_positive_advantages_only_zeroes_the_episodes_below_the_group_mean():
    """One success in a group of three: the success keeps its advantage (weighed by
    ``episode_weight`` as without the option), the two failures get 0 instead of a negative one;
    refused with PPO."""
    k = EpisodeKey(0, 0)
    group = [_segment(k, [1.0], [0.0]), _segment(k, [0.0] * 2, [0.0] * 2),
             _segment(k, [0.0] * 3, [0.0] * 3)]
    signed = prepare_samples(group, AlgoConfig(name="grpo", group_size=3, episode_weight="equal"))
    positive = prepare_samples(group, AlgoConfig(name="grpo", group_size=3, episode_weight="equal",
                                                 positive_advantages_only=True))
    assert (signed.advantages[1:] < 0).all()
    np.testing.assert_allclose(positive.advantages[:1], signed.advantages[:1])
    np.testing.assert_array_equal(positive.advantages[1:], np.zeros(5, np.float32))
    with pytest.raises(ConfigError, match="positive_advantages_only"):
        AlgoConfig(name="ppo", positive_advantages_only=True).validate()


def test_prepare_samples_grpo_broadcasts_group_advantage():
    cfg = AlgoConfig(name="grpo", group_size=2)
    k0, k1 = EpisodeKey(0, 0), EpisodeKey(0, 1)
    # group k0: returns 1 and 0 -> +1 / -1; group k1: returns 2 and 2 -> 0 / 0.
    first = prepare_samples([_segment(k0, [0.0, 1.0], [0.0, 0.0]),
                             _segment(k0, [0.0, 0.0, 0.0], [0.0] * 3)], cfg)
    second = prepare_samples([_segment(k1, [1.0, 1.0, 0.0], [0.0] * 3),
                              _segment(k1, [2.0], [0.0])], cfg)
    np.testing.assert_allclose(first.advantages, [1, 1, -1, -1, -1], atol=1e-5)
    np.testing.assert_allclose(first.returns, [1, 1, 0, 0, 0])
    np.testing.assert_allclose(second.advantages, [0, 0, 0, 0], atol=1e-5)


def test_prepare_samples_grpo_trains_a_group_of_any_size_and_never_pools_two():
    """A group shortened by faults trains on the members it has (a group of one: advantage
    0); two short groups of one key stay two groups, each standardised on its own."""
    cfg = AlgoConfig(name="grpo", group_size=4)
    key = EpisodeKey(0, 0)
    short = prepare_samples([_segment(key, [1.0], [0.0]), _segment(key, [0.0], [0.0]),
                             _segment(key, [0.0], [0.0])], cfg)
    a = np.sqrt(2.0)  # returns 1, 0, 0: mean 1/3, std sqrt(2)/3
    np.testing.assert_allclose(short.advantages, [a, -a / 2, -a / 2], rtol=1e-5)
    alone = prepare_samples([_segment(key, [1.0, 0.0], [0.0, 0.0])], cfg)
    np.testing.assert_array_equal(alone.advantages, [0.0, 0.0])
    # the same key twice, as two items: [1, 0] and [1, 1] give +-1 and 0, 0 (pooled into one
    # group of four they would give 0.58 and -1.73)
    one = prepare_samples([_segment(key, [1.0], [0.0]), _segment(key, [0.0], [0.0])], cfg)
    two = prepare_samples([_segment(key, [1.0], [0.0]), _segment(key, [1.0], [0.0])], cfg)
    np.testing.assert_allclose(np.concatenate([one.advantages, two.advantages]), [1, -1, 0, 0],
                               atol=1e-5)
    with pytest.raises(ValueError, match="one \\(task, initial state\\)"):
        prepare_samples([_segment(key, [1.0], [0.0]), _segment(EpisodeKey(1, 0), [0.0], [0.0])],
                        cfg)


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "trpo"}, "algo.name"),
        ({"name": "ppo", "clip_eps": 0.0}, "algo.clip_eps"),
        ({"name": "ppo", "dual_clip": 1.0}, "algo.dual_clip"),
        ({"name": "ppo", "gamma": 1.5}, "algo.gamma"),
        ({"name": "ppo", "lam": -0.1}, "algo.lam"),
        ({"name": "ppo", "vf_coef": -1.0}, "algo.vf_coef"),
        ({"name": "grpo", "group_size": 1}, "algo.group_size"),
        ({"name": "ppo", "max_grad_norm": 0.0}, "algo.max_grad_norm"),
        ({"name": "ppo", "clip_eps": "wide"}, "algo.clip_eps"),
        ({"name": "ppo", "kl_coef": 0.1}, "algo.kl_coef"),
        ({"name": "ppo", "proximal": "old"}, "algo.proximal"),
        ({"name": "ppo", "behaviour_weight_cap": 0.5}, "algo.behaviour_weight_cap"),
        ({"name": "ppo", "ratio": "token"}, "algo.ratio"),
        ({"name": "ppo", "ratio": "element", "proximal": "behaviour"}, "algo.ratio"),
        ({"name": "ppo", "behaviour_weight_mode": "clip"}, "algo.behaviour_weight_mode"),
        ({"name": "ppo", "advantage_ema": 1.0}, "algo.advantage_ema"),
        ({}, "algo.name"),
    ],
)
def test_algo_config_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        build(AlgoConfig, data, "algo")
    assert info.value.field == field


def test_algo_config_defaults_build():
    cfg = build(AlgoConfig, {"name": "grpo", "dual_clip": None}, "algo")
    assert cfg.dual_clip is None and cfg.clip_eps == 0.2 and cfg.group_size == 4
