"""The Isaac Lab reach's scripted expert as a demonstrator: ``datalake record --suite
isaaclab_reach`` writes a pixel dataset that never holds the target, refuses the test layouts
unless told, and an SFT run on test-layout demonstrations is named by the evaluation's overlap
check."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from envs.isaaclab import setup
from envs.isaaclab.env import training_overlap
from envs.isaaclab.expert import reach_action
from envs.libero.scenes import RECORD_SIDECAR


def test_the_expert_moves_at_most_one_step_straight_at_the_target():
    tcp = np.array([0.5, 0.0, 0.2])
    far = reach_action(np.array([0.8, -0.015, 0.2]), tcp)
    assert np.allclose(far, [1.0, -0.5, 0.0])  # clipped to one step, the rest in proportion
    near = reach_action(np.array([0.51, 0.0, 0.17]), tcp)
    assert np.allclose(near, [1 / 3, 0.0, -1.0]) and near.dtype == np.float32


def test_recording_on_the_test_layouts_is_refused_before_anything_starts(tmp_path, capsys):
    from commands.datalake import main as datalake_main

    out = tmp_path / "demos"
    code = datalake_main(["record", "--suite", "isaaclab_reach", "--placements", "bundled",
                          "--episodes", "2", "--output-dir", str(out)])
    assert code == 2 and not out.exists()
    assert "allow_eval_overlap" in capsys.readouterr().err
    code = datalake_main(["record", "--suite", "isaaclab_reach", "--task-ids", "3",
                          "--output-dir", str(out)])
    assert code == 2 and not out.exists()
    assert "isaaclab_reach has tasks 0..2, got 3" in capsys.readouterr().err


def test_an_sft_run_on_test_layout_demonstrations_is_named_by_the_overlap_check(tmp_path):
    data = tmp_path / "demos"
    (data / RECORD_SIDECAR).parent.mkdir(parents=True)
    (data / RECORD_SIDECAR).write_text(json.dumps({"split": {"eval_overlap": True}}))
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text(yaml.safe_dump({
        "env": {"name": "isaaclab", "options": {"task": "reach"}},
        "lake": {"datasets": [str(data)]}}))
    rl = tmp_path / "rl"
    rl.mkdir()
    (rl / "config.yaml").write_text(yaml.safe_dump({
        "env": {"name": "isaaclab", "options": {"task": "reach"}}, "init_from": str(sft)}))
    [reason] = training_overlap(str(rl / "checkpoints" / "step-00000001"))
    assert "demos was recorded on the test split" in reason
    (data / RECORD_SIDECAR).write_text(json.dumps({"split": {"eval_overlap": False}}))
    assert training_overlap(str(rl)) == []


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(setup.located() is None, reason="the Isaac Lab environment is not built "
                    "here (python -m rlvla3 envs setup isaaclab)")
def test_the_expert_records_a_pixel_dataset_that_never_holds_the_target(ray_cluster, tmp_path,
                                                                        capsys):
    """Two colours, two training layouts, a clean and a noisy take each: every episode
    succeeds, the dataset holds both cameras and the 10-number proprioceptive state (not the
    target's 13), and a clean take's first label is a full step towards the named cube."""
    from commands.datalake import main as datalake_main

    out = tmp_path / "demos"
    code = datalake_main(["record", "--suite", "isaaclab_reach", "--task-ids", "0", "2",
                          "--episodes", "2", "--takes", "2", "--workers", "1",
                          "--image-size", "32", "--output-dir", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["recorded"] == 8 and report["failed"] == []
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"]["observation.state"]["shape"] == [10]
    assert info["features"]["observation.images.front"]["shape"] == [32, 32, 3]
    assert info["features"]["observation.images.wrist"]["shape"] == [32, 32, 3]
    record = json.loads((out / RECORD_SIDECAR).read_text())
    assert record["provenance"]["suite"] == "isaaclab_reach"
    assert record["split"] == {"split": "train", "eval_overlap": False}
    rows = pq.read_table(next((out / "data").rglob("*.parquet"))).to_pydict()
    actions = np.array(rows["action"])
    firsts = [i for i, f in enumerate(rows["frame_index"]) if f == 0]
    assert len(firsts) == 8 and len(actions) > 8
    for i in firsts:  # the hand starts several steps from any cube: a full step first
        assert np.isclose(np.abs(actions[i]).max(), 1.0)
