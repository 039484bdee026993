"""What a GR00T checkpoint directory is, decided by what it holds (``rlvla3.policies.groot.loader``):
a LeRobot groot directory without ``"type"`` in its config still normalises as LeRobot does;
one without the statistics LeRobot acts with is refused unless the options give them; a
directory without ``config.json``, or with marks of both layouts, is refused; statistics of
another robot's dimensions are refused before the policy acts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from measure.parity import groot as parity
from rlvla3.config import ConfigError
from rlvla3.policies.groot.loader import read_checkpoint

FIXTURE = parity.fixture_path()
PACK = "policy_preprocessor_step_2_groot_pack_inputs_v3.safetensors"
UNPACK = "policy_postprocessor_step_0_groot_action_unpack_unnormalize_v1.safetensors"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fixture():
    return parity.load_fixture(FIXTURE)


def _lerobot_copy(tmp_path, drop_type=False):
    d = tmp_path / "lerobot"
    shutil.copytree(FIXTURE / "lerobot", d)
    if drop_type:  # as LeRobot 0.5.1 writes it with a draccus other than its pinned 0.10.0
        cfg = json.loads((d / "config.json").read_text())
        del cfg["type"]
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _state_normalised(fixture, checkpoint, **options):
    meta, t = fixture
    spec = parity.fixture_spec(meta, t)
    from rlvla3.policies.groot import build_groot_policy

    policy = build_groot_policy(spec, {**parity.fixture_options(FIXTURE, meta, checkpoint),
                                       **options})
    return policy.processor.state(parity.fixture_obs(meta, t), "cpu")


def test_a_lerobot_directory_without_type_normalises_as_lerobot_does(fixture, tmp_path):
    _, t = fixture
    d = _lerobot_copy(tmp_path, drop_type=True)
    reference = torch.cat([t[f"sampled.{i}.state_normalised"] for i in range(3)])
    torch.testing.assert_close(_state_normalised(fixture, d), reference, rtol=0, atol=1e-6)
    assert read_checkpoint(d).layout == "lerobot"


def test_a_lerobot_directory_without_its_statistics_is_refused(fixture, tmp_path):
    d = _lerobot_copy(tmp_path)
    (d / PACK).unlink()
    pre = json.loads((d / "policy_preprocessor.json").read_text())
    for step in pre["steps"]:
        step.pop("state_file", None)
    (d / "policy_preprocessor.json").write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match="policy.options.checkpoint") as info:
        _state_normalised(fixture, d)
    message = str(info.value)
    assert "observation.state min/max" in message and "feed the raw state" in message
    assert "state_min and state_max" in message
    # Given explicitly, the statistics are the user's and the directory loads.
    meta, t = fixture
    stats = load_file(str(FIXTURE / "lerobot" / PACK))
    ours = _state_normalised(fixture, d, state_min=stats["observation.state.min"].tolist(),
                             state_max=stats["observation.state.max"].tolist())
    reference = torch.cat([t[f"sampled.{i}.state_normalised"] for i in range(3)])
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_lerobots_own_action_defaults_are_refused_not_guessed(tmp_path):
    d = _lerobot_copy(tmp_path)
    state = {k: v for k, v in load_file(str(d / UNPACK)).items() if k.startswith("observation")}
    save_file(state, str(d / UNPACK))  # statistics held, none for the action: LeRobot's [0, 1]
    assert "min 0, max 1" in read_checkpoint(d).missing_stats["action"]
    (d / UNPACK).unlink()
    post = json.loads((d / "policy_postprocessor.json").read_text())
    for step in post["steps"]:
        step.pop("state_file", None)
    (d / "policy_postprocessor.json").write_text(json.dumps(post))
    assert "unnormalised" in read_checkpoint(d).missing_stats["action"]
    (d / "policy_postprocessor.json").unlink()
    assert read_checkpoint(d).missing_stats["action"] == "no policy_postprocessor.json"
    assert "observation.state" in read_checkpoint(d).stats


def test_a_checkpoint_directory_without_config_is_refused(tmp_path):
    d = tmp_path / "isaac"
    shutil.copytree(FIXTURE / "isaac", d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        read_checkpoint(d)
    assert read_checkpoint(d / "model.safetensors").layout == "isaac"  # the file itself: yes


def test_marks_of_both_layouts_are_refused(tmp_path):
    d = tmp_path / "mixed"
    shutil.copytree(FIXTURE / "isaac", d)
    shutil.copy(FIXTURE / "lerobot" / "policy_preprocessor.json", d)
    with pytest.raises(ValueError, match="neither a LeRobot groot directory nor") as info:
        read_checkpoint(d)
    assert "policy_preprocessor.json" in str(info.value)
    assert "model_type 'gr00t_n1_5'" in str(info.value)


def test_statistics_of_another_robot_are_refused_naming_the_option(fixture):
    with pytest.raises(ConfigError, match="policy.options.state_min") as info:
        _state_normalised(fixture, FIXTURE / "lerobot", state_min=[0.0] * 4,
                          state_max=[1.0] * 4)
    assert "4 values, the env's state 8" in str(info.value)
