"""Batching policies: the adaptive control law on a fake clock (fed arrivals and service times
by the test), the cost fit, and the batcher asking a policy only once a batch is forming."""

from __future__ import annotations

import asyncio
import math

import pytest

from rlvla3.config import Named
from rlvla3.rollout.batcher import DynamicBatcher
from rlvla3.rollout.batching import (
    AdaptiveBatching,
    AdaptiveConfig,
    CostFit,
    FixedBatching,
    Limits,
    make_batching_rule,
)

A, B = 0.036, 0.007  # pi05_h200: 36 ms per call, 7 ms per sample


def trained(policy: AdaptiveBatching, sizes=(1, 4, 8, 16, 32), rounds: int = 4) -> None:
    """Batches of several sizes with service times exactly A + B x size."""
    for _ in range(rounds):
        for size in sizes:
            policy.served(size, A + B * size)


def arrivals(policy: AdaptiveBatching, rate: float, n: int, start: float = 0.0) -> float:
    """``n`` arrivals at ``rate`` per second; returns the time of the last."""
    t = start
    for _ in range(n):
        t += 1.0 / rate
        policy.arrived(t)
    return t


def test_cost_fit_recovers_per_call_and_per_sample():
    fit = CostFit(decay=0.9)
    for size in (1, 3, 7, 20, 2, 9):
        fit.add(size, A + B * size)
    a, b = fit.coefficients()
    assert a == pytest.approx(A) and b == pytest.approx(B)


def test_cost_fit_without_spread_takes_the_whole_cost_per_call():
    fit = CostFit(decay=0.9)
    for _ in range(5):
        fit.add(8, 0.1)
    assert fit.coefficients() == (pytest.approx(0.1), 0.0)


def test_no_measurement_fires_at_once_with_the_limit():
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=128))
    assert policy.limits(pending=1, now=0.0) == Limits(1, 0.0, 128)


def test_fires_at_headroom_times_the_batch_that_keeps_up():
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=256, headroom=1.5))
    trained(policy)
    now = arrivals(policy, rate=80.0, n=200)
    need = 80.0 * A / (1 - 80.0 * B)  # 6.5: the smallest batch that keeps up
    limits = policy.limits(pending=1, now=now)
    assert limits.fire_at == math.ceil(1.5 * need) == 10
    assert limits.b_max == 256  # whatever is pending is taken: none is left behind
    # one pending: wait for the missing ones at the measured rate, at most half a call
    assert limits.t_max_s == pytest.approx(min(9 / 80.0, 0.5 * A))
    assert policy.limits(pending=10, now=now).t_max_s == 0.0  # enough already: fire at once
    state = policy.state()
    assert state["per_call_ms"] == pytest.approx(36.0) and state["b_need"] == pytest.approx(need)
    assert state["arrival_rate"] == pytest.approx(80.0, rel=0.01)


def test_light_load_fires_at_once():
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=256))
    trained(policy)
    now = arrivals(policy, rate=5.0, n=100)
    limits = policy.limits(pending=1, now=now)
    assert limits.fire_at == 1 and limits.t_max_s == 0.0  # 5/s x 43 ms: one per call keeps up


def test_overload_fires_at_once_with_the_largest_batch():
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=200))
    trained(policy)
    now = arrivals(policy, rate=1.0 / B + 10, n=300)  # beyond 1/b: no batch keeps up
    assert policy.limits(pending=50, now=now) == Limits(1, 0.0, 200)


def test_latency_bound_caps_the_batch():
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=256, max_latency_ms=203.0), time_scale=2.0)
    trained(policy)
    now = arrivals(policy, rate=1000.0, n=300)  # overload: it would take 256
    # 203 simulated ms x dilation 2 = 0.406 s of service: (0.406 - a) / b requests
    assert policy.limits(pending=300, now=now).b_max == math.floor((0.406 - A) / B) == 52


def test_rate_decays_when_arrivals_stop():
    policy = AdaptiveBatching(AdaptiveConfig())
    now = arrivals(policy, rate=100.0, n=100)
    assert policy.rate(now) == pytest.approx(100.0, rel=0.02)
    assert policy.rate(now + 9.0) < 11.0


def test_fixed_policy_and_time_dilation():
    fixed = make_batching_rule(Named("fixed", {"b_max": 32, "t_max_ms": 5.0}), time_scale=4.0)
    assert isinstance(fixed, FixedBatching)
    assert fixed.limits(1, 0.0) == Limits(32, pytest.approx(0.02), 32)
    assert fixed.state()["t_max_ms"] == pytest.approx(5.0)  # reported in simulated ms
    assert isinstance(make_batching_rule(Named("adaptive", {"b_limit": 64})),
                      AdaptiveBatching)


class Spy(FixedBatching):
    """A fixed policy that records when it is asked for limits and what it is told."""

    def __init__(self):
        super().__init__(b_max=3, t_max_s=0.0)
        self.asked_with: list[int] = []
        self.served_sizes: list[int] = []

    def limits(self, pending: int, now: float) -> Limits:
        self.asked_with.append(pending)
        return super().limits(pending, now)

    def served(self, size: int, service_s: float) -> None:
        self.served_sizes.append(size)


def test_batcher_asks_its_rule_only_while_a_batch_is_forming():
    """No timer before the first request: limits are asked only with >= 1 request pending;
    every batch is reported to the policy."""
    async def main():
        spy = Spy()
        batcher = DynamicBatcher(lambda items: [i * 2 for i in items], spy)
        await asyncio.sleep(0.01)  # idle: nothing may be asked yet
        assert spy.asked_with == []
        results = await asyncio.gather(*(batcher.submit(i) for i in range(7)))
        stats = batcher.stats()
        await batcher.close()
        return spy, results, stats

    spy, results, stats = asyncio.run(main())
    assert results == [i * 2 for i in range(7)]
    assert spy.asked_with and min(spy.asked_with) >= 1
    assert spy.served_sizes == [3, 3, 1]
    assert stats.rule == {"b_max": 3, "t_max_ms": 0.0}
