"""GR00T-N1.7 against LeRobot 0.6.1 (the committed fixture, or ``RLVLA3_GROOT17_FIXTURE``): every
stage, its LeRobot directory in (the version read from the directory; mismatched or damaged
files refused naming what is wrong), the Qwen3-VL prompt, the tune flags, packed = padded, and
the RL log-probabilities of its chain."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from measure.parity import groot as parity15
from measure.parity import groot17 as parity
from rlvla3.config import ConfigError
from rlvla3.policies.groot import build_groot_policy
from rlvla3.policies.groot.config import PRESETS
from rlvla3.policies.groot.loader import CheckpointLayoutError, load_weights, read_checkpoint
from rlvla3.policies.groot.qwen_processor import QwenVLTokenizer, formalize

FIXTURE = parity.fixture_path()


@pytest.fixture(scope="module")
def fixture():
    return parity.load_fixture(FIXTURE)


def test_every_stage_matches_lerobot_061(fixture):
    stages = parity.compare(FIXTURE)
    names = [s.name for s in stages]
    for needed in ("tokens (ids, exact)", "pixel patches (48x64 -> 48, crop 42, 48)",
                   "vision tokens (after the merger)", "DeepStack features 1",
                   "backbone hidden at the selected layer", "VL features after self-attention",
                   "state encoding", "velocity, 4 steps (deterministic)",
                   "training loss (fixed flow times and noise)", "actions (deterministic, act)"):
        assert needed in names
    assert sum("DiT block" in n for n in names) == PRESETS["groot17_tiny"].dit_layers
    assert any("cross-attention to images" in n for n in names)
    bad = [(s.name, s.max_abs_diff, s.scale) for s in stages if not s.error <= parity.TOLERANCE]
    assert not bad, bad


def test_the_version_is_read_from_the_directory(fixture):
    meta, t = fixture
    ckpt = read_checkpoint(FIXTURE / "lerobot")
    assert (ckpt.version, ckpt.layout, ckpt.embodiment_id) == ("n1.7", "lerobot", 10)
    assert read_checkpoint(parity15.fixture_path() / "lerobot").version == "n1.5"
    spec = parity.fixture_spec(meta, t)
    with pytest.raises(ConfigError, match=r"policy.options.preset.*'groot_tiny' is GR00T-N1.5 "
                                          r"but .* is GR00T-N1.7; use 'groot17_tiny'"):
        build_groot_policy(spec, {**parity.fixture_options(FIXTURE, meta), "preset": "groot_tiny"})
    with pytest.raises(ConfigError, match="is GR00T-N1.7 but .* is GR00T-N1.5"):
        build_groot_policy(spec, {**parity.fixture_options(FIXTURE, meta),
                                  "checkpoint": str(parity15.fixture_path() / "lerobot")})


def test_marks_of_both_versions_are_refused(tmp_path):
    d = tmp_path / "mixed"
    shutil.copytree(FIXTURE / "lerobot", d)
    pre = json.loads((d / "policy_preprocessor.json").read_text())
    for step in pre["steps"]:
        if step["registry_name"] == "groot_n1_7_pack_inputs_v1":
            step["registry_name"] = "groot_pack_inputs_v3"
    (d / "policy_preprocessor.json").write_text(json.dumps(pre))
    with pytest.raises(ValueError, match=r"mixes GR00T versions: N1\.7 \(.*Qwen3-VL backbone "
                                         r"weights.*\) and N1\.5 \(processor steps"):
        read_checkpoint(d)


def test_a_damaged_file_is_refused_naming_the_key(fixture, tmp_path):
    meta, t = fixture
    policy = parity.fixture_policy(FIXTURE, meta, t)
    state = load_file(str(FIXTURE / "lerobot" / "model.safetensors"))
    gone = "_groot_model.backbone.model.model.visual.deepstack_merger_list.1.norm.weight"
    bent = "_groot_model.action_head.action_encoder.W2.W"
    del state[gone]
    state[bent] = state[bent][:, :10].contiguous()
    save_file(state, str(tmp_path / "bad.safetensors"))
    before = policy.net.state_dict()["action_head.position_embedding.weight"].clone()
    with pytest.raises(CheckpointLayoutError) as err:
        load_weights(policy.net, tmp_path / "bad.safetensors")
    assert f"missing keys (1): {gone.removeprefix('_groot_model.')}" in str(err.value)
    assert "action_head.action_encoder.W2.W: checkpoint (32, 10, 16) vs model (32, 32, 16)" \
        in str(err.value)
    assert torch.equal(before, policy.net.state_dict()["action_head.position_embedding.weight"])


def test_the_prompt_and_its_tokens(fixture):
    meta, _ = fixture
    tok = QwenVLTokenizer(FIXTURE / "backbone", tokens_per_image=9)
    assert formalize("Don't DROP it, please!") == "dont drop it please"
    text = tok.prompt(meta["instructions"][1], 2)
    assert text == meta["prompts"][1]
    pad = "<|image_pad|>" * 9
    assert text == (f"<|im_start|>user\n<|vision_start|>{pad}<|vision_end|><|vision_start|>{pad}"
                    "<|vision_end|>dont drop the robots cup<|im_end|>\n")
    ids = tok.encode(meta["instructions"][1], 2)
    assert ids.count(tok.image_token_id) == 18  # special tokens stay whole
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tune_flags_freeze_what_lerobot_freezes(fixture):
    meta, t = fixture
    spec = parity.fixture_spec(meta, t)
    opts = parity.fixture_options(FIXTURE, meta)
    default = build_groot_policy(spec, opts).net  # LeRobot 0.6.1: LLM and vision frozen
    trains = {n for n, p in default.named_parameters() if p.requires_grad}
    assert not any(n.startswith("backbone.") for n in trains)
    assert "action_head.vlln.weight" in trains and "action_head.model.proj_out_2.weight" in trains
    frozen = build_groot_policy(spec, {**opts, "tune_projector": False, "tune_vlln": False,
                                       "tune_diffusion_model": False}).net
    assert {n for n, p in frozen.named_parameters() if p.requires_grad} == {
        n for n, _ in frozen.named_parameters() if n.startswith("value_head.")}
    full = build_groot_policy(spec, {**opts, "tune_llm": True, "tune_visual": True}).net
    assert all(p.requires_grad for p in full.parameters())


def test_rl_log_probs_of_the_chain_are_recomputed_by_evaluate(fixture):
    meta, t = fixture
    policy = parity.fixture_policy(FIXTURE, meta, t)
    obs = parity.fixture_obs(meta, t)
    out = policy.act(obs)
    assert out.latents.shape == (3, 5, 16, 12) and out.actions.shape == (3, 16, 7)
    ev = policy.evaluate(obs, torch.from_numpy(out.actions), torch.from_numpy(out.latents))
    np.testing.assert_allclose(ev.log_prob.detach().numpy(), out.log_prob, rtol=1e-4, atol=1e-2)
    np.testing.assert_allclose(ev.value.detach().numpy(), out.value, atol=1e-5)
    ev.log_prob.sum().backward()  # the chain's log-probability reaches the DiT's weights
    assert policy.net.action_head.model.proj_out_2.weight.grad.abs().sum() > 0


def test_packed_batch_equals_padded_batch(fixture):
    meta, t = fixture
    spec = parity.fixture_spec(meta, t)
    opts = parity.fixture_options(FIXTURE, meta)
    packed = build_groot_policy(spec, opts)
    padded = build_groot_policy(spec, {**opts, "padded": True})
    obs = parity.fixture_obs(meta, t)
    assert len(set(packed.processor.token_counts(obs))) > 1  # prompts of different lengths
    np.testing.assert_allclose(packed.act(obs, True).actions, padded.act(obs, True).actions,
                               atol=1e-5)


def test_sft_loss_trains_with_state_dropout(fixture):
    meta, t = fixture
    policy = build_groot_policy(parity.fixture_spec(meta, t),
                                {**parity.fixture_options(FIXTURE, meta), "dropout": True})
    obs = parity.fixture_obs(meta, t)
    torch.manual_seed(0)
    loss = policy.sft_loss(obs, t["actions_env"][:, :10], torch.ones(3, 10))
    loss.backward()
    assert torch.isfinite(loss) and policy.net.action_head.state_encoder.layer1.W.grad is not None
    assert policy.net.state_dropout == 0.0 and policy.net.dropout == 0.0  # training only


def test_full_size_network_matches_lerobots_own_build_key_for_key():
    """LeRobot 0.6.1's ``GR00TN17`` built on the meta device from N1.7's defaults and the
    Cosmos-Reason2-2B config it hard-codes (``tests/data/groot17_full_size.py``): the preset
    has those sizes, our network has its keys and shapes (its LM head, tied to the embedding,
    is not built) and the same parameter count."""
    from pathlib import Path

    from rlvla3.policies.groot.config import shapes_from_n17_configs
    from rlvla3.policies.groot.network import GrootNetwork
    from rlvla3.policies.groot.policy import parameter_count

    ref = json.loads((Path(__file__).resolve().parents[1] / "data" / "groot_n17_keys.json")
                     .read_text())
    shapes = shapes_from_n17_configs(PRESETS["groot_n17"], ref["groot_config"],
                                     ref["qwen3_vl_config"])
    assert shapes == PRESETS["groot_n17"]
    with torch.device("meta"):
        net = GrootNetwork(shapes)
    ours = {k: list(v.shape) for k, v in net.state_dict().items()
            if not k.startswith("value_head.")}
    assert {**ours, "backbone.model.lm_head.weight": ref["keys"]["backbone.model.lm_head.weight"]
            } == ref["keys"]
    assert parameter_count(shapes) == ref["parameters"] == 3_144_016_000


def test_export_writes_a_lerobot_061_groot_directory(tmp_path):
    """The export's files as LeRobot 0.6.1 writes them (LeRobot acting on it:
    ``tests/policies/test_model_export.py``)."""
    from rlvla3.policies.groot.export17 import PACK_FILE, UNPACK_FILE

    ckpt, out = parity.export_round_trip(FIXTURE, tmp_path)
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(FIXTURE / "lerobot" / "model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "groot" and config["embodiment_tag"] == "new_embodiment"
    assert (config["chunk_size"], config["max_state_dim"], config["max_action_dim"]) == (16, 16, 12)
    assert not config["use_bf16"] and config["base_model_path"] == str((out / "base").resolve())
    base = json.loads((out / "base" / "config.json").read_text())
    assert base["model_type"] == "Gr00tN1d7" and base["model_name"] == str(
        (out / "backbone").resolve())
    pre = json.loads((out / "policy_preprocessor.json").read_text())
    assert [s["registry_name"] for s in pre["steps"]][2:4] == ["groot_n1_7_pack_inputs_v1",
                                                               "groot_n1_7_vlm_encode_v1"]
    source = load_file(str(FIXTURE / "lerobot" / PACK_FILE))
    for name in (PACK_FILE, UNPACK_FILE):
        stats = load_file(str(out / name))
        for key in ("observation.state.min", "observation.state.max", "action.min",
                    "action.max"):
            torch.testing.assert_close(stats[key], source[key], rtol=0, atol=0)
    back = read_checkpoint(out)
    assert (back.version, back.embodiment_id, back.backbone_config["model_type"]) == \
        ("n1.7", 10, "qwen3_vl")


def test_a_policy_lerobot_061_cannot_rebuild_is_refused_with_every_reason(fixture, tmp_path):
    from rlvla3.policies.export import ExportError
    from rlvla3.policies.groot.export17 import export_lerobot17

    meta, t = fixture
    policy = build_groot_policy(parity.fixture_spec(meta, t), {
        "preset": "groot17_tiny", "tokenizer": str(FIXTURE / "backbone"), "embodiment_id": 5,
        "denoise_steps": 2})
    with pytest.raises(ExportError) as err:
        export_lerobot17(policy, tmp_path / "out", {})
    text = str(err.value)
    assert "embodiment_id 5 has no LeRobot 0.6.1 N1.7 embodiment tag" in text
    assert "names no base model" in text and "denoise_steps 2 differs" in text
    assert not (tmp_path / "out").exists()
