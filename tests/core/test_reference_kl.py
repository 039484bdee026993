"""The anchor to the reference policy (``algo.ref_kl_coef``): the estimate, its place in the
objective, and a learner that trains with it staying nearer its reference than one without."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from support.reach_episodes import collect_segments, episodes, make_policy

from rlvla3.algos.config import AlgoConfig
from rlvla3.algos.losses import objective, reference_kl
from rlvla3.config import ConfigError
from rlvla3.learner.core import BatchStart, LearnerCore
from rlvla3.learner.samples import prepare_samples
from rlvla3.run_config import load_run_config


def test_the_estimate_is_zero_where_the_policies_agree_and_grows_both_ways():
    log_prob = torch.tensor([-3.0, -3.0, -3.0, -3.0], dtype=torch.float64)
    ref = torch.tensor([-3.0, -2.0, -4.0, -3.0 + 1e-3], dtype=torch.float64)
    kl = reference_kl(log_prob, ref, count=10)
    assert kl[0] == 0 and (kl[1:] > 0).all()
    # near agreement it is the quadratic r^2 E / 2 of the per-Gaussian log-ratio r
    torch.testing.assert_close(kl[3], torch.tensor(1e-4 ** 2 * 10 / 2, dtype=torch.float64),
                               rtol=1e-3, atol=0.0)
    far = reference_kl(torch.tensor([0.0]), torch.tensor([1e6]), count=1)
    assert torch.isfinite(far).all()  # the clip keeps one far decision finite


def _evaluation(policy, segments):
    batch = prepare_samples(segments, AlgoConfig("ppo"))
    return batch, policy.evaluate(batch.obs, torch.from_numpy(batch.actions),
                                  torch.from_numpy(batch.latents))


def test_the_objective_adds_the_weighted_estimate_and_needs_the_reference():
    segments = collect_segments(make_policy(1), 2)
    batch, ev = _evaluation(make_policy(2), segments)
    n = len(batch.log_probs)
    args = (ev, torch.from_numpy(batch.log_probs), torch.zeros(n), torch.zeros(n),
            torch.zeros(n), ev.log_prob.detach())
    off, off_stats = objective(AlgoConfig("grpo"), *args)
    ref = ev.log_prob.detach() - 0.5
    on, on_stats = objective(AlgoConfig("grpo", ref_kl_coef=2.0), *args, ref_log_prob=ref)
    count = 1 if ev.log_prob_elements is None else ev.log_prob_elements.shape[1]
    expected = reference_kl(ev.log_prob, ref, count).mean()
    torch.testing.assert_close(on - off, 2.0 * expected)
    assert on_stats.ref_kl == pytest.approx(expected.item()) and np.isnan(off_stats.ref_kl)
    with pytest.raises(ValueError, match="reference policy"):
        objective(AlgoConfig("grpo", ref_kl_coef=2.0), *args)


def test_a_learner_with_the_anchor_stays_nearer_its_reference():
    """The same data and steps, with and without the anchor: the anchored learner's log-probs
    of the decisions stay nearer the reference's, and each step reports the distance."""
    segments = collect_segments(make_policy(1), 12)
    batch = sum(len(s) for s in segments)
    reference = make_policy(2)
    distance, reported = {}, {}
    for coef in (0.0, 50.0):
        policy = make_policy(2)
        core = LearnerCore(policy, AlgoConfig("ppo", ref_kl_coef=coef), local_batch=batch,
                           micro_batch=batch, lr=3e-2, start=BatchStart(),
                           reference=copy.deepcopy(reference) if coef else None)
        steps = []
        for _ in range(6):
            core.add_groups(episodes(segments))
            core.run_available(on_step=steps.append)
        assert core.version == 6 and len(steps) == 6
        reported[coef] = [s.ref_kl for s in steps]
        _, own = _evaluation(policy, segments)
        _, ref = _evaluation(reference, segments)
        distance[coef] = float(reference_kl(own.log_prob, ref.log_prob, 1).mean().detach())
    assert distance[50.0] < 0.5 * distance[0.0], distance
    assert all(np.isnan(v) for v in reported[0.0])
    assert reported[50.0][0] == pytest.approx(0.0, abs=1e-6)  # the first step starts on it
    assert all(np.isfinite(v) and v >= 0 for v in reported[50.0])
    with pytest.raises(ValueError, match="reference policy"):
        LearnerCore(make_policy(2), AlgoConfig("ppo", ref_kl_coef=1.0), local_batch=batch,
                    micro_batch=batch, lr=1e-2, start=BatchStart())


def test_the_config_refuses_an_anchor_without_init_from_or_below_zero():
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=["algo.ref_kl_coef=0.1"])
    assert err.value.field == "algo.ref_kl_coef" and "init_from" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=["algo.ref_kl_coef=-1"])
    assert err.value.field == "algo.ref_kl_coef"
