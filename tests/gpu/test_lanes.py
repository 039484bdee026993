"""The event-by-event rollout GPU (``rlvla3.gpu.lanes``) and the planner's use of it: rates
that follow from the loop's own arithmetic in the limits where it is exact, weight transfers
that cost what they take, and a plan whose figures are the simulated ones."""

from __future__ import annotations

import math

import pytest

from rlvla3.gpu.costs import CALIBRATIONS, GpuCosts
from rlvla3.gpu.lanes import SlotTiming, simulate_lane
from rlvla3.gpu.plan import EnvTiming, PlanRequest, make_plan, predict, refine, slot_timing

H200 = CALIBRATIONS["pi05_h200"]
LIBERO = EnvTiming(episode_s=20.9, decisions=36.1, env_steps=179.7, max_decisions=44,
                   success_rate=0.5, reset_s=3.0, chunk_cv=0.15)
STEADY = SlotTiming(steps_s=0.5, steps_cv=0.0, reset_s=0.0, decisions=40.0,
                    requests_per_decision=1.0)


def test_an_instant_gpu_gives_every_slot_its_env_rate():
    free = GpuCosts(infer_per_call_ms=0.0, infer_per_sample_ms=0.0)
    lane = simulate_lane(free, STEADY, 32, 256, math.inf, 1, seconds=100.0, warmup=10.0)
    assert lane.decisions_per_s == pytest.approx(32 / 0.5, rel=0.02)
    assert lane.response_s == pytest.approx(0.0, abs=1e-9) and lane.sync_fraction == 0.0


def test_a_saturated_gpu_serves_its_largest_batch_back_to_back():
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0)
    lane = simulate_lane(costs, STEADY, 2000, 64, math.inf, 1, seconds=100.0, warmup=20.0)
    assert lane.mean_batch == pytest.approx(64, rel=0.01)
    assert lane.decisions_per_s == pytest.approx(64 / (0.036 + 0.007 * 64), rel=0.02)
    assert lane.busy == pytest.approx(1.0, abs=0.02)


def test_a_light_load_is_answered_in_about_one_call():
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0)
    lane = simulate_lane(costs, STEADY, 2, 256, math.inf, 1, seconds=200.0)
    assert 0.043 * 0.97 <= lane.response_s < 0.043 * 1.5  # one call (jitter averages out)
    assert lane.decisions_per_s == pytest.approx(2 / (0.5 + lane.response_s), rel=0.02)


def test_weight_transfers_take_their_share_and_slow_the_slots():
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0, sync_fixed_ms=580.0,
                     model_gb=0.0)
    without = simulate_lane(costs, STEADY, 64, 256, math.inf, 1)
    every_5s = simulate_lane(costs, STEADY, 64, 256, 2.5, 2)  # a transfer every 5 s
    assert every_5s.sync_fraction == pytest.approx(0.58 / 5.0, rel=0.05)
    assert every_5s.decisions_per_s < without.decisions_per_s * (1 - 0.5 * 0.58 / 5.0)
    assert every_5s.mean_batch > without.mean_batch  # the backlog drains in large batches


def test_bootstrap_requests_and_resets_cost_time():
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0)
    plain = simulate_lane(costs, STEADY, 16, 256, math.inf, 1)
    more = SlotTiming(0.5, 0.0, 0.0, 40.0, requests_per_decision=1.5)
    resets = SlotTiming(0.5, 0.0, 4.0, 10.0, requests_per_decision=1.0)  # 0.4 s per decision
    assert simulate_lane(costs, more, 16, 256, math.inf, 1).decisions_per_s < (
        plain.decisions_per_s)
    slow = simulate_lane(costs, resets, 16, 256, math.inf, 1)
    assert slow.decisions_per_s == pytest.approx(16 / (0.9 + slow.response_s), rel=0.05)


def test_the_same_seed_gives_the_same_lane():
    timing = slot_timing(LIBERO)
    one, two = (simulate_lane(H200, timing, 64, 256, 3.0, 2, seed=3) for _ in range(2))
    assert one == two
    assert simulate_lane(H200, timing, 64, 256, 3.0, 2, seed=4) != one


def test_refine_agrees_with_the_closed_form_without_transfers_and_not_with_them():
    """Without weight transfers the closed form and the simulation agree (within 10%); with
    pi0.5's 0.58 s transfers the simulation is slower: the slots of a GPU that stops pile up
    and the backlog drains in slow batches, which the closed form spreads thinly."""
    req = PlanRequest(gpus=8, sim_cpus=512, global_batch=840)
    free_sync = GpuCosts(**{**{k: getattr(H200, k) for k in (
        "infer_per_call_ms", "infer_per_sample_ms", "infer_jitter", "train_per_sample_ms",
        "train_per_step_ms")}, "sync_fixed_ms": 0.0, "model_gb": 0.0})
    closed = predict(free_sync, LIBERO, req, 6, 2, 128, 2)
    simulated = refine(free_sync, LIBERO, req, closed)
    assert simulated.decisions_per_s == pytest.approx(closed.decisions_per_s, rel=0.10)
    assert simulated.analytic_decisions_per_s == closed.decisions_per_s
    closed = predict(H200, LIBERO, req, 6, 2, 128, 2)
    simulated = refine(H200, LIBERO, req, closed)
    assert simulated.sync_stall_fraction > 0.02
    assert simulated.decisions_per_s < closed.decisions_per_s


def test_a_plan_reports_simulated_figures_unless_asked_not_to():
    req = PlanRequest(gpus=16, sim_cpus=256, global_batch=840, granularity=2, slots_multiple=32)
    plan = make_plan(H200, LIBERO, req)
    assert plan.best.analytic_decisions_per_s is not None
    assert plan.as_dict()["predicted"]["closed_form_env_steps_per_s"] > 0
    closed = make_plan(H200, LIBERO, PlanRequest(**{**req.__dict__, "simulate_rollout": False}))
    assert closed.best.analytic_decisions_per_s is None
    assert "closed_form_env_steps_per_s" not in closed.as_dict()["predicted"]
