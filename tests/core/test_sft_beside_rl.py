"""The SFT loss beside RL (``algo.sft_coef``): its exact place in the micro-batch loss, a
learner that trains with it staying nearer the demonstrations than one without, its figure per
step, and the refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from support.reach_episodes import REACH, collect_segments, episodes, make_policy

from actors.rl.startup import check_components
from datalake import synthetic
from datalake.demos import load_demos
from datalake.writer import WriterConfig, write_dataset
from envs import env_spec
from rlvla3.algos.config import AlgoConfig
from rlvla3.config import ConfigError
from rlvla3.learner.core import BatchStart, LearnerCore
from rlvla3.learner.samples import prepare_samples
from rlvla3.run_config import load_run_config
from rlvla3.types import ObsBatch


def _write(root, state_dim: int = 2) -> str:
    eps = [synthetic.episode(i, n, cameras=("top",), size=(16, 16), state_dim=state_dim,
                             action_dim=2) for i, n in enumerate((8, 6, 9, 7))]
    write_dataset(root, eps, WriterConfig(fps=10, codec="h264-lossless", episodes_per_file=2))
    return str(root)


@pytest.fixture(scope="module")
def demos_root(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("sft_beside_rl") / "demos")


def _demo_loss(policy, demos) -> float:
    """The policy's SFT loss on every demonstration held."""
    obs = ObsBatch(images=demos.images, image_mask=demos.image_mask, state=demos.state,
                   instruction=tuple(str(t) for t in demos.instruction))
    with torch.no_grad():
        return float(policy.sft_loss(obs, torch.from_numpy(demos.actions),
                                     torch.from_numpy(demos.action_mask)))


def test_the_loss_adds_the_weighted_sft_loss_of_as_many_demonstrations(demos_root):
    spec = env_spec(REACH)
    demos = load_demos([demos_root], spec, max_samples=1000, seed=5)
    segments = collect_segments(make_policy(1), 3)
    batch = prepare_samples(segments, AlgoConfig("ppo"))
    policy = make_policy(2)
    off = LearnerCore(policy, AlgoConfig("grpo"), 8, 8, 1e-3, BatchStart())
    on = LearnerCore(policy, AlgoConfig("grpo", sft_coef=3.0, sft_datasets=(demos_root,)), 8, 8,
                     1e-3, BatchStart(), demos=copy.deepcopy(demos))
    total_off, info_off = off.loss(batch)
    total_on, info_on = on.loss(batch)
    obs, actions, mask = demos.draw(len(batch))  # the same draw: the same seeded generator
    expected = policy.sft_loss(obs, torch.from_numpy(actions), torch.from_numpy(mask))
    torch.testing.assert_close(total_on - total_off, 3.0 * expected)
    assert info_on["sft_loss"] == pytest.approx(expected.item()) and np.isnan(info_off["sft_loss"])
    with pytest.raises(ValueError, match="demonstrations"):
        LearnerCore(policy, AlgoConfig("grpo", sft_coef=3.0, sft_datasets=(demos_root,)), 8, 8,
                    1e-3, BatchStart())


def test_a_learner_with_the_sft_loss_stays_nearer_the_demonstrations(demos_root):
    """The same RL data and steps, with and without the SFT loss: the one with it ends with a
    lower loss on the demonstrations, lower than where it started, and reports it per step."""
    spec = env_spec(REACH)
    segments = collect_segments(make_policy(1), 12)
    batch = sum(len(s) for s in segments)
    start = _demo_loss(make_policy(2), load_demos([demos_root], spec, 1000, 0))
    final, reported = {}, {}
    for coef in (0.0, 1.0):
        demos = load_demos([demos_root], spec, max_samples=1000, seed=0)
        policy = make_policy(2)
        algo = AlgoConfig("ppo", sft_coef=coef, sft_datasets=(demos_root,) if coef else ())
        core = LearnerCore(policy, algo, local_batch=batch, micro_batch=batch // 2 + 1,
                           lr=3e-2, start=BatchStart(), demos=demos if coef else None)
        steps = []
        for _ in range(6):
            core.add_groups(episodes(segments))
            core.run_available(on_step=steps.append)
        assert core.version == 6
        reported[coef] = [s.sft_loss for s in steps]
        final[coef] = _demo_loss(policy, demos)
    assert final[1.0] < 0.5 * start and final[1.0] < 0.5 * final[0.0], (start, final)
    assert all(np.isnan(v) for v in reported[0.0])
    assert all(np.isfinite(v) and v > 0 for v in reported[1.0])
    assert reported[1.0][-1] < reported[1.0][0]


def test_the_config_and_the_run_refuse_what_cannot_train(tmp_path, demos_root):
    with pytest.raises(ConfigError, match="sft_datasets"):
        load_run_config(overrides=["algo.sft_coef=1.0"])
    with pytest.raises(ConfigError, match="sft_coef"):
        load_run_config(overrides=["algo.sft_coef=-1"])
    env = ["env.name=reach", "env.options.image_size=16", "policy.name=small"]
    other = _write(tmp_path / "other", state_dim=5)
    cfg = load_run_config(overrides=[*env, f"algo.sft_datasets=[{other}]", "algo.sft_coef=1.0"])
    with pytest.raises(ConfigError, match="another robot"):
        check_components(cfg)
    missing = load_run_config(overrides=[*env, f"algo.sft_datasets=[{tmp_path / 'none'}]",
                                         "algo.sft_coef=1.0"])
    with pytest.raises(ConfigError, match="algo.sft_datasets"):
        check_components(missing)
    fits = load_run_config(overrides=[*env, f"algo.sft_datasets=[{demos_root}]",
                                      "algo.sft_coef=1.0"])
    assert check_components(fits).cameras == ("top",)
