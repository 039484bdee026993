"""The small policy's running state standardisation (``normalize_state``): moments of the
states a training forward sees, exact over batches, frozen after ``normalize_until``, and
carried by the weights to the rollout servers and into checkpoints."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from envs import env_spec, make_env
from rlvla3.config import Named
from rlvla3.policies import build_policy
from rlvla3.types import ObsBatch

REACH = Named("reach", {"image_size": 16, "max_decisions": 6})


def _batch(n: int, seed: int) -> ObsBatch:
    """Real reach observations with the state moved to raw units far from 1 (a position of
    a few metres varying by a decimetre), as a simulator's proprioception is."""
    env, rng = make_env(REACH), np.random.default_rng(seed)
    obs = ObsBatch.stack([env.reset(int(rng.integers(4)), int(rng.integers(5)))
                          for _ in range(n)])
    state = 3.0 + 0.1 * rng.standard_normal(obs.state.shape).astype(np.float32)
    return dataclasses.replace(obs, state=state)


def _small(**options):
    torch.manual_seed(0)
    return build_policy(Named("small", {"channels": 8, "hidden": 32, **options}), env_spec(REACH))


def test_state_moments_follow_training_forwards_only_and_are_exact_over_batches():
    policy = _small(normalize_state=True, normalize_until=50)
    a, b = _batch(16, 0), _batch(24, 1)
    policy.act(a)  # acting (no gradients) never moves the moments
    assert float(policy.state_count) == 0
    for obs in (a, b):
        out = policy.act(obs)
        policy.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
    both = np.concatenate([a.state, b.state])
    assert float(policy.state_count) == 40
    np.testing.assert_allclose(policy.state_mean.numpy(), both.mean(0), rtol=1e-5)
    np.testing.assert_allclose(policy.state_var.numpy(), both.var(0), rtol=1e-3)
    with torch.no_grad():
        z = policy._state(torch.as_tensor(both))
    assert z.mean(0).abs().max() < 1e-3 and (z.std(0, unbiased=False) - 1).abs().max() < 0.05
    c = _batch(16, 2)
    out = policy.act(c)
    policy.evaluate(c, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
    assert float(policy.state_count) == 56  # the batch that crosses normalize_until counts
    policy.evaluate(c, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
    assert float(policy.state_count) == 56  # ... and then the moments stay


def test_the_moments_travel_with_the_weights_and_an_unnormalised_policy_has_none():
    policy = _small(normalize_state=True)
    obs = _batch(16, 0)
    out = policy.act(obs)
    policy.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
    copy = _small(normalize_state=True)
    assert not np.allclose(copy.act(obs, deterministic=True).actions,
                           policy.act(obs, deterministic=True).actions)
    copy.load_state_dict(policy.state_dict())
    np.testing.assert_array_equal(copy.act(obs, deterministic=True).actions,
                                  policy.act(obs, deterministic=True).actions)
    assert {"state_mean", "state_var", "state_count"} <= set(policy.state_dict())
    assert not {"state_mean", "state_var", "state_count"} & set(_small().state_dict())


def test_the_trunk_film_starts_as_the_identity_and_learns_from_the_instruction():
    """``film_trunk``: with the weights of a policy without it, the same actions at the start;
    a policy-gradient step moves the FiLM's weights (the instruction reaches the trunk)."""
    plain, film = _small(), _small(film_trunk=True)
    film.load_state_dict(plain.state_dict(), strict=False)
    obs = _batch(8, 0)
    np.testing.assert_array_equal(film.act(obs, deterministic=True).actions,
                                  plain.act(obs, deterministic=True).actions)
    out = film.act(obs)
    ev = film.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
    (-ev.log_prob * torch.linspace(-1, 1, len(obs))).sum().backward()
    assert film.trunk_film.weight.grad.abs().sum() > 0
