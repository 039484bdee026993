"""The trust region's scale (``algo.ratio``): a flow-matching decision is a product of many
Gaussians. The default clips the ratio of the whole decision, as PPO does, and gives each
Gaussian the whole policy gradient; ``element`` clips one ratio per Gaussian and
``normalised`` their geometric mean, for decisions of thousands of Gaussians whose product's
ratio would leave the clip range after tiny per-Gaussian changes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlvla3.algos.config import AlgoConfig
from rlvla3.algos.losses import objective, ppo_loss
from rlvla3.protocols import Evaluation


def _evaluation(elements: torch.Tensor) -> Evaluation:
    n = len(elements)
    return Evaluation(log_prob=elements.sum(1), value=torch.zeros(n, dtype=elements.dtype),
                      entropy=torch.zeros(n, dtype=elements.dtype), log_prob_elements=elements)


def test_a_log_ratio_above_the_cap_still_pushes_a_negative_advantage_down():
    """Without the dual clip, a decision whose probability rose by e^25 with a negative
    advantage must get the strongest push down, not none (the cap bounds the value only)."""
    new = torch.tensor([25.0], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_loss(new, torch.zeros(1, dtype=torch.float64),
                           torch.tensor([-1.0], dtype=torch.float64), 0.2, None)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20.0))
    assert new.grad.item() == pytest.approx(math.exp(20.0))  # d(-r A)/d log pi = r, capped
    assert stats.no_grad_fraction == 0.0


def test_normalised_ratio_is_the_geometric_mean_per_gaussian():
    """E = 4 Gaussians, each log-ratio 0.1 against the proximal policy: the decision's log-ratio
    is 0.4 (r = 1.49, clipped), per Gaussian 0.1 (r = 1.105, inside the trust region). The
    behaviour weight is per Gaussian too: prox - behav = 2.0 over 4 -> w = e^0.5."""
    elements = torch.full((1, 4), 0.1, dtype=torch.float64, requires_grad=True)
    prox, behav = torch.zeros(1, dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)
    adv, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    loss, stats = objective(AlgoConfig("grpo", ratio="normalised"), _evaluation(elements),
                            behav, adv, zero, zero, prox)
    loss.backward()
    r, w = math.exp(0.1), math.exp(0.5)
    assert stats.policy.clip_fraction == 0.0 and stats.policy.ratio_mean == pytest.approx(r)
    assert stats.policy.behaviour_weight_mean == pytest.approx(w)
    assert loss.item() == pytest.approx(-w * r)
    # d(-w r A)/d element = -w r / E for each of the 4
    np.testing.assert_allclose(elements.grad.numpy(), [[-w * r / 4] * 4])
    _, plain = objective(AlgoConfig("grpo", ratio="decision"), _evaluation(elements.detach()),
                         behav, adv, zero, zero, prox)
    assert plain.policy.clip_fraction == 1.0  # e^0.4 = 1.49 > 1.2
    assert plain.policy.behaviour_weight_mean == pytest.approx(2.0)  # e^2 = 7.4, capped at 2


def test_the_default_ratio_gives_each_gaussian_the_whole_policy_gradient():
    """Inside the clip range the default trust region must leave PPO's gradient as it is:
    d(-r A)/d element = -r A for every Gaussian of the decision (the joint log-probability
    sums them). Averaging the per-Gaussian surrogate (``element``) divides that share by E,
    which slowed ColorReach's learning (docs/results/rl-at-vla-scale.md)."""
    elements = torch.full((1, 4), 0.01, dtype=torch.float64, requires_grad=True)
    zero, adv = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    loss, stats = objective(AlgoConfig("grpo"), _evaluation(elements), zero, adv, zero, zero, zero)
    loss.backward()
    r = math.exp(0.04)
    assert stats.policy.clip_fraction == 0.0
    np.testing.assert_allclose(elements.grad.numpy(), [[-r] * 4])


