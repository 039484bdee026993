"""``rlvla3 export --format lerobot`` of a ``groot`` policy: the LeRobot groot directory it
writes (LeRobot's own key set and shapes, statistics, Eagle assets) and the policies it refuses
(LeRobot acting on the export: ``tests/policies/test_model_export.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support.tiny_runs import run_rlvla3

from commands.export import main as export_main
from measure.parity import groot as parity
from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
from rlvla3.config import Named
from rlvla3.policies.groot import build_groot_policy
from rlvla3.policies.groot.export import PACK_FILE, UNPACK_FILE

FIXTURE = parity.fixture_path()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_export_writes_a_lerobot_groot_directory(tmp_path):
    out = tmp_path / "export"
    summary = json.loads(run_rlvla3(["export", "--checkpoint", str(parity.round_trip_checkpoint(
        FIXTURE, tmp_path / "ck")), "--format", "lerobot", "--output-dir", str(out)], 120))
    assert summary["left_out"] == ["value_head.0.bias", "value_head.0.weight",
                                   "value_head.2.bias", "value_head.2.weight"]
    # LeRobot's own directory (the fixture's) has exactly these keys and shapes.
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(FIXTURE / "lerobot" / "model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    lm = "_groot_model.backbone.eagle_model.language_model."
    assert torch.equal(ours[lm + "lm_head.weight"], ours[lm + "model.embed_tokens.weight"])
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "groot" and config["embodiment_tag"] == "new_embodiment"
    assert list(config["input_features"]) == ["observation.images.image",
                                              "observation.images.wrist_image",
                                              "observation.state"]
    assert config["chunk_size"] == 16 and config["image_size"] == [56, 56]
    assert not config["use_bf16"] and config["base_model_path"]
    source = load_file(str(FIXTURE / "lerobot" / PACK_FILE))
    for name in (PACK_FILE, UNPACK_FILE):
        stats = load_file(str(out / name))
        for key in ("observation.state.min", "observation.state.max", "action.min",
                    "action.max"):
            torch.testing.assert_close(stats[key], source[key], rtol=0, atol=0)
    assert (out / "eagle" / "vocab.json").read_bytes() == \
        (FIXTURE / "eagle" / "vocab.json").read_bytes()
    manifest = json.loads((out / "rlvla3_export.json").read_text())
    assert manifest["version"] == 7 and "eagle" in manifest["files"]


def test_a_policy_lerobot_cannot_rebuild_is_refused_with_every_reason(tmp_path, capsys):
    meta, t = parity.load_fixture(FIXTURE)
    spec = parity.fixture_spec(meta, t)
    options = {"preset": "groot_tiny", "tokenizer": str(FIXTURE / "eagle"), "embodiment_id": 5,
               "denoise_steps": 2}
    policy = build_groot_policy(spec, options)
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("groot", options), spec, 1))
    assert export_main(["--checkpoint", str(tmp_path / "ck"), "--format", "lerobot",
                        "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    for field in ("embodiment_id 5", "policy.options.checkpoint", "denoise_steps 2"):
        assert field in err
    assert not (tmp_path / "o").exists()
