"""GR00T-N1.5 against LeRobot 0.5.1 (the committed fixture, or ``RLVLA3_GROOT_FIXTURE``), its
checkpoints in (a LeRobot directory, an Isaac-GR00T file; damaged files refused), the Eagle
prompt on a tokenizer the test builds, the tune flags, and the RL log-probabilities."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from measure.parity import groot as parity
from rlvla3.config import ConfigError
from rlvla3.policies.groot import build_groot_policy
from rlvla3.policies.groot.config import PRESETS, shapes_from_configs
from rlvla3.policies.groot.export import SIGLIP_HEAD, unused_weights
from rlvla3.policies.groot.loader import CheckpointLayoutError, load_weights
from rlvla3.policies.groot.network import GrootNetwork
from rlvla3.policies.groot.policy import parameter_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))

FIXTURE = parity.fixture_path()


@pytest.fixture(scope="module")
def fixture():
    meta, t = parity.load_fixture(FIXTURE)
    return meta, t


def test_every_stage_matches_lerobot(fixture):
    stages = parity.compare(FIXTURE)
    names = [s.name for s in stages]
    for needed in ("tokens (ids, exact)", "vision tokens (after the connector)",
                   "LLM hidden at the selected layer", "VL features after self-attention",
                   "state encoding", "training loss (fixed tau and noise)",
                   "actions (deterministic, act)"):
        assert needed in names
    assert sum("DiT block" in n for n in names) == PRESETS["groot_tiny"].dit_layers
    bad = [(s.name, s.max_abs_diff, s.scale) for s in stages if not s.error <= parity.TOLERANCE]
    assert not bad, bad


def test_isaac_layout_file_loads_the_same_weights(fixture, tmp_path):
    meta, t = fixture
    isaac = parity.fixture_policy(FIXTURE, meta, t, FIXTURE / "isaac" / "model.safetensors")
    file = load_file(str(FIXTURE / "isaac" / "model.safetensors"))
    own = isaac.net.state_dict()
    loaded = [k for k in own if not k.startswith("value_head.")]
    assert all(torch.equal(own[k], file[k]) for k in loaded)
    assert set(file) - set(loaded) == {  # SigLIP's pooling head: GR00T never uses it
        k for k in file if k.startswith("backbone.eagle_model.vision_model.vision_model.head.")}
    # any float dtype loads: a bfloat16 copy lands rounded to bfloat16
    state = {k: v.to(torch.bfloat16) for k, v in
             load_file(str(FIXTURE / "isaac" / "model.safetensors")).items()}
    save_file(state, str(tmp_path / "bf16.safetensors"))
    load_weights(isaac.net, tmp_path / "bf16.safetensors")
    w = "action_head.model.proj_out_2.weight"
    assert torch.equal(isaac.net.state_dict()[w], state[w].float())


def test_a_damaged_file_is_refused_naming_the_key(fixture, tmp_path):
    meta, t = fixture
    policy = parity.fixture_policy(FIXTURE, meta, t)
    state = load_file(str(FIXTURE / "isaac" / "model.safetensors"))
    gone = "action_head.model.transformer_blocks.1.attn1.to_q.weight"
    bent = "action_head.state_encoder.layer1.W"
    del state[gone]
    state[bent] = state[bent][:, :10].contiguous()
    save_file(state, str(tmp_path / "bad.safetensors"))
    before = policy.net.state_dict()["action_head.future_tokens.weight"].clone()
    with pytest.raises(CheckpointLayoutError) as err:
        load_weights(policy.net, tmp_path / "bad.safetensors")
    assert f"missing keys (1): {gone}" in str(err.value)
    assert f"{bent}: checkpoint (32, 10, 16) vs model (32, 64, 16)" in str(err.value)
    assert torch.equal(before, policy.net.state_dict()["action_head.future_tokens.weight"])


def test_the_prompt_on_a_tokenizer_built_here(tmp_path):
    import groot_reference as ref

    from rlvla3.policies.groot.processor import EagleTokenizer

    ref.write_eagle_assets(tmp_path)
    tok = EagleTokenizer(tmp_path)
    text = tok.prompt("don't drop it", 2)
    ctx = "<IMG_CONTEXT>" * 4
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    f"<|im_start|>user\n<image 1><img>{ctx}</img><image 2><img>{ctx}</img>"
                    "[\"don't drop it\"]<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("don't drop it", 2)
    assert ids.count(tok.image_token_id) == 8  # special tokens stay whole
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tok.tile == 56 and tok.tokens_per_tile == 4


def test_tune_flags_freeze_what_lerobot_freezes(fixture):
    meta, t = fixture
    spec = parity.fixture_spec(meta, t)
    opts = parity.fixture_options(FIXTURE, meta)
    frozen = build_groot_policy(spec, {**opts, "tune_projector": False,
                                       "tune_diffusion_model": False, "tune_llm": False,
                                       "tune_visual": False}).net
    trains = {n for n, p in frozen.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("backbone.eagle_model.", "action_head.model.",
                                 "action_head.state_encoder.", "action_head.action_encoder.",
                                 "action_head.action_decoder.", "action_head.position_embedding"))
                   for n in trains)
    assert "action_head.vlln.weight" in trains and "action_head.future_tokens.weight" in trains
    full = build_groot_policy(spec, {**opts, "tune_llm": True, "tune_visual": True}).net
    assert all(p.requires_grad for p in full.parameters())


def test_rl_log_probs_of_the_chain_are_recomputed_by_evaluate(fixture):
    meta, t = fixture
    policy = parity.fixture_policy(FIXTURE, meta, t)
    obs = parity.fixture_obs(meta, t)
    out = policy.act(obs)
    assert out.latents.shape == (3, 5, 16, 32) and out.actions.shape == (3, 16, 7)
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


def test_full_size_network_matches_lerobots_own_build_key_for_key():
    """LeRobot 0.5.1's ``GR00TN15`` built on the meta device from N1.5's two config files
    (``tests/data/groot_full_size.py``): our network from the same files has its keys and
    shapes (with the two parts GR00T never runs, which the export fills), the preset has the
    files' sizes, and the parameter counts differ by exactly SigLIP's pooling head (the LM
    head is tied to the embedding there)."""
    ref = json.loads((Path(__file__).resolve().parents[1] / "data" / "groot_n15_keys.json").read_text())
    shapes = shapes_from_configs(PRESETS["groot_n15"], ref["groot_config"], ref["eagle_config"])
    assert shapes == PRESETS["groot_n15"]
    with torch.device("meta"):
        net = GrootNetwork(shapes)
    ours = {k: list(v.shape) for k, v in net.state_dict().items()
            if not k.startswith("value_head.")}
    unused = {k: list(v) for k, v in unused_weights(shapes).items()}
    assert {**ours, **unused} == ref["keys"]
    head = sum(math.prod(v) for k, v in unused.items() if k.startswith(SIGLIP_HEAD))
    assert parameter_count(shapes) + head == ref["parameters"]


def test_missing_tokenizer_is_a_config_error(fixture):
    meta, t = fixture
    with pytest.raises(ConfigError, match="policy.options.tokenizer"):
        build_groot_policy(parity.fixture_spec(meta, t), {"preset": "groot_tiny"})
    assert json.loads((FIXTURE / "parity.json").read_text())["steps"] == 4


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_ppo_and_grpo_steps_on_groot_lower_their_objective(algo, one_torch_thread):
    """The RL pipeline's own pieces (``RolloutCore`` acting in a real env, ``LearnerCore``'s
    PPO / GRPO objective with the value head) on the tiny GR00T: two optimizer steps on the
    episodes it acted lower the objective on them."""
    from envs import env_spec, make_env
    from rlvla3.algos.config import AlgoConfig
    from rlvla3.config import Named
    from rlvla3.episode.tasks import TaskSampler
    from rlvla3.learner.core import BatchStart, LearnerCore
    from rlvla3.learner.samples import prepare_samples
    from rlvla3.rollout.core import RolloutCore, collect_episodes

    reach = Named("reach", {"image_size": 16, "max_decisions": 3})
    policy = build_groot_policy(env_spec(reach), {"preset": "groot_tiny", "seed": 3,
                                                  "tokenizer": str(FIXTURE / "eagle")})
    env, core = make_env(reach), RolloutCore(policy)
    groups = [collect_episodes(env, core, TaskSampler([task], [0], 0), 2, "test")
              for task in (0, 1)]
    items = groups if algo == "grpo" else [[s] for g in groups for s in g]
    cfg = AlgoConfig(algo, group_size=2, proximal="behaviour")
    probe = prepare_samples(groups[0], cfg)  # one GRPO group, two PPO episodes
    batch = sum(len(prepare_samples(g, cfg)) for g in groups)
    learner = LearnerCore(policy, cfg, batch, batch, 3e-4, BatchStart())
    before = learner.loss(probe)[0].item()
    for _ in range(2):
        learner.add_groups(items)
        learner.run_available()
    assert learner.version == 2
    assert learner.loss(probe)[0].item() < before
