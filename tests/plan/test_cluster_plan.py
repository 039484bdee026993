"""The pre-flight without Ray: where roles would land (``rlvla3.plan.cluster``), whether a plan
fits, and the memory estimate (``rlvla3.plan.memory``), including a pi0.5-sized GPU config
planned on the nodes cluster.yaml would launch, and ``rlvla3 rl --print-plan``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envs import env_spec
from rlvla3.config import ConfigError
from rlvla3.plan.cluster import (
    NodeInfo,
    check_placement,
    nodes_from_cluster_config,
    place,
)
from rlvla3.plan.memory import (
    KEPT_SIMULATOR_MB,
    SIMULATOR_MB,
    estimate,
    measure_activations,
    model_facts,
    vla_activation_bytes,
)
from rlvla3.policies import build_policy
from rlvla3.run_config import load_run_config

REPO = Path(__file__).resolve().parents[2]
ROLES = ["learner.resources={learner: 1}", "rollout.resources={rollout: 1}",
         "env_workers.resources={sim: 1}"]
PI05 = ["policy.name=vla", "policy.options.preset=pi05", "learner.num_gpus=1",
        "rollout.num_gpus=1", "learner.micro_batch=4", "learner.global_batch=64",
        "env_workers.num_workers=4", "env_workers.slots_per_worker=6",
        "env_workers.num_cpus=6", "env_workers.resources={sim: 6}",
        "learner.resources={learner: 1}", "rollout.resources={rollout: 1}"]


def node(name: str, cpus: float, driver: bool = False, memory_mb: float = 16_000, **res):
    return NodeInfo(name, "", {"CPU": cpus, **res}, memory_mb, 0.3 * memory_mb, driver)


def cluster() -> list[NodeInfo]:
    return [node("head", 0, driver=True), node("learner", 2, learner=1),
            node("rollout", 1, rollout=1), node("sim0", 1, sim=1), node("sim1", 1, sim=1)]


def test_disaggregated_roles_land_on_their_nodes_and_env_workers_spread():
    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=full"])
    plan = place(cfg, cluster())
    assert plan.where[("learner", 0)] == "learner" and plan.where[("rollout", 0)] == "rollout"
    assert {plan.where[("env", 0)], plan.where[("env", 1)]} == {"sim0", "sim1"}
    assert plan.where[("queue", 0)] == plan.where[("status", 0)] == "head"
    assert not plan.waiting and check_placement(cfg, plan, can_add_nodes=False) == []


def test_colocated_is_one_node_and_is_refused_when_no_node_holds_every_role():
    cfg = load_run_config("smoke", overrides=["pipeline.mode=sync",
                                              "learner.resources={learner: 1}"])
    plan = place(cfg, cluster())
    assert {plan.where[(r, 0)] for r in ("learner", "rollout", "env")} == {"learner"}
    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=sync"])
    plan = place(cfg, cluster())
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, plan, can_add_nodes=False)
    assert err.value.field == "pipeline.placement" and "learner: 1, rollout: 1, sim: 2" in str(
        err.value)
    # with an autoscaler the same plan waits for a node instead
    assert check_placement(cfg, plan, can_add_nodes=True)


def test_the_learner_gang_starts_whole_or_waits_and_missing_env_nodes_are_named():
    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=full",
                                                      "learner.num_learners=2",
                                                      "env_workers.num_workers=3"])
    plan = place(cfg, cluster())  # one learner node with room for one rank only (2 CPUs)
    assert plan.where[("learner", 0)] is None and plan.where[("learner", 1)] is None
    assert plan.where[("rollout", 0)] is None  # the gang waits whole
    assert plan.where[("env", 2)] is None  # two sim nodes for three env workers
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, plan, can_add_nodes=False)
    assert err.value.field == "learner.resources"


def test_memory_plan_refuses_a_node_that_cannot_hold_its_simulators():
    cfg = load_run_config("smoke", overrides=ROLES + [
        "env.name=latency_replay", "env_workers.slots_per_worker=6",
        f"env_workers.sim_memory_mb={SIMULATOR_MB['libero']}"])
    spec = env_spec(cfg.env)
    small = [node("head", 0, driver=True), node("learner", 2, learner=1),
             node("rollout", 1, rollout=1), node("sim0", 1, memory_mb=12_000, sim=1),
             node("sim1", 1, sim=1)]
    plan = estimate(cfg, spec, place(cfg, small), model_facts(cfg.policy, spec))
    problems = plan.problems()
    assert len(problems) == 1 and "sim0" in problems[0] and "env worker" in problems[0]
    assert "> 12,000 MB" in problems[0]  # the numbers: estimate against the node's memory
    with pytest.raises(ConfigError) as err:
        plan.check()
    assert err.value.field == "ray.check_memory" and "env worker (6 latency_replay slots)" in str(
        err.value)
    fine = estimate(cfg, spec, place(cfg, cluster()), model_facts(cfg.policy, spec))
    assert fine.problems() == []


def test_memory_plan_counts_the_simulators_a_libero_slot_keeps():
    def env_worker_mb(*overrides: str) -> float:
        cfg = load_run_config("smoke", overrides=ROLES + [
            "env.name=libero", "env.options={suite: libero_spatial, image_size: [64, 64]}",
            "env_workers.slots_per_worker=2", *overrides])
        spec = env_spec(cfg.env)
        plan = estimate(cfg, spec, place(cfg, cluster()), model_facts(cfg.policy, spec))
        return plan.role_totals()["env"] / cfg.env_workers.num_workers

    one = env_worker_mb()
    assert env_worker_mb("env.options.cached_sims=3") == pytest.approx(
        one + 2 * 2 * KEPT_SIMULATOR_MB["libero"])  # two slots, two more simulators each
    # no more kept than the tasks a slot trains on
    assert env_worker_mb("env.options.cached_sims=3", "env_workers.task_ids=[0, 1]") == (
        pytest.approx(one + 2 * KEPT_SIMULATOR_MB["libero"]))


def test_activation_formula_matches_the_measurement_on_cpu():
    """The per-layer count (used for presets that only build on CUDA) against the bytes one
    ``evaluate`` really saves, on a small VLA with LIBERO's two cameras."""
    cfg = load_run_config("libero_spatial", overrides=[
        "policy.name=vla", "policy.options.preset=tiny", "policy.options.image_size=64",
        "policy.options.shapes={depth: 4, mlp: 512}"])
    spec = env_spec(cfg.env)
    measured = measure_activations(build_policy(cfg.policy, spec), spec, n=2)
    counted = vla_activation_bytes(cfg.policy.options, spec, fused_attention=False,
                                   instruction_tokens=64)
    assert counted == pytest.approx(measured, rel=0.15)


