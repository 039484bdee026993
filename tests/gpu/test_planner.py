"""The cluster planner's arithmetic: stage rates from their formulas, the closed-loop rollout
model against a discrete-event simulation of the same loop, the split search, and the plan
applied to a run config (``rlvla3 plan`` and ``rl --plan``)."""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import replace

import pytest

from rlvla3.config import ConfigError
from rlvla3.gpu.costs import CALIBRATIONS, GpuCosts
from rlvla3.gpu.plan import (
    EnvTiming,
    PlanRequest,
    make_plan,
    plan_overrides,
    plan_split,
    predict,
    rollout_gpu,
    split_batch,
    training_rate,
)
from rlvla3.queue.pacing import inherent_lag
from rlvla3.run_config import load_run_config

H200 = CALIBRATIONS["pi05_h200"]
LIBERO = EnvTiming(episode_s=20.9, decisions=36.1, env_steps=179.7, max_decisions=44,
                   success_rate=0.5)


def test_training_rate_is_batch_over_step_time():
    # 24 GPUs, batch 960: 30 ms x 960 / 24 + 50 ms = 1.25 s per step
    assert training_rate(H200, 24, 960) == pytest.approx(960 / 1.25)
    assert training_rate(H200, 48, 960) > training_rate(H200, 24, 960)


def test_global_batch_rounds_to_the_learner_actors():
    req = PlanRequest(gpus=16, sim_cpus=256, global_batch=1024, granularity=2)
    assert split_batch(req, 10) == 1025  # 5 actors of 2 GPUs: the nearest multiple of 5
    assert split_batch(req, 8) == 1024


def closed_loop(slots: int, decision_s: float, a: float, b: float, seconds: float = 3000.0,
                seed: int = 0) -> float:
    """Decisions/s of ``slots`` slots (env time exponential around ``decision_s``) sharing one
    GPU that serves whatever is pending when it is free, each batch taking a + b x B."""
    rng = random.Random(seed)
    events = [(rng.expovariate(1 / decision_s), i) for i in range(slots)]
    heapq.heapify(events)
    pending, t, free_at, done = [], 0.0, 0.0, 0
    while events:
        t, i = heapq.heappop(events)
        if t > seconds:
            break
        if i >= 0:
            pending.append(i)
        else:  # a batch finished: its slots step their env
            batch = -i - 1
            done += batch if t > seconds / 5 else 0
        if t >= free_at and pending:
            batch, pending = pending, []
            free_at = t + a + b * len(batch)
            for j in batch:
                heapq.heappush(events, (free_at + rng.expovariate(1 / decision_s), j))
            heapq.heappush(events, (free_at, -len(batch) - 1))
    return done / (seconds * 0.8)


@pytest.mark.parametrize("slots", [8, 48, 160, 400])
def test_rollout_model_agrees_with_a_simulation_of_the_loop(slots):
    """The fixed point of the closed loop (idle, busy and saturated GPUs alike) within 12% of
    a discrete-event simulation of the same loop."""
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0)
    model = rollout_gpu(costs, slots, 0.58, 1.0, b_limit=1000).decisions_per_s
    simulated = closed_loop(slots, 0.58, 0.036, 0.007)
    assert model == pytest.approx(simulated, rel=0.12)


def test_rollout_gpu_saturates_at_its_largest_batch():
    costs = GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0)
    few = rollout_gpu(costs, 4, 0.58, 1.0, b_limit=64)
    many = rollout_gpu(costs, 2000, 0.58, 1.0, b_limit=64)
    assert not few.saturated and few.mean_batch == 1.0
    assert many.saturated and many.mean_batch == 64
    assert many.decisions_per_s == pytest.approx(64 / (0.036 + 0.007 * 64))
    stalled = rollout_gpu(costs, 2000, 0.58, 1.0, b_limit=64, stall=0.5)
    assert stalled.decisions_per_s == pytest.approx(many.decisions_per_s / 2)