def test_element_ratios_clip_each_gaussian_and_average_the_surrogate():
    """Per-element log-ratios [0.5, 0, 0, 0] against the proximal policy, A = 1: the first is
    clipped (r = 1.65 > 1.2, no gradient), the other three keep theirs; the decision as a whole
    still has a gradient. Surrogate: mean(1.2, 1, 1, 1) = 1.05."""
    elements = torch.tensor([[0.5, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    prox = torch.zeros((1, 4), dtype=torch.float64)
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    loss, stats = objective(AlgoConfig("grpo", ratio="element"), _evaluation(elements),
                            zero, one, zero, zero, prox)
    loss.backward()
    assert loss.item() == pytest.approx(-1.05)
    np.testing.assert_allclose(elements.grad.numpy(), [[0.0, -0.25, -0.25, -0.25]])
    assert stats.policy.clip_fraction == pytest.approx(0.25)
    assert stats.policy.no_grad_fraction == 0.0
    # KL: k3 per element, (e^0.5 - 1 - 0.5) for the first, summed per decision
    assert stats.kl_per_decision == pytest.approx(math.expm1(0.5) - 0.5)
    assert stats.kl_per_element == pytest.approx((math.expm1(0.5) - 0.5) / 4)
    with pytest.raises(ValueError, match="each of the 4 Gaussians"):
        objective(AlgoConfig("grpo", ratio="element"), _evaluation(elements), zero, one, zero,
                  zero, zero)


def test_a_weight_above_the_cap_is_masked_when_asked():
    """behav = ln 0.2, prox = 0: w = 5 > cap 2. truncate: weight 2; mask: weight 0, no gradient,
    counted."""
    new = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([math.log(0.2), 0.0], dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    loss, stats = ppo_loss(new, behav, adv, 0.2, 3.0, torch.zeros(2, dtype=torch.float64), 2.0,
                           mask_above_cap=True)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)  # -(0 * 1 + 1 * 1) / 2
    np.testing.assert_allclose(new.grad.numpy(), [0.0, -0.5])
    assert stats.truncated_fraction == 0.5 and stats.no_grad_fraction == 0.5
    np.testing.assert_allclose(stats.behaviour_weights, [5.0, 1.0], rtol=1e-6)


def test_a_normal_step_of_a_flow_matching_policy_keeps_most_of_its_gradient():
    """The tiny VLA with a Flow-SDE chain of 4 steps and noise 0.01 (4 x 6 x 7 = 168 Gaussians
    per decision), one Adam step at 1e-4 on a GRPO batch: each Gaussian moves by about 0.02
    nats of KL, the decision by about 4. With the ratio per Gaussian (``element``, the choice
    for such chains) most decisions keep their gradient; a ratio of the whole product clips
    nearly all of them."""
    from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.policies.vla import build_vla_policy

    torch.set_num_threads(1)
    spec = libero_like_spec(image_size=32, chunk_len=6)
    torch.manual_seed(0)
    policy = build_vla_policy(spec, {"preset": "tiny", "logprob": "flow_sde",
                                     "denoise_steps": 4, "noise_level": 0.01})
    obs, _ = libero_like_batch(spec, 32, np.random.default_rng(0))
    out = policy.act(obs)
    actions, latents = torch.tensor(out.actions), torch.tensor(out.latents)
    behav = torch.tensor(out.log_prob)
    adv = torch.tensor(np.random.default_rng(1).choice([-1.0, 1.0], 32), dtype=torch.float32)
    zero = torch.zeros(32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4, eps=1e-5)
    before = policy.evaluate(obs, actions, latents)
    elements = getattr(before, "log_prob_elements", None)  # the proximal policy: pre-step
    prox = (before.log_prob if elements is None else elements).detach()
    per_gaussian = AlgoConfig("grpo", ratio="element")
    loss, _ = objective(per_gaussian, before, behav, adv, zero, zero, prox)
    loss.backward()
    optimizer.step()
    after = policy.evaluate(obs, actions, latents)
    _, stats = objective(per_gaussian, after, behav, adv, zero, zero, prox)
    assert stats.policy.clip_fraction < 0.3, stats
    assert stats.policy.no_grad_fraction < 0.3, stats
    assert 0.005 < stats.kl_per_element < 0.1 and stats.kl_per_decision > 1.0, stats
    _, whole = objective(AlgoConfig("grpo", ratio="decision"), after, behav, adv, zero, zero,
                         prox)
    assert whole.policy.clip_fraction > 0.6
