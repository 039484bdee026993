"""Demonstrations held in memory for the SFT loss beside RL: real frames of a written dataset,
seeded draws, a subset past the cap, and refusals of a dataset that does not fit the env."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from datalake import synthetic
from datalake.demos import load_demos
from datalake.format import DatasetError
from datalake.writer import WriterConfig, write_dataset
from rlvla3.types import EnvSpec

SPEC = EnvSpec(cameras=("top",), image_size=(16, 16), state_dim=2, action_dim=2, chunk_len=3,
               max_decisions=6, num_tasks=3, num_init_states=5)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "d"
    eps = [synthetic.episode(i, n, cameras=("top",), size=(16, 16), state_dim=2, action_dim=2)
           for i, n in enumerate((7, 5, 9))]
    write_dataset(root, eps, WriterConfig(fps=10, codec="h264-lossless", episodes_per_file=2))
    return str(root), eps


def test_every_frame_is_held_with_its_chunk_and_image(dataset):
    root, eps = dataset
    demos = load_demos([root], SPEC, max_samples=1000, seed=0)
    assert len(demos) == sum(len(e.state) for e in eps) and demos.skipped == 0
    for i in range(len(demos)):
        e, t = (int(v) for v in demos.state[i])  # synthetic: state = [episode, frame]
        rec = eps[e]
        steps = np.arange(t, t + SPEC.chunk_len)
        valid = steps < len(rec.action)
        np.testing.assert_array_equal(demos.action_mask[i], valid)
        np.testing.assert_allclose(demos.actions[i][valid], rec.action[steps[valid]])
        assert np.abs(demos.images["top"][i].astype(int)
                      - rec.images["top"][t].astype(int)).mean() < 4  # lossless, resized 1:1
        assert demos.instruction[i] == rec.task


def test_draws_are_seeded_and_the_cap_keeps_a_subset(dataset):
    root, eps = dataset
    a = load_demos([root], SPEC, max_samples=1000, seed=3).draw(8)
    b = load_demos([root], SPEC, max_samples=1000, seed=3).draw(8)
    np.testing.assert_array_equal(a[0].state, b[0].state)
    assert a[0].instruction == b[0].instruction and a[1].shape == (8, 3, 2)
    capped = load_demos([root], SPEC, max_samples=6, seed=0)
    assert len(capped) == 6 and len({tuple(s) for s in capped.state}) == 6


@pytest.mark.parametrize("change, message", [
    ({"state_dim": 4}, "another robot"),
    ({"action_dim": 7}, "another robot"),
    ({"cameras": ("top", "wrist")}, "no camera"),
])
def test_a_dataset_that_does_not_fit_the_env_is_refused(dataset, change, message):
    with pytest.raises(DatasetError, match=message):
        load_demos([dataset[0]], dataclasses.replace(SPEC, **change), max_samples=10, seed=0)