def test_pi05_gpu_plan_on_the_nodes_cluster_yaml_would_launch():
    cfg = load_run_config("libero_spatial", overrides=PI05)
    spec = env_spec(cfg.env)
    nodes = nodes_from_cluster_config(yaml.safe_load((REPO / "cluster.yaml").read_text()), cfg)
    placement = place(cfg, nodes)
    assert not placement.waiting
    types = {n.node_type for n in nodes}
    assert {"head", "learner_gpu", "rollout_gpu", "sim_cpu"} <= types
    assert sum(n.node_type == "sim_cpu" for n in nodes) == 1  # 4 x sim 6 fit one sim_cpu (24)
    facts = model_facts(cfg.policy, spec)
    assert facts.source.startswith("formula") and 3.0e9 < facts.params < 3.6e9
    plan = estimate(cfg, spec, placement, facts)
    learner = next(c for p in plan.nodes for c in p.components if c.role == "learner")
    # float32 weights, gradients and Adam: 16 bytes a parameter, then activations and CUDA
    assert learner.gpu_mb > 16 * facts.params / 2**20 and learner.gpu_share == 1.0
    assert plan.gpu_of(placement.nodes[placement.where[("learner", 0)]]) == 80 * 1024
    text = plan.render()
    assert "learner rank 0" in text and "GPU" in text


def test_print_plan_cli():
    out = subprocess.run([sys.executable, "-m", "rlvla3", "rl", "--preset", "libero_spatial",
                          *[a for o in PI05 for a in ("--set", o)], "--print-plan",
                          "--plan-cluster", "cluster.yaml", "--json"], cwd=REPO, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["placement"]["learner"][0].startswith("learner_gpu")
    assert data["memory"]["model"]["activations"].startswith("formula")
    gpu = [c for n in data["memory"]["nodes"] for c in n["components"] if c["gpu_mb"]]
    assert {c["role"] for c in gpu} == {"learner", "rollout"}


def test_offload_is_counted_and_recommended_only_where_it_fits():
    """pi0.5 on 2 learner GPUs of 80 GB at micro-batch 8 fits neither DDP (117 GB a GPU) nor
    FSDP (94 GB): the refusal names learner.offload with what it would need, and with offload
    the pre-flight counts the shards and Adam as host memory (the GPU keeps what it gathers
    and the activations) and the plan fits as FSDP. At micro-batch 16 offload would not fit
    either: the refusal does not recommend it, and asked for, it is refused by its figures."""
    from rlvla3.plan.memory import choose_sharding, learner_gpu_mb

    base = [*PI05, "learner.num_learners=2"]

    def preflight(*extra: str):
        cfg = load_run_config("libero_spatial", overrides=[*base, *extra])
        spec = env_spec(cfg.env)
        nodes = nodes_from_cluster_config(yaml.safe_load((REPO / "cluster.yaml").read_text()),
                                          cfg)
        placement = place(cfg, nodes)
        facts = model_facts(cfg.policy, spec)
        chosen, note = choose_sharding(cfg, spec, placement, facts)
        return chosen, note, estimate(chosen, spec, placement, facts)

    with pytest.raises(ConfigError) as err:
        preflight("learner.micro_batch=8")
    assert err.value.field == "learner.sharding"
    assert "fit neither way" in str(err.value) and "or learner.offload=true: 68.7 GB)" in str(
        err.value)
    chosen, note, plan = preflight("learner.micro_batch=8", "learner.offload=true")
    assert chosen.learner.sharding == "fsdp" and "learner.offload" in note
    plan.check()  # fits
    gpu, have = learner_gpu_mb(plan)
    assert gpu / 1024 == pytest.approx(68.7, abs=0.05) and gpu <= have
    learner = next(c for p in plan.nodes for c in p.components if c.name == "learner rank 1")
    assert learner.host_mb > 12_808 * 4 / 2  # its half of weights, gradients, Adam: host

    with pytest.raises(ConfigError) as err:
        preflight("learner.micro_batch=16")
    assert "offload" not in str(err.value) and "smaller learner.micro_batch" in str(err.value)
    _, _, plan = preflight("learner.micro_batch=16", "learner.offload=true")
    with pytest.raises(ConfigError) as err:
        plan.check()
    assert "in host memory (offload)" in str(err.value) and "offload=true" not in str(err.value)
