"""Every checkpoint committed under ``results/`` re-runs from the repository as committed: its
``meta.json`` lists only files that are there (the repository keeps weights, not optimizer
state: tests/project/test_repository.py), and it passes the checks and loads through the
paths ``eval --checkpoint``, ``export`` and ``init_from`` take, with no simulator and no Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actors.eval.evaluate import check_checkpoint
from rlvla3.algos.config import AlgoConfig
from rlvla3.checkpoint.files import check_init_from, check_resume, load_policy, row_source
from rlvla3.checkpoint.trust import locate_checkpoint
from rlvla3.learner.core import rl_engine
from rlvla3.policies import build_policy

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted(p.parents[1].relative_to(ROOT) for p in ROOT.glob("results/**/checkpoints/latest"))


def test_results_hold_committed_checkpoints():
    assert {"results/metaworld_mt10/mw_sft", "results/metaworld_mt10/mw_rl_equal",
            "results/isaaclab/reach_rl4"} <= {str(r) for r in RUNS}


@pytest.mark.parametrize("meta_file", sorted(ROOT.glob("results/**/meta.json")),
                         ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_a_committed_checkpoint_lists_only_files_that_are_there(meta_file):
    listed = json.loads(meta_file.read_text()).get("files") or {}
    absent = [name for name in listed if not (meta_file.parent / name).is_file()]
    assert not absent, f"{meta_file} lists {absent}, which are not in the repository"


@pytest.mark.parametrize("run", RUNS, ids=str)
def test_a_committed_checkpoint_loads_for_eval_export_and_init_from(run, one_torch_thread):
    run = str(ROOT / run)
    check_checkpoint(locate_checkpoint(run))  # eval's check before Ray starts
    policy, meta = load_policy(run)  # an eval worker's load, and export's
    assert check_init_from(run, meta.policy, meta.spec, build_policy(meta.policy, meta.spec))
    learner = build_policy(meta.policy, meta.spec)  # a learner rank's init_from
    rl_engine(learner, AlgoConfig("grpo"), 1e-4).restore(row_source(run, optimizer=False),
                                                          optimizer=False)
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(learner.state_dict()[key], value)
    check_resume(run)  # what it lists is there: a resumed run starts a fresh optimizer
