"""A learner group trains exactly the global batch: with a rank count that does not divide it
(a group rebuilt after a lost rank: 64 over 3), the ranks share each step's samples out
unevenly (22, 21, 21) and scale their gradients by their share, so three DDP ranks over gloo
end with the parameters one rank reaches on the same batches. Each rank is its own process
(``tests/learner_ranks.py``); no Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlvla3.learner import rank_batches

SCRIPT = Path(__file__).resolve().parent / "learner_ranks.py"


def _group(tmp: Path, world: int, global_batch: int = 64, steps: int = 2) -> Path:
    out = tmp / f"world{world}"
    init = tmp / f"rendezvous{world}"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--world", str(world), "--rank",
                               str(r), "--init", str(init), "--out", str(out),
                               "--global-batch", str(global_batch), "--steps", str(steps)])
             for r in range(world)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0
    return out


def test_the_global_batch_is_shared_out_exactly():
    assert rank_batches(64, 3) == [22, 21, 21]
    assert rank_batches(64, 4) == [16] * 4
    assert all(sum(rank_batches(g, w)) == g for g in (7, 64, 840) for w in range(1, 8))


def test_three_ranks_train_the_whole_global_batch_as_one_rank_does(tmp_path):
    one = _group(tmp_path, 1)
    three = _group(tmp_path, 3)
    trained = [json.loads((three / f"rank{r}.json").read_text()) for r in range(3)]
    assert sum(t["samples_trained"] for t in trained) == 2 * 64  # not 2 x 63
    assert {t["version"] for t in trained} == {2}
    a, b = load_file(str(one / "params.safetensors")), load_file(str(three / "params.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=key)
