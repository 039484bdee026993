"""What an RL run's summary and console say about its learners and about training that did not
happen: the learner group's engine and ranks (``summary.json``'s ``learner_group`` and a console
line), a run of uniform GRPO groups that trained nothing (counted), and a run whose optimizer
steps left the weights where ``init_from`` put them (it says so and exits 1, as a run that
trained nothing does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.tiny_runs import TINY_RUN

from actors.rl.summary import learner_group, learner_line, trained_nothing
from envs import env_spec
from rlvla3.run_config import load_run_config

REPO = Path(__file__).resolve().parents[2]


def test_every_grpo_group_uniform_is_named_with_its_count_not_a_budget_to_raise():
    cfg = load_run_config("smoke", overrides=["algo.name=grpo", "algo.group_size=4",
                                              "algo.skip_uniform_groups=true"])
    spec = env_spec(cfg.env)
    summary = {"this_leg": {"trained_decisions": 0, "env_steps": 640, "episodes": 40},
               "stopped_by": "total_env_steps=640",
               "groups": {"received": 0, "uniform_skipped": 10}}
    line = trained_nothing(summary, cfg, spec)
    assert line.startswith("trained nothing: all 10 GRPO groups of 4 that completed in 640 env "
                           "steps (40 episodes finished; stopped by total_env_steps=640) were "
                           "uniform (every member failed or every one succeeded)"), line
    assert "raise total_env_steps" not in line and "init_from" in line
    assert "algo.redraw_rounds (now 0: more episodes of a uniform group's key)" in line
    # some groups reached the learner: the budget was short; the uniform ones are counted
    summary["groups"] = {"received": 3, "uniform_skipped": 2}
    line = trained_nothing(summary, cfg, spec)
    assert "; 2 uniform GRPO groups skipped," in line and "raise total_env_steps" in line


def test_steps_that_did_not_move_the_weights_are_named_with_their_cause():
    cfg = load_run_config("smoke")
    spec = env_spec(cfg.env)
    summary = {"this_leg": {"trained_decisions": 384}, "policy_version": 12,
               "weights_moved": 0.0, "objective": {"steps": 12,
                                                   "no_grad_fraction": {"p10": 1.0}}}
    line = trained_nothing(summary, cfg, spec)
    assert line.startswith("the weights did not move: 12 optimizer steps (to version 12) left "
                           "them where init_from put them (weights_moved 0): every decision "
                           "of every step gave no gradient"), line
    assert "skip_uniform_groups" in line
    assert trained_nothing({**summary, "weights_moved": 1.3e-3}, cfg, spec) == ""
    assert trained_nothing({**summary, "weights_moved": None}, cfg, spec) == ""  # not measured


def test_the_learner_group_is_named_by_the_engine_its_ranks_run():
    cfg = load_run_config("smoke", overrides=["learner.num_learners=2",
                                              "learner.sharding=fsdp"])
    assert learner_line(cfg).startswith("learners: 2 ranks, fsdp (FSDP2: weights, gradients "
                                        "and Adam state sharded")
    assert learner_group(cfg, 2, ["fsdp", "fsdp"], 0)["strategy"] == "fsdp"
    assert learner_group(cfg, 1, ["single"], 1)["strategy"] == "single"  # rebuilt with one
    assert learner_line(load_run_config("smoke")).startswith("learners: 1 rank, single")


def test_an_fsdp_run_that_left_its_weights_unmoved_says_both_and_exits_1(tmp_path):
    """Two FSDP learner ranks from a checkpoint, at a learning rate too small to move a weight:
    the console says the learners shard (and FSDP warns of no view it hooks), ``summary.json``
    records fsdp over 2 ranks, and the run ends with the line that its weights did not move,
    exit status 1."""
    from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
    from rlvla3.policies import build_policy

    overrides = [*TINY_RUN, "total_env_steps=600", "learner.num_learners=2",
                 "learner.sharding=fsdp", "learner.num_cpus=0.5", "learner.lr=1e-15",
                 "checkpoint_every=0"]
    cfg = load_run_config("smoke", overrides=overrides)
    spec = env_spec(cfg.env)
    save_checkpoint(tmp_path / "start", build_policy(cfg.policy, spec),
                    CheckpointMeta(cfg.policy, spec, 0))
    args = [f"--set={o}" for o in [*overrides, f"init_from={tmp_path / 'start'}"]]
    proc = subprocess.run([sys.executable, "-m", "rlvla3", "rl", "--preset", "smoke", *args,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "learners: 2 ranks, fsdp (FSDP2" in proc.stdout  # the progress lines
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy_version"] >= 1 and summary["weights_moved"] == 0.0
    assert {k: summary["learner_group"][k] for k in ("strategy", "ranks")} == {
        "strategy": "fsdp", "ranks": 2}
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlvla3 rl: the weights did not move: "), last
    assert "returned a view tensor" not in proc.stdout + proc.stderr  # FSDP has none to hook


def test_the_groups_by_task_line_names_the_tasks_without_a_mixed_group():
    from actors.rl.summary import groups_by_task_line

    assert groups_by_task_line({"groups": {"received": 3}}) == ""
    row = {"mixed": 0, "all_failed": 4, "all_succeeded": 0, "queued_decisions": 0}
    line = groups_by_task_line({"groups": {"by_task": {
        "0": {**row, "mixed": 2, "queued_decisions": 80}, "7": row}}})
    assert line == ("GRPO groups by task (mixed/all failed/all succeeded): 0 2/4/0, 7 0/4/0; "
                    "no mixed group: task 7")
