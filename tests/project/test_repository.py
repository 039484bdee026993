"""The repository stays small enough to travel: a GPU check runs on a lent machine in a copy
of the working tree, and that copy may take at most 64 MiB (the device tool's limit), so the
tracked files together stay under it (large results keep their weights, not their optimizer
state: results/libero_spatial10/README.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 64 * 2**20


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_the_tracked_tree_fits_a_device_copy():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    sizes = {n.decode(): (ROOT / n.decode()).stat().st_size for n in names
             if n and (ROOT / n.decode()).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total < LIMIT, (f"the tracked files take {total / 2**20:.1f} MiB, more than the "
                           f"{LIMIT / 2**20:.0f} MiB a device copy may take; the largest: "
                           + ", ".join(f"{n} ({sizes[n] / 2**20:.1f} MiB)" for n in largest))
