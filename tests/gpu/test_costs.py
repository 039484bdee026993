"""Simulated GPU costs: the calibrations, config validation, and each sleep model's timing from
its formula on a fake clock (no timing assertions: the clock is ours)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from envs import dilate_env
from measure.gpu.cost_check import usable
from rlvla3.algos.config import AlgoConfig
from rlvla3.config import ConfigError, Named, build
from rlvla3.gpu.costs import (
    CALIBRATIONS,
    CostClock,
    GpuCosts,
    TrainingCost,
    jitter_factor,
    resolve_costs,
)
from rlvla3.run_config import load_run_config


class FakeClock:
    """Time that moves only when something sleeps (or a test advances it)."""

    def __init__(self):
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds

    def clock(self, dilation: float) -> CostClock:
        return CostClock(dilation, now=self.now, sleep=self.sleep)


def test_calibrations_carry_their_figures():
    h200 = CALIBRATIONS["pi05_h200"]
    assert h200.inference_ms(1) == 43.0  # sglang PR #34256: 43 ms per chunk at batch 1
    assert CALIBRATIONS["pi05_a100"].inference_ms(1) == 28.0  # vllm-omni PR #4419
    assert CALIBRATIONS["pi05_a100_eager"].inference_ms(1) == 200.0  # lerobot #828
    assert CALIBRATIONS["pi05_h100_flops"].inference_ms(4) == 40.0 + 7.0 * 4
    # OpenTau PR #176: 83 samples/s on 8 A100s
    assert 8 * 1000.0 / CALIBRATIONS["pi05_a100"].train_per_sample_ms == pytest.approx(83, rel=0.01)
    assert h200.sync_ms == pytest.approx(300.0 + 1000.0 * 7.0 / 25.0)
    for costs in CALIBRATIONS.values():
        costs.validate()
        assert costs.source


def test_measured_calibration_is_the_median_of_the_committed_gpu_runs():
    """``pi05_h200_eager`` comes from ``rlvla3 bench gpu`` on an H200: each figure is the
    median of the committed runs' ``costs`` entries (rounded to two significant figures)."""
    runs = sorted((Path(__file__).parents[2] / "results" / "gpu_check").glob("h200_*.json"))
    measured = [json.loads(p.read_text())["entries"]["costs"]["cost_model"]["options"]
                for p in runs]
    assert len(measured) >= 3
    calibration = CALIBRATIONS["pi05_h200_eager"]
    for name in ("infer_per_call_ms", "infer_per_sample_ms", "train_per_sample_ms",
                 "train_per_step_ms", "model_gb"):
        median = statistics.median(m[name] for m in measured)
        assert getattr(calibration, name) == float(f"{median:.2g}"), name
    # a measured cost model in the form `bench gpu` prints resolves as custom figures
    options = {k: v for k, v in measured[0].items() if k != "source"}
    assert resolve_costs(Named("custom", options), "rollout.cost_model").infer_per_sample_ms > 0


def test_a_measured_line_below_zero_at_batch_zero_is_usable_but_a_free_model_is_not():
    """One slow point at the largest batch tilts the fitted line below zero at B = 0; its
    per-call cost is clipped to 0, which a plan accepts. No cost at all, or NaN, is refused."""
    measured = {"infer_per_call_ms": 0.0, "infer_per_sample_ms": 18.2, "train_per_sample_ms": 22.4,
                "train_per_step_ms": 2.7, "model_gb": 0.0007, "source": "a noisy CPU dry run"}
    assert usable(measured)
    assert not usable(dict(measured, infer_per_sample_ms=0.0))
    assert not usable(dict(measured, train_per_sample_ms=float("nan")))
    assert not usable(dict(measured, train_per_step_ms=-1.0))


def test_resolve_overrides_and_custom_figures():
    assert resolve_costs(Named("real"), "rollout.cost_model") is None
    tuned = resolve_costs(Named("pi05_h200", {"infer_per_call_ms": 30}), "rollout.cost_model")
    assert tuned.infer_per_call_ms == 30.0 and tuned.infer_per_sample_ms == 7.0
    custom = resolve_costs(Named("custom", {"infer_per_call_ms": 20, "infer_per_sample_ms": 2,
                                            "train_per_sample_ms": 9}), "learner.cost_model")
    assert custom.training_ms(16, ranks=4) == 9.0 * 16 / 4
    assert custom.source == "custom figures"