def test_bottleneck_follows_the_slowest_stage():
    req = PlanRequest(gpus=16, sim_cpus=4096, global_batch=960)
    assert predict(H200, LIBERO, req, 2, 14, 400, 1).bottleneck == "training"
    assert predict(H200, LIBERO, req, 15, 1, 1000, 1).bottleneck == "inference"
    assert predict(H200, LIBERO, req, 12, 4, 32, 1).bottleneck == "env"
    # steady state: every produced decision is trained, at the slower stage's rate
    p = predict(H200, LIBERO, req, 4, 12, 400, 1)
    assert p.decisions_per_s == pytest.approx(training_rate(H200, 4, 960))
    assert p.env_steps_per_s == pytest.approx(p.decisions_per_s * LIBERO.steps_per_decision)


def test_plan_picks_the_fastest_split_in_steps_of_the_granularity():
    req = PlanRequest(gpus=32, sim_cpus=512, global_batch=840, granularity=4, slots_multiple=32)
    plan = make_plan(H200, LIBERO, req)
    splits = [p.learner_gpus for p in plan.alternatives]
    assert splits == [4, 8, 12, 16, 20, 24, 28]
    top = max(p.decisions_per_s for p in plan.alternatives)
    assert plan.best.decisions_per_s >= 0.995 * top
    assert plan.best.env_slots % 32 == 0 and plan.best.env_slots <= 512
    assert plan.best.global_batch % (plan.best.learner_gpus // 4) == 0
    # most GPUs train: a sample costs 30 ms to train and about 7 ms to act
    assert plan.best.learner_gpus > plan.best.rollout_gpus


def test_costly_weight_transfers_raise_weights_every():
    req = PlanRequest(gpus=16, sim_cpus=512, global_batch=256)
    costly = GpuCosts(**{**{k: getattr(H200, k) for k in ("infer_per_call_ms",
                                                          "infer_per_sample_ms",
                                                          "train_per_sample_ms",
                                                          "train_per_step_ms")},
                         "sync_fixed_ms": 3000.0, "model_gb": 7.0})
    cheap, slow = (plan_split(c, LIBERO, req, 12, 4) for c in (H200, costly))
    assert slow.weights_every > cheap.weights_every
    plan = make_plan(costly, LIBERO, req)
    assert plan.max_staleness >= plan.best.weights_every + plan.pace_lag


def test_plan_applies_to_a_run_config():
    req = PlanRequest(gpus=16, sim_cpus=256, global_batch=840, granularity=2, slots_multiple=32)
    plan = make_plan(H200, LIBERO, req)
    overrides = plan_overrides(plan, 32, granularity=2)
    cfg = load_run_config("default", overrides=[
        "env.name=latency_replay", "rollout.cost_model=pi05_h200",
        "learner.cost_model=pi05_h200", *overrides])
    b = plan.best
    assert cfg.learner.num_learners * cfg.learner.ranks_per_actor == b.learner_gpus
    assert cfg.rollout.num_servers * cfg.rollout.lanes == b.rollout_gpus
    assert cfg.env_workers.num_workers * cfg.env_workers.slots_per_worker == b.env_slots
    assert cfg.rollout.batching.name == "adaptive"
    assert cfg.queue.max_staleness == plan.max_staleness
    lag = inherent_lag(b.env_slots, 44, 1, cfg.algo.update_epochs, cfg.learner.global_batch)
    assert lag <= cfg.queue.max_staleness


@pytest.mark.parametrize(("request_args", "field"), [
    ({"gpus": 1, "sim_cpus": 8}, "gpus"),
    ({"gpus": 16, "sim_cpus": 8, "granularity": 3}, "granularity"),
    ({"gpus": 16, "sim_cpus": 0}, "sim_cpus"),
])
def test_bad_requests_name_the_field(request_args, field):
    with pytest.raises(ConfigError) as info:
        make_plan(H200, LIBERO, PlanRequest(**request_args))
    assert info.value.field == field


def test_plan_command_prints_json_and_refuses_bad_input(capsys):
    from commands.plan import main

    assert main(["--cost-model", "pi05_a100_eager", "--gpus", "8", "--sim-cpus", "128",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["split"]["learner_gpus"] + out["split"]["rollout_gpus"] == 8
    assert out["predicted"]["bottleneck"] in ("env", "inference", "training")
    assert "learner.num_gpus=1" in out["overrides"]
    assert main(["--cost-model", "pi05_h300", "--gpus", "8", "--sim-cpus", "128"]) == 2
    assert "cost_model.name" in capsys.readouterr().err
    assert main(["--cost-model", "custom", "--cost", "infer_per_call_ms=-3", "--gpus", "8",
                 "--sim-cpus", "128"]) == 2
    assert "infer_per_call_ms" in capsys.readouterr().err


def test_rl_plan_applies_the_plan_and_user_overrides_win(capsys):
    import yaml

    from commands.rl import main

    base = ["--set", "env.name=latency_replay", "--set", "env_workers.slots_per_worker=16"]
    assert main(["--plan", "--plan-gpus", "8", "--plan-sim-cpus", "128", "--plan-cost-model",
                 "pi05_h200", *base, "--set", "queue.max_staleness=99", "--print-config"]) == 0
    captured = capsys.readouterr()
    cfg = yaml.safe_load(captured.out)
    assert "plan for 8 GPUs" in captured.err
    assert cfg["learner"]["num_gpus"] == 1 and cfg["rollout"]["num_gpus"] == 1
    assert cfg["learner"]["num_learners"] + cfg["rollout"]["num_servers"] == 8
    assert cfg["queue"]["max_staleness"] == 99  # the user's own --set wins
    # the preset's global batch of 64 over 6 learners: micro-batches cut to a learner's share
    assert cfg["learner"]["micro_batch"] * cfg["learner"]["num_learners"] \
        <= cfg["learner"]["global_batch"]
    assert main(["--plan", *base, "--print-config"]) == 2  # no GPU count
    assert "--plan-gpus" in capsys.readouterr().err
    assert main(["--plan", "--plan-gpus", "8", "--plan-sim-cpus", "64", *base[:2],
                 "--print-config"]) == 2  # real costs and no cost model to plan from
    assert "--plan-cost-model" in capsys.readouterr().err
    assert main(["--plan", "--plan-gpus", "8", "--plan-sim-cpus", "64", "--plan-cost-model",
                 "pi05_h200", "--print-config"]) == 2  # reach has no latency to plan from
    assert "env.name" in capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_cost_model_of_zeros_is_refused_naming_the_missing_figures(capsys):
    """``custom`` without figures (or a stage zeroed) would make a GPU stage free: once a
    ZeroDivisionError, now one line naming the figures, from ``plan``, ``rl --plan`` and the
    core alike."""
    from commands.plan import main as plan
    from commands.rl import main as rl

    assert plan(["--cost-model", "custom", "--gpus", "4", "--sim-cpus", "16"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rlvla3 plan: config field '--cost'")
    assert "infer_per_call_ms or infer_per_sample_ms and train_per_sample_ms or " \
           "train_per_step_ms > 0" in line
    assert plan(["--cost-model", "pi05_h200", "--cost", "infer_per_call_ms=0", "--cost",
                 "infer_per_sample_ms=0", "--gpus", "4", "--sim-cpus", "16"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "infer_per_call_ms or infer_per_sample_ms > 0" in line and "train_per" not in line

    base = ["--plan", "--plan-gpus", "4", "--plan-sim-cpus", "16",
            "--set", "env.name=latency_replay", "--print-config"]
    assert rl([*base, "--plan-cost-model", "custom"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "'--plan-cost-model'" in line and "learner.cost_model's options" in line
    assert rl([*base, "--set", "learner.cost_model={name: custom, options: "
               "{train_per_sample_ms: 5}}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "'learner.cost_model.options'" in line and "infer_per_call_ms or" in line

    with pytest.raises(ConfigError, match="train_per_sample_ms or train_per_step_ms") as err:
        make_plan(replace(H200, train_per_sample_ms=0.0, train_per_step_ms=0.0), LIBERO,
                  PlanRequest(gpus=4, sim_cpus=16))
    assert err.value.field == "cost_model.options"


def test_groot_at_its_real_size_plans_from_its_estimated_costs():
    """GR00T-N1.5's calibration: its weights are the real model's parameter count in bf16, it
    acts cheaper per sample than the pi0.5-shape VLA measured (1.77 against 2.85 TFLOP) and
    trains cheaper (frozen backbone), and a plan of 16 GPUs comes out of it."""
    from pathlib import Path

    groot, vla = CALIBRATIONS["groot_n15_h100_eager"], CALIBRATIONS["pi05_h200_eager"]
    keys = json.loads((Path(__file__).parents[1] / "data" / "groot_n15_keys.json").read_text())
    assert groot.model_gb == pytest.approx(keys["parameters"] * 2 / 1e9, rel=0.01)
    assert groot.infer_per_sample_ms == pytest.approx(
        vla.infer_per_sample_ms * 1.77 / 2.85, rel=0.05)
    assert groot.train_per_sample_ms < vla.train_per_sample_ms
    assert groot.inference_ms(1) == pytest.approx(85.0, abs=1.0)  # N1.7's eager figure
    assert "estimate" in groot.source
    plan = make_plan(groot, LIBERO, PlanRequest(gpus=16, sim_cpus=256, global_batch=128,
                                                simulate_rollout=False))
    assert plan.best.learner_gpus + plan.best.rollout_gpus == 16


def test_groot_n17_at_its_real_size_plans_from_its_estimated_costs():
    """GR00T-N1.7's calibration: its weights are the real model's parameter count (LeRobot
    0.6.1's meta-device build) in bf16, it acts cheaper per sample than N1.5's estimate (1.04
    against 1.77 TFLOP) and a plan of 16 GPUs comes out of it."""
    from pathlib import Path

    n17, n15 = CALIBRATIONS["groot_n17_h100_eager"], CALIBRATIONS["groot_n15_h100_eager"]
    keys = json.loads((Path(__file__).parents[1] / "data" / "groot_n17_keys.json").read_text())
    assert n17.model_gb == pytest.approx(keys["parameters"] * 2 / 1e9, rel=0.01)
    assert n17.infer_per_sample_ms < n15.infer_per_sample_ms
    assert n17.inference_ms(1) == pytest.approx(85.0, abs=1.0)
    assert "estimate" in n17.source
    plan = make_plan(n17, LIBERO, PlanRequest(gpus=16, sim_cpus=256, global_batch=128,
                                              simulate_rollout=False))
    assert plan.best.learner_gpus + plan.best.rollout_gpus == 16


def test_slot_overhead_lengthens_each_slots_decision():
    """The runtime's own time per decision (``slot_overhead_ms``) adds to the slot's env time:
    with inference and training far from binding, decisions/s is slots / (E + o + response)."""
    fast = GpuCosts(infer_per_call_ms=0.1, infer_per_sample_ms=0.01, train_per_sample_ms=0.01,
                    source="test")
    rates = {}
    for overhead in (0.0, 100.0):
        req = PlanRequest(gpus=8, sim_cpus=64, global_batch=64, slot_overhead_ms=overhead)
        pred = predict(fast, LIBERO, req, 4, 4, 64, 1)
        assert pred.bottleneck == "env"
        rates[overhead] = pred.decisions_per_s
        cycle = LIBERO.decision_s + overhead / 1000.0 + pred.response_ms / 1000.0
        assert pred.decisions_per_s == pytest.approx(64 / cycle, rel=0.02)
    assert rates[100.0] < rates[0.0]
    with pytest.raises(ValueError, match="slot_overhead_ms"):
        PlanRequest(gpus=8, sim_cpus=64, slot_overhead_ms=-1).validate()


def test_bench_scale_replans_full_runs_with_a_measured_env_loop_overhead(tmp_path, capsys):
    """``bench scale --replan FULL [--overhead-from LOOP]`` runs nothing: it re-predicts each
    full run's own split, slots and cadence, in closed form and with simulated rollout GPUs,
    with the env loop's overhead measured at the same scale and dilation when given."""
    from commands.bench.scale import main as bench_scale

    full = {"cost_model": "pi05_h200", "runs": [
        {"gpus": 8, "mode": "full", "split": {"learner_gpus": 6, "rollout_gpus": 2},
         "env_slots": 128, "global_batch": 840, "planned": {"weights_every": 2},
         "dilation": 2.0, "trained_env_steps_per_s": 743.0,
         "predicted_trained_env_steps_per_s": 857.2, "prediction_error": -0.133}]}
    (tmp_path / "full.json").write_text(json.dumps(full))
    loop = {"env_loop": {"8": {"env_slots": 128, "dilation": 2.0, "slot_overhead_ms": 80.0}}}
    (tmp_path / "loop.json").write_text(json.dumps(loop))
    assert bench_scale(["--replan", str(tmp_path / "full.json"), "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)["replan"]
    assert plain["closed_form"] == pytest.approx(857.2, rel=1e-3)  # the run's own prediction
    assert plain["error_simulated"] == pytest.approx(743.0 / plain["simulated"] - 1, abs=1e-3)
    args = ["--replan", str(tmp_path / "full.json"), "--overhead-from", str(tmp_path / "loop.json"),
            "--json"]
    assert bench_scale(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["replan"]
    assert row["slot_overhead_ms"] == 80.0
    assert row["closed_form"] < plain["closed_form"]  # each decision costs more
    assert row["simulated"] < plain["simulated"]
    assert row["error_closed_form"] == pytest.approx(743.0 / row["closed_form"] - 1, abs=1e-3)
    loop["env_loop"]["8"]["dilation"] = 3.0
    (tmp_path / "loop.json").write_text(json.dumps(loop))
    with pytest.raises(SystemExit, match="dilation 3"):
        bench_scale(args)


@pytest.mark.parametrize("epochs", [1, 2])
def test_planned_pacing_admits_every_slot_even_after_a_run_of_longest_episodes(epochs):
    """The queue admits while ``(backlog + (in_flight + 1) x recent mean length) x epochs /
    global_batch <= pace_lag``: with every slot in flight, the backlog at its bound and every
    recent episode of the longest length, the planned bound still admits."""
    req = PlanRequest(gpus=32, sim_cpus=512, global_batch=840, granularity=4,
                      update_epochs=epochs)
    plan = make_plan(H200, LIBERO, req)
    slots, batch = plan.best.env_slots, plan.best.global_batch
    backlog = req.pace_backlog * batch
    lag = (backlog + slots * LIBERO.max_decisions) * epochs / batch  # the last slot's admission
    assert lag <= plan.pace_lag
    assert plan.max_staleness >= plan.pace_lag + plan.best.weights_every
    # the plan paces by that lag bound alone: no separate backlog cap that ignores the work
    # in flight
    assert "queue.pace_backlog=0" in plan_overrides(plan, 32, 4)


def test_update_epochs_divide_the_training_rate_and_multiply_the_weight_versions():
    """Each batch gets ``update_epochs`` optimizer steps: the learners train half the
    decisions per second at two epochs, and a rollout GPU sees twice the versions, so the same
    weights_every stalls it twice as often. The plan then puts more GPUs on training."""
    req1 = PlanRequest(gpus=16, sim_cpus=512, global_batch=960)
    req2 = PlanRequest(gpus=16, sim_cpus=512, global_batch=960, update_epochs=2)
    assert training_rate(H200, 8, 960, 2) == pytest.approx(training_rate(H200, 8, 960) / 2)
    one, two = (predict(H200, LIBERO, r, 8, 8, 400, 1) for r in (req1, req2))
    assert two.capacity_env_steps_per_s["training"] == pytest.approx(
        one.capacity_env_steps_per_s["training"] / 2)
    assert two.trained_env_steps_per_s < one.trained_env_steps_per_s
    fast_learners = replace(req1, global_batch=96)  # rollout-bound: the stall is what differs
    s1 = predict(H200, LIBERO, fast_learners, 15, 1, 64, 8).sync_stall_fraction
    s2 = predict(H200, LIBERO, replace(fast_learners, update_epochs=2), 15, 1, 64,
                 8).sync_stall_fraction
    assert s2 > 1.7 * s1 > 0
    plan1, plan2 = (make_plan(H200, LIBERO, replace(r, simulate_rollout=False))
                    for r in (req1, req2))
    assert plan2.best.learner_gpus > plan1.best.learner_gpus


def test_the_bottleneck_is_the_stage_of_the_lowest_capacity_and_none_is_exceeded():
    """The stage named is the one with the lowest capacity, and the predicted rate is within
    every stage's capacity, for the closed form and for the simulated rollout GPUs."""
    for gpus, cpus in ((16, 512), (32, 1024), (8, 64)):
        plan = make_plan(H200, LIBERO, PlanRequest(gpus=gpus, sim_cpus=cpus, global_batch=960))
        for pred in [plan.best, *plan.alternatives]:
            cap = pred.capacity_env_steps_per_s
            assert pred.bottleneck == min(cap, key=cap.get)
            assert all(pred.env_steps_per_s <= v * 1.001 for v in cap.values()), (pred, cap)


@pytest.mark.parametrize("gpus", [8, 12, 16, 24, 32, 48, 64])
def test_bench_scale_lays_out_whole_actors_per_node_at_any_gpu_count(gpus):
    """The simulated cluster of ``bench scale`` (``ceil(gpus / 8)`` nodes of 8 GPUs and a
    simulator node) holds every actor of the planned full run and of the colocated baseline:
    actors of ``gpus / 8`` GPUs did not pack into 8-GPU nodes at 24 GPUs."""
    import argparse
    import math
    from pathlib import Path

    from commands.bench.scale import parser
    from measure.cluster.bench_scale import (
        GPUS_PER_NODE,
        WORKLOAD,
        Bench,
        colocated_layout,
        planned_layout,
    )
    from rlvla3.plan.cluster import NodeInfo, place

    args = parser().parse_args(["--cost-model", "pi05_h200", "--gpus", str(gpus)])
    bench = Bench(argparse.Namespace(**vars(args)), Path("."))
    plan = bench.plan(gpus)  # as the benchmark plans it, with its own actor size
    per_actor = plan.request.granularity
    slots_per_worker, sim_cpus = args.slots_per_worker, bench.sim_cpus(gpus)
    nodes = [NodeInfo("head", "", {"CPU": 0.0}, 1e6, 1e5, driver=True)]
    nodes += [NodeInfo(f"gpu{i}", "", {"CPU": 16.0, "sim_gpu": 8.0}, 1e6, 1e5)
              for i in range(math.ceil(gpus / GPUS_PER_NODE))]
    nodes.append(NodeInfo("sim", "", {"CPU": 64.0, "sim": float(sim_cpus)}, 1e6, 1e5))
    costs = ["rollout.cost_model=pi05_h200", "learner.cost_model=pi05_h200",
             "ray.check_memory=false"]
    for layout, batch in ((planned_layout(plan, slots_per_worker, per_actor),
                           plan.best.global_batch),
                          (colocated_layout(gpus, sim_cpus, slots_per_worker), 840)):
        cfg = load_run_config("default", overrides=WORKLOAD + costs + layout + [
            f"learner.global_batch={batch}"])
        placement = place(cfg, nodes)
        assert placement.blocking is None and not placement.waiting, layout
