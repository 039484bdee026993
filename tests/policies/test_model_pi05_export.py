"""``rlvla3 export --format lerobot`` of a ``vla`` policy: the pi05 directory it writes, what it
leaves out, and the checkpoints it refuses (LeRobot acting on the export:
``tests/policies/test_model_export.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from commands.export import main as export_main
from measure.gpu.synthetic_obs import libero_like_spec
from measure.parity import vla as parity
from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
from rlvla3.config import Named
from rlvla3.policies import export
from rlvla3.policies.vla import build_vla_policy

FIXTURE = parity.fixture_path()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_export_writes_a_lerobot_pi05_directory_and_lists_what_it_leaves_out(tmp_path):
    ckpt = parity.round_trip_checkpoint(FIXTURE, tmp_path / "ck")
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "rlvla3", "export", "--checkpoint", str(ckpt),
                           "--format", "lerobot", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["left_out"] == ["value_head.0.bias", "value_head.0.weight",
                                   "value_head.2.bias", "value_head.2.weight"]
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "pi05" and config["num_inference_steps"] == 10
    assert list(config["input_features"]) == ["observation.images.image",
                                              "observation.images.image2", "observation.state"]
    assert config["chunk_size"] == 10 and config["max_action_dim"] == 32
    weights = load_file(str(out / "model.safetensors"))
    assert all(k.startswith("model.") for k in weights)
    assert "model.paligemma_with_expert.paligemma.lm_head.weight" in weights
    assert not any("value_head" in k or "embed_tokens" in k for k in weights)
    stats = load_file(str(out / export.NORMALIZER_FILE))
    source = load_file(str(FIXTURE / export.NORMALIZER_FILE))
    for key in ("observation.state.q01", "observation.state.q99", "action.q01", "action.q99"):
        torch.testing.assert_close(stats[key], source[key], rtol=0, atol=0)
    manifest = json.loads((out / "rlvla3_export.json").read_text())
    assert manifest["left_out"] == summary["left_out"] and manifest["version"] == 7
    # An existing, non-empty directory is kept unless --force.
    assert export_main(["--checkpoint", str(ckpt), "--format", "lerobot",
                        "--output-dir", str(out)]) == 2
    assert export_main(["--checkpoint", str(ckpt), "--format", "lerobot",
                        "--output-dir", str(out), "--force"]) == 0


def test_checkpoints_that_do_not_act_as_pi05_are_refused_with_every_reason(tmp_path, capsys):
    spec = libero_like_spec(image_size=32, chunk_len=4)
    options = {"preset": "tiny", "shapes": {"conv_stem": 3}}
    policy = build_vla_policy(spec, options)
    save_checkpoint(tmp_path / "tiny", policy, CheckpointMeta(Named("vla", options), spec, 3))
    assert export_main(["--checkpoint", str(tmp_path / "tiny"), "--format", "lerobot",
                        "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    for field in ("chain", "normalization", "tokenizer", "image_resize", "conv_stem"):
        assert field in err
    assert not (tmp_path / "o").exists()
    assert export_main(["--checkpoint", "s3://bucket/run", "--format", "lerobot",
                        "--output-dir", str(tmp_path / "o")]) == 2
    assert export_main(["--checkpoint", str(tmp_path / "absent"), "--format", "lerobot",
                        "--output-dir", str(tmp_path / "o")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_a_flow_noise_head_is_left_out_too(tmp_path):
    meta, t = parity.load_fixture(FIXTURE)
    base = parity.fixture_policy(FIXTURE, meta, t)
    options = {"preset": "pi05_tiny", "checkpoint": str(FIXTURE), "logprob": "flow_noise",
               "tokenizer": str(FIXTURE / "tokenizer.model"), "camera_keys": base.cfg.camera_keys}
    policy = build_vla_policy(base.spec, options)
    manifest = export.export_lerobot(policy, tmp_path / "e", {"source": "test", "version": 0})
    assert {"noise_head.weight", "noise_head.bias"} <= set(manifest["left_out"])
