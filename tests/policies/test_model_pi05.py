"""pi0.5 acts as its reference: LeRobot 0.6.1 parity from a committed fixture, the PaliGemma
tokenizer and prompt, loading the files users have, and the reference options' behaviour.

The fixture (``tests/data/pi05_tiny``, or ``RLVLA3_PI05_FIXTURE``) was written by LeRobot itself
with ``tests/data/make_pi05_fixture.py``; everything here runs rlvla3's code only.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from measure.parity import vla as parity
from rlvla3.config import ConfigError
from rlvla3.policies.vla import build_vla_policy
from rlvla3.policies.vla.loader import CheckpointLayoutError, load_openpi_checkpoint
from rlvla3.policies.vla.network import VLANetwork
from rlvla3.policies.vla.tokenizer import PaliGemmaTokenizer, pi05_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from pi05_reference import train_tokenizer  # noqa: E402  (LeRobot is imported lazily there)

FIXTURE = parity.fixture_path()
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference():
    meta, tensors = parity.load_fixture(FIXTURE)
    return meta, tensors, parity.fixture_policy(FIXTURE, meta, tensors)


# -- parity ----------------------------------------------------------------------------------
def test_every_stage_and_the_actions_match_lerobot_within_1e5():
    stages = parity.compare(FIXTURE)
    names = [s.name for s in stages]
    for needed in ("tokens", "prompts", "pixels wrist (48x64)", "pixels agentview (56x56)",
                   "prefix hidden", "keys layer 1", "velocity, 10 steps (sampled)",
                   "actions (sampled)", "actions (deterministic)"):
        assert needed in names
    bad = [(s.name, s.max_abs_diff, s.scale) for s in stages if not s.error <= parity.TOLERANCE]
    assert not bad, bad
    assert all(s.elements > 0 for s in stages)


def test_the_fixture_exercises_what_differs_from_the_old_path(reference):
    """Padding, absent camera, out-of-range state and deterministic noise are all present:
    a regression to the old behaviour would show in the parity test."""
    meta, t, policy = reference
    assert len(set(t["token_mask"].sum(1).tolist())) == 3  # right padding of unequal lengths
    assert "observation.images.empty_camera_0" not in meta["cameras"]  # declared, never fed
    assert meta["prompts"][0].split("State: ")[1].startswith("-1 ")  # below its 1% quantile
    assert t["frames.observation.images.image2"].shape[1:3] != (56, 56)
    assert policy.processor.cameras == ("agentview", "wrist")
    assert policy.cfg.denoise_steps == 10 and policy.chain_width == 32
    # The old path (zero start, chain cut to 7 dims) is far from the reference.
    obs = parity.fixture_obs(meta, t)
    old = build_vla_policy(policy.spec, {**_fixture_options(meta), "chain": "action",
                                         "noise_start": "zero"})
    gap = np.abs(old.act(obs, deterministic=True).actions - t["actions.deterministic"].numpy())
    assert gap.max() > 0.1


def _fixture_options(meta):
    cams = {env: key for key, env in meta["cameras"].items()}
    return {"preset": "pi05_tiny", "checkpoint": str(FIXTURE), "camera_keys": cams,
            "tokenizer": str(FIXTURE / "tokenizer.model"), "eval_noise_seed": meta["eval_noise_seed"]}


def test_deterministic_acting_is_a_function_of_the_observation(reference):
    meta, t, policy = reference
    obs = parity.fixture_obs(meta, t)
    whole = policy.act(obs, deterministic=True).actions
    for i in range(len(obs)):
        alone = policy.act(obs.select(np.array([i])), deterministic=True).actions
        np.testing.assert_allclose(alone[0], whole[i], atol=2e-6)
    flipped = policy.act(obs.select(np.arange(len(obs))[::-1]), deterministic=True).actions
    np.testing.assert_allclose(flipped[::-1], whole, atol=2e-6)


def test_rl_on_the_padded_chain_recomputes_the_behaviour_log_prob(reference):
    meta, t, policy = reference
    obs = parity.fixture_obs(meta, t)
    out = policy.act(obs)
    assert out.latents.shape == (3, 11, 10, 32) and out.actions.shape == (3, 10, 7)
    ev = policy.evaluate(obs, torch.tensor(out.actions), torch.tensor(out.latents))
    np.testing.assert_allclose(ev.log_prob.detach().numpy(), out.log_prob, rtol=1e-5, atol=1e-3)
    # SFT on the padded chain: only the env's 7 dims are regressed.
    actions = t["actions.sampled"].clone()
    noise, time = torch.randn(3, 10, 32), torch.tensor([0.2, 0.5, 0.9])
    base = policy.flow_losses(obs, actions, noise, time)
    moved = noise.clone()
    moved[..., 7:] += 5.0  # noise in the padding dims changes the input, not the target
    assert torch.isfinite(base).all() and not torch.allclose(base, policy.flow_losses(
        obs, actions, moved, time))
    assert policy.sft_loss(obs, actions, torch.ones(3, 10)).ndim == 0


def test_a_policy_gradient_step_raises_the_log_prob_of_a_favoured_chain(reference):
    """The learner's path on the pi0.5 chain: a step up the log-probability of the chains with
    a positive advantage makes them more likely, the others less."""
    meta, t, _ = reference
    policy = parity.fixture_policy(FIXTURE, meta, t)  # its own copy: the step changes weights
    obs = parity.fixture_obs(meta, t)
    out = policy.act(obs)
    actions, latents = torch.tensor(out.actions), torch.tensor(out.latents)
    advantage = torch.tensor([1.0, -1.0, 1.0])
    before = policy.evaluate(obs, actions, latents).log_prob.detach()
    optim = torch.optim.SGD([p for n, p in policy.net.named_parameters()
                             if n.startswith(("expert_layers", "action_", "time_mlp"))], lr=1e-4)
    loss = -(advantage * policy.evaluate(obs, actions, latents).log_prob).mean()
    loss.backward()
    optim.step()
    change = policy.evaluate(obs, actions, latents).log_prob.detach() - before
    assert (change * advantage > 0).all(), change


# -- files users have -----------------------------------------------------------------------
def _hub_weights():
    return load_file(str(FIXTURE / "model.safetensors"))


def _tiny_net(meta, t):
    return parity.fixture_policy(FIXTURE, meta, t).net


def test_hub_layout_file_carries_only_the_tied_head_and_loads(reference):
    meta, t, policy = reference
    weights = _hub_weights()
    assert LM_HEAD in weights and EMBED not in weights
    torch.testing.assert_close(policy.net.embed_tokens.weight, weights[LM_HEAD], rtol=0, atol=0)


def test_openpi_style_file_loads_with_old_names_and_bfloat16(tmp_path, reference):
    meta, t, policy = reference
    weights = {k.removeprefix("model."): v for k, v in _hub_weights().items()}
    weights = {k.replace("time_mlp_", "action_time_mlp_"): v.to(torch.bfloat16)
               for k, v in weights.items()}
    assert "action_time_mlp_in.weight" in weights
    save_file(weights, str(tmp_path / "pi05_base.safetensors"))
    net = VLANetwork(policy.shapes, 7, 10, flow_noise=False)
    fresh = load_openpi_checkpoint(net, tmp_path / "pi05_base.safetensors")
    assert fresh and all(n.startswith("value_head.") for n in fresh)
    assert net.time_mlp_in.weight.dtype == torch.float32
    torch.testing.assert_close(net.time_mlp_in.weight,
                               policy.net.time_mlp_in.weight.to(torch.bfloat16).float())
    torch.testing.assert_close(net.embed_tokens.weight,
                               policy.net.embed_tokens.weight.to(torch.bfloat16).float())


@pytest.mark.parametrize("damage", ["remove", "reshape"])
def test_a_damaged_file_is_refused_naming_the_key(tmp_path, reference, damage):
    meta, t, policy = reference
    weights = _hub_weights()
    key = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
    if damage == "remove":
        del weights[key]
    else:
        weights[key] = torch.zeros(3, 5)
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE, directory)
    save_file(weights, str(directory / "model.safetensors"))
    before = policy.net.expert_layers[1].mlp.up_proj.weight.clone()
    with pytest.raises(CheckpointLayoutError) as err:
        build_vla_policy(policy.spec, {**_fixture_options(meta), "checkpoint": str(directory)})
    short = key.removeprefix("model.")
    expected = (f"missing keys (1): {short}" if damage == "remove"
                else f"{short}: checkpoint (3, 5) vs model (64, 32)")
    assert expected in str(err.value)
    torch.testing.assert_close(policy.net.expert_layers[1].mlp.up_proj.weight, before)
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointLayoutError, match="not a readable safetensors"):
        build_vla_policy(policy.spec, {**_fixture_options(meta), "checkpoint": str(directory)})


def test_a_lerobot_directory_supplies_the_reference_options_and_checks_the_env(reference):
    meta, t, policy = reference
    cfg = policy.cfg
    assert (cfg.chain, cfg.noise_start, cfg.normalization, cfg.image_resize) == (
        "padded", "seeded", "quantile", "pad")
    assert (cfg.denoise_steps, cfg.max_text_tokens, cfg.image_size) == (10, 200, 56)
    stats = load_file(str(FIXTURE / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    np.testing.assert_allclose(cfg.state_q01, stats["observation.state.q01"].numpy())
    opts = _fixture_options(meta)
    assert build_vla_policy(policy.spec, {**opts, "denoise_steps": 3}).cfg.denoise_steps == 3
    with pytest.raises(ConfigError, match="policy.options.tokenizer"):
        build_vla_policy(policy.spec, {k: v for k, v in opts.items() if k != "tokenizer"})
    with pytest.raises(ConfigError, match="env.options.chunk_len"):
        build_vla_policy(dataclasses.replace(policy.spec, chunk_len=5), opts)
    with pytest.raises(ConfigError, match="policy.options.camera_keys"):
        build_vla_policy(policy.spec, {**opts, "camera_keys": {}})
    with pytest.raises(ConfigError, match="policy.options.tokenizer"):
        build_vla_policy(policy.spec, {**opts, "tokenizer": str(FIXTURE / "absent.model")})
    with pytest.raises(ConfigError, match="policy.options.tokenizer"):
        build_vla_policy(policy.spec, {**opts, "tokenizer": str(FIXTURE / "config.json")})


def test_a_directory_of_another_policy_or_mode_is_refused(tmp_path, reference):
    meta, t, policy = reference
    for edit, match in ((lambda c: c.update(type="pi0"), "not 'pi05'"),
                        (lambda c: c["normalization_mapping"].update(ACTION="MEAN_STD"),
                         "MEAN_STD")):
        directory = tmp_path / match.replace(" ", "_").replace("'", "")
        shutil.copytree(FIXTURE, directory)
        config = json.loads((directory / "config.json").read_text())
        edit(config)
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=match):
            build_vla_policy(policy.spec, {**_fixture_options(meta),
                                           "checkpoint": str(directory)})


# -- tokenizer and prompt ---------------------------------------------------------------------
LIBERO = ("pick up the black bowl between the plate and the ramekin and place it on the plate\n"
          "Task: put the bowl in the basket, State: 0 12 255 128 7 99 3 64;\nAction: ")


def test_paligemma_tokenizer_on_a_sentencepiece_model_trained_here(tmp_path):
    import sentencepiece as spm

    train_tokenizer(tmp_path / "sp.model", LIBERO, vocab=300)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    bins = np.array([-1, 3, 255, 128, 0, 64, 7, 200])
    text = " pick_up the bowl\n"
    with_state = PaliGemmaTokenizer(tmp_path / "sp.model", 200, with_state=True)
    prompt = "Task: pick up the bowl, State: -1 3 255 128 0 64 7 200;\nAction: "
    assert with_state.prompt(text, bins) == pi05_prompt(text, bins) == prompt
    ids, state_ids = with_state.encode(text, bins)
    assert ids == [2, *sp.encode(prompt)] and state_ids == []
    assert sp.decode(ids[1:]) == prompt
    without = PaliGemmaTokenizer(tmp_path / "sp.model", 200, with_state=False)
    assert without.encode(text, bins)[0] == [2, *sp.encode("pick up the bowl"), *sp.encode("\n")]
    assert without.prompt(text, bins) == "pick up the bowl\n"
    short = PaliGemmaTokenizer(tmp_path / "sp.model", 5, with_state=True)
    assert short.encode(text, bins)[0] == ids[:5]


def test_the_prompt_carries_the_libero_state_as_the_reference_bins_it(tmp_path):
    """A LIBERO-like observation through the policy: the prompt's state bins are LeRobot's
    ``digitize(normalised, linspace(-1, 1, 257)[:-1]) - 1``."""
    train_tokenizer(tmp_path / "sp.model", LIBERO, vocab=300)
    spec = libero_like_spec(image_size=32, chunk_len=4)
    obs, _ = libero_like_batch(spec, 2, np.random.default_rng(3))
    q01, q99 = [-1.0] * 8, [0.5] * 8
    policy = build_vla_policy(spec, {"preset": "pi05_tiny", "tokenizer": str(tmp_path / "sp.model"),
                                     "normalization": "quantile", "state_q01": q01,
                                     "state_q99": q99, "max_text_tokens": 200})
    norm = 2.0 * (obs.state - np.float32(-1.0)) / np.float32(1.5) - 1.0
    bins = np.digitize(norm, np.linspace(-1, 1, 257)[:-1]) - 1
    assert (policy.normalizer.state_bins(obs.state) == bins).all()
    ids = policy.processor.encode_text(obs)[0][0]
    assert policy.processor.tokenizer.sp.decode(ids[1:]) == pi05_prompt(obs.instruction[0], bins[0])
    pb = policy.processor(obs)
    assert len(pb.state_ids) == 0 and len(pb.text_ids) == sum(
        len(t) for t, _ in policy.processor.encode_text(obs))
    cams = sum(obs.image_mask[c].astype(int) for c in spec.cameras)
    lens = np.array([len(t) for t, _ in policy.processor.encode_text(obs)])
    assert policy.token_counts(obs).tolist() == (
        cams * policy.shapes.image_tokens + lens + spec.chunk_len).tolist()
    with pytest.raises(ConfigError, match="300 tokens, the model's embedding 100 rows"):
        build_vla_policy(spec, {"preset": "pi05_tiny", "tokenizer": str(tmp_path / "sp.model"),
                                "shapes": {"vocab": 100}})


# -- the old behaviour is the default -------------------------------------------------------
def test_defaults_keep_the_old_chain_start_and_width():
    spec = libero_like_spec(image_size=32, chunk_len=4)
    obs, _ = libero_like_batch(spec, 2, np.random.default_rng(0))
    policy = build_vla_policy(spec, {"preset": "tiny"})
    assert policy.chain_width == spec.action_dim and policy.latent_shape == (5, 4, 7)
    assert (policy.initial_noise(2, deterministic=True) == 0).all()
    det = policy.act(obs, deterministic=True)
    np.testing.assert_array_equal(det.actions,
                                  policy.predict_chunk(obs, torch.zeros(2, 4, 7)))
    seeded = build_vla_policy(spec, {"preset": "tiny", "noise_start": "seeded"})
    start = seeded.initial_noise(2, deterministic=True)
    assert start.abs().sum() > 0 and torch.equal(start[0], start[1])
    with pytest.raises(ConfigError, match="policy.options.chain"):
        build_vla_policy(spec, {"preset": "tiny", "chain": "padded"}, "policy.options")
    with pytest.raises(ConfigError, match="policy.options.state_q01"):
        build_vla_policy(spec, {"state_q01": [0.0] * 8, "state_q99": [1.0] * 8},
                         "policy.options")
