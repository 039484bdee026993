"""Loading pi0.5 checkpoints in the openpi / LeRobot safetensors layout (synthetic files)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from measure.gpu.synthetic_obs import libero_like_spec
from rlvla3.policies.vla import build_vla_policy
from rlvla3.policies.vla.loader import (
    CheckpointLayoutError,
    load_openpi_checkpoint,
    save_openpi_checkpoint,
    to_openpi_state_dict,
)

SPEC = libero_like_spec(image_size=32, chunk_len=6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pair():
    return (build_vla_policy(SPEC, {"preset": "tiny", "seed": 1}),
            build_vla_policy(SPEC, {"preset": "tiny", "seed": 2}))


def test_synthetic_checkpoint_round_trips(tmp_path):
    src, dst = _pair()
    path = save_openpi_checkpoint(src.net, tmp_path / "model.safetensors")
    keys = set(load_file(str(path)))
    assert "paligemma_with_expert.paligemma.model.language_model.layers.1.mlp.gate_proj.weight" in keys
    assert "paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.weight" in keys
    assert ("paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings."
            "patch_embedding.weight") in keys
    assert {"action_in_proj.weight", "time_mlp_out.bias"} <= keys
    fresh = load_openpi_checkpoint(dst.net, tmp_path)  # a directory holding model.safetensors
    assert fresh and all(name.startswith("value_head.") for name in fresh)
    for name, tensor in src.net.state_dict().items():
        if name in fresh:  # the RL heads keep their own initialisation
            if tensor.dim() == 2:
                assert not torch.equal(dst.net.state_dict()[name], tensor)
        else:
            torch.testing.assert_close(dst.net.state_dict()[name], tensor, msg=name)


def test_lerobot_model_prefix_and_unused_heads_are_accepted(tmp_path):
    src, dst = _pair()
    state = {"model." + k: v for k, v in to_openpi_state_dict(src.net).items()}
    state["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(3, 3)
    state["model.paligemma_with_expert.gemma_expert.model.norm.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "ck.safetensors"))
    load_openpi_checkpoint(dst.net, tmp_path / "ck.safetensors")
    torch.testing.assert_close(dst.net.action_out_proj.weight, src.net.action_out_proj.weight)


def test_missing_extra_and_misshapen_keys_are_named(tmp_path):
    src, dst = _pair()
    state = to_openpi_state_dict(src.net)
    gone = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    del state[gone]
    state["paligemma_with_expert.paligemma.model.language_model.layers.9.mlp.up_proj.weight"] = (
        torch.zeros(2, 2))
    state["time_mlp_in.weight"] = torch.zeros(5, 5)
    save_file(state, str(tmp_path / "bad.safetensors"))
    before = dst.net.time_mlp_in.weight.clone()
    with pytest.raises(CheckpointLayoutError) as err:
        load_openpi_checkpoint(dst.net, tmp_path / "bad.safetensors")
    text = str(err.value)
    assert "missing keys (1)" in text and gone in text
    assert "unexpected keys (1)" in text and "layers.9.mlp.up_proj" in text
    assert "time_mlp_in.weight: checkpoint (5, 5)" in text
    torch.testing.assert_close(dst.net.time_mlp_in.weight, before)  # nothing half-loaded


def test_policy_option_loads_a_local_checkpoint(tmp_path):
    src, _ = _pair()
    save_openpi_checkpoint(src.net, tmp_path / "pi05.safetensors")
    built = build_vla_policy(SPEC, {"preset": "tiny", "seed": 9,
                                    "checkpoint": str(tmp_path / "pi05.safetensors")})
    torch.testing.assert_close(built.net.embed_tokens.weight, src.net.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        build_vla_policy(SPEC, {"checkpoint": str(tmp_path / "absent.safetensors")})


def test_pi05_preset_has_the_openpi_keys_and_shapes():
    """Built on the meta device (no memory): the pi05 shapes a real checkpoint must match."""
    from rlvla3.policies.vla.config import PRESETS
    from rlvla3.policies.vla.network import VLANetwork

    with torch.device("meta"):
        net = VLANetwork(PRESETS["pi05"], action_dim=7, chunk_len=50, flow_noise=False)
    shapes = {k: tuple(v.shape) for k, v in to_openpi_state_dict(net).items()}
    pali, expert = "paligemma_with_expert.paligemma.model.", "paligemma_with_expert.gemma_expert.model."
    vision = pali + "vision_tower.vision_model."
    expected = {
        vision + "embeddings.patch_embedding.weight": (1152, 3, 14, 14),
        vision + "embeddings.position_embedding.weight": (256, 1152),
        vision + "encoder.layers.26.mlp.fc1.weight": (4304, 1152),
        pali + "multi_modal_projector.linear.weight": (2048, 1152),
        pali + "language_model.embed_tokens.weight": (257152, 2048),
        pali + "language_model.layers.17.self_attn.q_proj.weight": (2048, 2048),
        pali + "language_model.layers.17.self_attn.k_proj.weight": (256, 2048),
        pali + "language_model.layers.0.mlp.gate_proj.weight": (16384, 2048),
        expert + "layers.17.self_attn.q_proj.weight": (2048, 1024),
        expert + "layers.0.self_attn.o_proj.weight": (1024, 2048),
        expert + "layers.0.mlp.up_proj.weight": (4096, 1024),
        expert + "layers.0.input_layernorm.dense.weight": (3072, 1024),
        expert + "norm.dense.weight": (3072, 1024),
        "action_in_proj.weight": (1024, 32),
        "action_out_proj.weight": (32, 1024),
        "time_mlp_in.weight": (1024, 1024),
    }
    for key, shape in expected.items():
        assert shapes[key] == shape, key
    assert not any(".layers.27." in k for k in shapes) and len(shapes) > 400