@pytest.mark.parametrize(("overrides", "field"), [
    (["rollout.cost_model=pi05_h300"], "rollout.cost_model.name"),
    (["rollout.cost_model={name: pi05_h200, options: {infer_per_call_ms: -1}}"],
     "rollout.cost_model.options.infer_per_call_ms"),
    (["rollout.cost_model={name: pi05_h200, options: {per_call: 3}}"],
     "rollout.cost_model.options.per_call"),
    (["rollout.cost_model={name: real, options: {infer_per_call_ms: 3}}"],
     "rollout.cost_model.options"),
    (["rollout.cost_model={name: custom, options: {train_per_sample_ms: 3}}"],
     "rollout.cost_model.options"),
    (["rollout.lanes=2"], "rollout.lanes"),
    (["learner.ranks_per_actor=4"], "learner.ranks_per_actor"),
    (["time_dilation=4", "rollout.cost_model=pi05_h200"], "time_dilation"),
    (["time_dilation=0"], "time_dilation"),
    (["rollout.weights_every=0"], "rollout.weights_every"),
    (["rollout.batching=greedy"], "rollout.batching.name"),
    (["rollout.batching={name: adaptive, options: {headroom: 0.5}}"],
     "rollout.batching.options.headroom"),
    (["rollout.batching={name: fixed, options: {b_limit: 4}}"],
     "rollout.batching.options.b_limit"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_run_config("default", overrides=overrides)
    assert info.value.field == field


def test_dilation_needs_an_env_with_simulated_latency():
    assert dilate_env(Named("latency_replay", {"time_scale": 0.5}), 4.0).options["time_scale"] == 2.0
    assert dilate_env(Named("reach", {"latency": "synthetic"}), 3.0).options["latency_scale"] == 3.0
    assert dilate_env(Named("reach"), 1.0) == Named("reach")
    with pytest.raises(ConfigError) as info:
        dilate_env(Named("reach"), 2.0)
    assert info.value.field == "time_dilation"


def test_clock_sleeps_what_remains_after_real_compute():
    fake = FakeClock()
    clock = fake.clock(dilation=10.0)
    start = fake.now()
    fake.t += 0.1  # 0.1 s of real compute inside a 43 ms x 10 = 0.43 s cost
    assert clock.pay(43.0, start) == pytest.approx(0.33)
    assert fake.t - start == pytest.approx(0.43)
    start = fake.now()
    fake.t += 0.5  # real compute longer than the cost: no sleep, counted as an overrun
    assert clock.pay(20.0, start) == 0.0
    s = clock.stats
    assert s.calls == 2 and s.overruns == 1
    assert s.simulated_s == pytest.approx(0.063)  # reported in simulated seconds
    assert s.overrun_s == pytest.approx((0.5 - 0.2) / 10)
    assert s.overhead_fraction == pytest.approx((0.01 + 0.02) / 0.063)
    assert fake.sleeps == [pytest.approx(0.33)]


def test_clock_refuses_a_non_positive_dilation():
    with pytest.raises(ValueError):
        CostClock(0.0)


def test_jitter_is_clipped_and_centred():
    rng = np.random.default_rng(0)
    draws = np.array([jitter_factor(rng, 0.5) for _ in range(5000)])
    assert draws.min() >= 0.5 and draws.max() <= 1.5
    assert abs(draws.mean() - 1.0) < 0.02
    assert jitter_factor(rng, 0.0) == 1.0


def test_simulated_engine_pays_per_sample_and_per_step():
    """A learner actor standing for 4 ranks: each micro-batch of 8 costs 30 x 8 / 4 ms and
    each optimizer step 50 ms, x the dilation, whatever the real compute took; the learner core
    itself holds no clock (the engine it trains through is wrapped)."""
    from support.reach_episodes import collect_segments, episodes, make_policy

    from rlvla3.gpu.sim import SimulatedEngine
    from rlvla3.learner.core import LearnerCore, StreamingStart, rl_engine

    policy = make_policy(0)
    segments = collect_segments(policy, 6)
    fake = FakeClock()
    costs = CALIBRATIONS["pi05_h200"]
    algo = AlgoConfig("ppo")
    engine = SimulatedEngine(rl_engine(policy, algo, 1e-3),
                             TrainingCost(costs, ranks=4, dilation=2.0), clock=fake.clock(2.0))
    core = LearnerCore(policy, algo, local_batch=16, micro_batch=8, lr=1e-3,
                       start=StreamingStart(), engine=engine)
    core.add_groups(episodes(segments))
    steps = core.run_available()
    assert steps >= 1
    micro = 30.0 * 8 / 4 * 2.0 / 1000.0
    step = 50.0 * 2.0 / 1000.0
    micro_batches = core.micro_steps  # streaming: the next step's batches may have begun
    assert fake.sleeps[:3 * steps] == pytest.approx([micro, micro, step] * steps)
    assert fake.sleeps[3 * steps:] == pytest.approx([micro] * (micro_batches - 2 * steps))
    assert engine.clock.stats.simulated_s == pytest.approx(micro_batches * 0.06 + steps * 0.05)
    assert not hasattr(core, "clock") and not hasattr(core, "cost")


def test_simulated_rollout_pays_the_batch_formula_and_the_weight_transfer():
    from support.reach_episodes import REACH, make_policy

    from envs import make_env
    from rlvla3.gpu.sim import SimulatedRollout
    from rlvla3.rollout.core import RolloutCore
    from rlvla3.types import WeightsMessage

    costs = build(GpuCosts, {"infer_per_call_ms": 36.0, "infer_per_sample_ms": 7.0,
                             "infer_jitter": 0.0, "sync_fixed_ms": 100.0, "model_gb": 0.0})
    fake = FakeClock()
    policy = make_policy(0)
    lane = SimulatedRollout(RolloutCore(policy), costs, dilation=3.0, seed=0,
                            clock=fake.clock(3.0), sync_clock=fake.clock(3.0))
    obs = make_env(REACH).reset(0, 0)
    for size in (1, 4, 9):
        chunks = lane.act_batch([obs] * size)
        assert len(chunks) == size and {c.policy_version for c in chunks} == {0}
    assert fake.sleeps == pytest.approx([(36 + 7 * b) * 3.0 / 1000.0 for b in (1, 4, 9)])
    assert lane.clock.stats.simulated_s == pytest.approx((36 * 3 + 7 * 14) / 1000.0)
    assert not lane.swap_pending() and len(fake.sleeps) == 3  # nothing offered: no transfer
    weights = {k: v.detach().numpy() for k, v in policy.state_dict().items()}
    lane.offer_weights(WeightsMessage(1, weights))
    assert lane.swap_pending() and lane.version == 1 and lane.swaps == 1
    assert fake.sleeps[3:] == pytest.approx([100.0 * 3.0 / 1000.0])


def test_weights_every_holds_versions_back_until_far_enough_ahead():
    from support.reach_episodes import make_policy

    from rlvla3.rollout.core import RolloutCore
    from rlvla3.types import WeightsMessage

    policy = make_policy(0)
    core = RolloutCore(policy)
    weights = {k: v.detach().numpy() for k, v in policy.state_dict().items()}
    core.offer_weights(WeightsMessage(1, weights))
    core.offer_weights(WeightsMessage(2, weights))
    assert not core.swap_pending(min_lead=3) and core.version == 0
    core.offer_weights(WeightsMessage(3, weights))
    assert core.swap_pending(min_lead=3) and core.version == 3
    core.offer_weights(WeightsMessage(1, weights), force=True)  # a rollback always applies
    assert core.swap_pending(min_lead=3) and core.version == 1


def test_a_gpu_check_report_becomes_a_calibration_and_a_plan_beside_todays(capsys, tmp_path):
    """The committed H200 report's ``costs`` entry turns into a cost model, a calibration entry
    that evaluates back to it (two significant figures), and a second plan."""
    from commands.plan import main
    from rlvla3.gpu.costs import calibration_source, costs_from_gpu_check

    path = Path(__file__).parents[2] / "results" / "gpu_check" / "h200_check.json"
    report = json.loads(path.read_text())
    costs = costs_from_gpu_check(report)
    options = report["entries"]["costs"]["cost_model"]["options"]
    assert costs.infer_per_call_ms == options["infer_per_call_ms"]
    assert costs.sync_fixed_ms == 300.0 and costs.source == options["source"]
    name, value = eval("{" + calibration_source("pi05_h200_new", costs) + "}",
                       {"GpuCosts": GpuCosts}).popitem()
    assert name == "pi05_h200_new"
    assert value.train_per_sample_ms == float(f"{options['train_per_sample_ms']:.2g}")
    with pytest.raises(ValueError, match="no 'costs' entry"):
        costs_from_gpu_check({"entries": {}})

    assert main(["--cost-model", "pi05_h200_eager", "--gpus", "8", "--sim-cpus", "128",
                 "--closed-form", "--gpu-check", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    today, measured = out["plans"].values()
    assert today["cost_model"] != measured["cost_model"]
    assert "GpuCosts(" in out["calibration"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["--cost-model", "pi05_h200", "--gpus", "8", "--sim-cpus", "128",
                 "--gpu-check", str(bad)]) == 2
