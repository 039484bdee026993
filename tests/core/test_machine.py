"""This machine's CPU count, from one place (``rlvla3.machine``): the cores this process may
run on (its affinity, capped by a cgroup quota), not the host's ``os.cpu_count()``, and what
the learners' check before a local run names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlvla3 import machine

REPO = Path(__file__).resolve().parents[2]


def test_a_quota_caps_the_cores_and_none_leaves_them(tmp_path, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(machine, "CPU_MAX", cpu_max)
    cpu_max.write_text("50000 100000\n")  # half a core: one, rounded up
    assert machine.usable_cpus() == 1
    cpu_max.write_text("max 100000\n")
    assert machine.usable_cpus() == cores
    cpu_max.unlink()  # no cgroup v2 file
    assert machine.usable_cpus() == cores
    assert machine.local_ray_cpus(cores + 3.5) == cores + 4  # the roles' ask, when more


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to one")
def test_a_run_pinned_to_one_core_counts_one_core(tmp_path):
    """``taskset``-like affinity of one core on a machine of more: the count is 1, and a run
    of two learners (one core each) is refused naming that 1, before Ray starts (the host's
    count let it start)."""
    def pinned(code: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *code], cwd=REPO, capture_output=True,
                              text=True, timeout=300,
                              preexec_fn=lambda: os.sched_setaffinity(0, {0}))

    count = pinned(["-c", "from rlvla3.machine import usable_cpus; print(usable_cpus())"])
    assert count.stdout.strip() == "1", count.stderr
    run = pinned(["-m", "rlvla3", "rl", "--preset", "smoke", "--set", "learner.num_learners=2",
                  "--run-dir", str(tmp_path / "run")])
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip() == (
        "rlvla3 rl: invalid config: config field 'learner.num_learners': 2 learners x 1 CPUs "
        "need 2 CPUs but only 1 are available")
