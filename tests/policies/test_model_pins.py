"""Committed checkpoints act as they did: ``act``/``evaluate`` outputs of the VLA checkpoints
under ``results/`` on fixed observations, against the values pinned by
``tests/data/make_checkpoint_pins.py`` (written before the model gained its pi0.5-reference
options, whose defaults must leave these checkpoints unchanged)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
import make_checkpoint_pins as pins  # noqa: E402


@pytest.mark.parametrize("run", pins.PINNED)
def test_committed_checkpoint_acts_as_pinned(run):
    if not (pins.ROOT / run).is_dir():
        pytest.skip(f"{run} is not in this checkout")
    before = torch.get_num_threads()
    try:
        now = pins.acting(run)
    finally:
        torch.set_num_threads(before)
    expected = {k: v for k, v in load_file(str(DATA / "checkpoint_pins.safetensors")).items()
                if k.startswith(run + ".")}
    assert expected and set(now) == set(expected)
    for key, value in expected.items():
        # Bit for bit on the machine that wrote the pins; other CPUs' kernels round the last
        # bits differently, and a sampled chain carries that through its steps (3.4e-6 on
        # actions of about 1 on an AMD EPYC): a tolerance of a few float32 roundings of a
        # 5-step chain. A changed default moves these outputs by orders of magnitude more.
        torch.testing.assert_close(now[key], value, rtol=1e-5, atol=1e-5, msg=key)
