"""The CPU smoke of ``--preset pi05_libero``: the tiny random pi0.5 (a LeRobot pi05 directory
with its SentencePiece tokenizer) through RL on real LIBERO (GRPO, a few learner updates, a
checkpoint) and ``rlvla3 eval`` on that checkpoint (deterministic acting: the seeded noise).
"""

from __future__ import annotations

import json

import pytest
from support.tiny_runs import LIBERO_SMOKE, last_json, run_rlvla3

pytestmark = LIBERO_SMOKE


def test_pi05_libero_preset_trains_and_evaluates_the_tiny_pi05(tmp_path):
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    run = tmp_path / "run"
    summary = last_json(run_rlvla3(["rl", "--preset", "pi05_libero", "--config",
                                    "tests/data/pi05_libero_cpu.yaml", "--run-dir", str(run),
                                    "--json"], timeout=600))
    assert summary["policy"] == "vla" and summary["algo"] == "grpo"
    assert summary["episodes"] >= 4 and summary["trained_decisions"] > 0
    assert summary["policy_version"] >= 2 and summary["restarts"] == 0
    meta = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                       / "meta.json").read_text())
    assert meta["policy"]["options"]["checkpoint"] == "tests/data/pi05_tiny"
    assert meta["spec"]["chunk_len"] == 10

    result = last_json(run_rlvla3(["eval", "--checkpoint", str(run), "--task-ids", "0",
                                   "--episodes-per-task", "2", "--max-steps", "40", "--workers",
                                   "1", "--videos", "0", "--output-dir", str(tmp_path / "eval"),
                                   "--json"], timeout=600))
    assert result["episodes"] == 2 and result["complete"] and result["faults"] == 0
    assert result["acting"] == "deterministic" and result["env_steps"] == 80
