"""``bench lake``'s baseline: a torch DataLoader (real worker processes) that delivers exactly
the lake's samples for a seed, in the same kind of order (episode plan + shuffle buffer)."""

from __future__ import annotations

import numpy as np
import pytest

from datalake import synthetic
from datalake.pipeline import Lake, LakeConfig
from datalake.writer import WriterConfig, write_dataset
from measure.lake import EpisodeShuffleSampler, SampleDataset, dataloader_rows

SIZE = (32, 32)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench") / "d"
    eps = [synthetic.episode(i, n, size=(48, 48)) for i, n in enumerate((9, 6, 11, 7, 8))]
    write_dataset(root, eps, WriterConfig(fps=10, codec="av1", episodes_per_file=2))
    return root


def _config(root, **kw) -> LakeConfig:
    return LakeConfig(datasets=(str(root),), image_size=SIZE, chunk_len=3, normalize="none",
                      shuffle_buffer=12, decode_actors=1, decode_batch_size=8, max_tokens=500,
                      pack_window=16, seed=3, **kw)


def _by_sample(rows) -> dict[tuple[int, int], tuple]:
    out = {}
    for batch in rows:
        assert batch.real_tokens <= 500
        for i, (_, e, t) in enumerate(batch.source):
            key = (int(e), int(t))
            assert key not in out, f"sample {key} delivered twice"
            out[key] = (batch.obs.state[i], batch.actions[i], batch.action_mask[i],
                        batch.obs.images["agentview"][i], batch.obs.images["wrist"][i],
                        batch.obs.instruction[i])
    return out


def test_dataloader_yields_exactly_the_lakes_samples(ray_cluster, dataset):
    lake = Lake(_config(dataset))
    from_lake = _by_sample(lake.packed())
    rows, _ = dataloader_rows(lake, workers=1, prefetch=2)
    from_loader = _by_sample(rows)
    assert set(from_loader) == set(from_lake) == {
        (e, t) for e, n in enumerate((9, 6, 11, 7, 8)) for t in range(n)
    }
    for key, values in from_lake.items():
        for a, b in zip(values, from_loader[key], strict=True):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b, err_msg=str(key))
            else:
                assert a == b
    assert from_lake[(2, 4)][3].shape == (*SIZE, 3)  # resized to the output resolution


def test_sampler_follows_the_episode_plan_through_a_seeded_buffer(dataset):
    ds = SampleDataset(Lake(_config(dataset)))
    order = list(EpisodeShuffleSampler(ds, buffer=12, seed=3))
    assert sorted(order) == list(range(len(ds)))
    assert order == list(EpisodeShuffleSampler(ds, buffer=12, seed=3))
    assert order != list(EpisodeShuffleSampler(ds, buffer=12, seed=4))
    # No index leaves the buffer before the 12 indices after it were read in.
    assert all(k <= pos + 12 for pos, k in enumerate(order))
    assert list(EpisodeShuffleSampler(ds, buffer=1, seed=3)) == list(range(len(ds)))
    # Items follow the lake's episode plan: the first episode drawn comes first without a buffer.
    first_episode = ds.plan[0][1]
    assert int(ds[0]["episode"][0]) == first_episode and int(ds[0]["frame"][0]) == 0
