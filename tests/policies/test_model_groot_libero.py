"""The CPU smoke of GR00T end to end (N1.5 with ``groot_libero``, N1.7 with
``groot17_libero``), with the tiny random GR00T (a LeRobot groot directory and its processor
assets): packed SFT on a LeRobot v3.0 dataset through the data lake (``rlvla3 sft --preset``),
RL on real LIBERO from that checkpoint (``rlvla3 rl --preset``: PPO on Flow-SDE
log-probabilities, a few learner updates) and
``rlvla3 eval`` of the RL run (deterministic acting from the seeded noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tiny_runs import LIBERO_SMOKE, last_json, run_rlvla3

from datalake import synthetic
from datalake.writer import WriterConfig, write_dataset

pytestmark = LIBERO_SMOKE


@pytest.mark.parametrize("preset", ["groot_libero", "groot17_libero"])
def test_groot_libero_sft_then_rl_then_eval_with_the_tiny_groot(preset, tmp_path):
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    demos = tmp_path / "demos"  # LIBERO's shapes: agentview + wrist, state 8, action 7
    write_dataset(demos, synthetic.episodes(4, 20, 30, size=(64, 64)),
                  WriterConfig(codec="h264", episodes_per_file=4))
    cpu = {"groot_libero": "groot", "groot17_libero": "groot17"}[preset]
    sft = last_json(run_rlvla3(["sft", "--preset", preset, "--config",
                                 f"tests/data/{cpu}_sft_cpu.yaml", "--dataset", str(demos),
                                 "--run-dir", str(tmp_path / "sft"), "--max-steps", "4",
                                 "--set", "log_every=2", "--set", "checkpoint_every=4"], 600))
    assert sft["steps"] == 4 and sft["metrics"]["real_tokens_per_s"] > 0
    options = json.loads((Path(sft["checkpoint"]) / "meta.json").read_text())["policy"]["options"]
    assert len(options["state_min"]) == 8 and len(options["action_max"]) == 7  # from the data

    run = tmp_path / "rl"
    # PPO: the tiny random GR00T never succeeds on LIBERO, so GRPO's advantages are all zero
    # and `rlvla3 rl` reports that the weights did not move; PPO's value head moves them.
    summary = last_json(run_rlvla3(["rl", "--preset", preset, "--config",
                                    f"tests/data/{cpu}_libero_cpu.yaml", "--set",
                                    f"init_from={tmp_path / 'sft'}", "--set", "algo.name=ppo",
                                    "--run-dir", str(run), "--json"], 600))
    assert summary["policy"] == "groot" and summary["algo"] == "ppo"
    assert summary["episodes"] >= 4 and summary["trained_decisions"] >= 4  # a PPO batch
    assert summary["policy_version"] >= 1 and summary["restarts"] == 0
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["policy"]["options"]["state_min"] == options["state_min"]  # SFT's units kept
    assert meta["spec"]["chunk_len"] == 16

    result = last_json(run_rlvla3(["eval", "--checkpoint", str(run), "--task-ids", "0",
                                   "--episodes-per-task", "2", "--max-steps", "16", "--workers",
                                   "1", "--videos", "0", "--output-dir", str(tmp_path / "eval"),
                                   "--json"], 600))
    assert result["episodes"] == 2 and result["complete"] and result["faults"] == 0
    assert result["acting"] == "deterministic" and result["env_steps"] == 32
