"""The Ray Data lake end to end on a real local Ray: frames, packing, determinism, bad data, mixing."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datalake import synthetic
from datalake.pipeline import Lake, LakeConfig, LakeError
from datalake.writer import WriterConfig, write_dataset

SIZE = (32, 48)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("lake")
    a = [synthetic.episode(i, n, size=SIZE) for i, n in enumerate((9, 14, 6, 11, 8, 12))]
    write_dataset(base / "a", a, WriterConfig(fps=10, codec="h264-lossless", episodes_per_file=2))
    b = [synthetic.episode(100 + i, n, size=SIZE) for i, n in enumerate((10, 7, 13))]
    write_dataset(base / "b", b, WriterConfig(fps=10, codec="av1", episodes_per_file=2))
    return base, a, b


def _config(*roots, **kw) -> LakeConfig:
    base = dict(
        datasets=tuple(str(r) for r in roots),
        image_size=SIZE,
        chunk_len=4,
        normalize="none",
        shuffle_buffer=16,
        decode_actors=1,
        decode_batch_size=16,
        max_tokens=400,
        pack_window=24,
        min_samples_before_abort=8,
    )
    return LakeConfig(**(base | kw))


def _drain(loader):
    return [b for b in loader]


def test_packed_samples_match_written_data(ray_cluster, datasets):
    base, eps, _ = datasets
    lake = Lake(_config(base / "a"))
    batches = _drain(lake.packed())
    seen = []
    for b in batches:
        assert b.real_tokens <= 400 and len(b) <= 64
        assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == b.real_tokens
        assert np.all(np.diff(b.cu_seqlens) == b.lengths)
        for i, (_, ep, t) in enumerate(b.source):
            rec = eps[ep]
            np.testing.assert_array_equal(b.obs.images["agentview"][i], rec.images["agentview"][t])
            np.testing.assert_array_equal(b.obs.images["wrist"][i], rec.images["wrist"][t])
            assert b.obs.image_mask["wrist"][i]
            np.testing.assert_array_equal(b.obs.state[i], rec.state[t])
            n = len(rec.action)
            steps = np.minimum(np.arange(t, t + 4), n - 1)
            np.testing.assert_array_equal(b.actions[i], rec.action[steps])
            assert b.action_mask[i].tolist() == [s < n for s in range(t, t + 4)]
            assert b.obs.instruction[i] == rec.task
            seen.append((ep, t))
    # One epoch: every frame of every episode exactly once.
    assert sorted(seen) == sorted((e, t) for e, r in enumerate(eps) for t in range(len(r.action)))
    # Packing filled rows: far fewer rows than samples.
    assert len(batches) <= len(seen) // 2


def test_order_is_deterministic_for_a_seed(ray_cluster, datasets):
    base, _, _ = datasets

    def order(seed):
        lake = Lake(_config(base / "a", base / "b", seed=seed, samples_per_epoch=60))
        return [tuple(s) for b in lake.packed() for s in b.source]

    first = order(3)
    assert first == order(3)
    assert first != order(4)


def test_mixing_weights_and_streaming_split(ray_cluster, datasets):
    base, _, b_eps = datasets
    lake = Lake(_config(base / "a", base / "b", weights=(1.0, 3.0), samples_per_epoch=400))
    shards = lake.split(2)
    results: list[list] = [[], []]

    def consume(k):
        results[k] = _drain(lake.loader(shards[k]))

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    sources = np.concatenate([b.source for r in results for b in r])
    assert all(len(r) > 0 for r in results)  # both learners were fed
    share_b = float((sources[:, 0] == 1).mean())
    assert share_b == pytest.approx(0.75, abs=0.12)
    # Frames from the AV1 dataset decode close to what was written.
    for r in results:
        for b in r:
            for i, (d, ep, t) in enumerate(b.source):
                if d == 1:
                    ref = b_eps[ep].images["agentview"][t].astype(int)
                    assert np.abs(b.obs.images["agentview"][i].astype(int) - ref).mean() < 8


def test_bad_files_are_skipped_counted_and_named(ray_cluster, datasets, tmp_path):
    base, eps, _ = datasets
    root = tmp_path / "bad"
    shutil.copytree(base / "a", root)
    # Episode 1's wrist frames point past the end of its video (file-000).
    meta_path = root / "meta/episodes/chunk-000/file-000.parquet"
    episodes = pq.read_table(meta_path)
    col = "videos/observation.images.wrist/from_timestamp"
    shifted = [v + 60.0 if i == 1 else v for i, v in enumerate(episodes[col].to_pylist())]
    episodes = episodes.set_column(episodes.column_names.index(col), col, pa.array(shifted))
    pq.write_table(episodes, meta_path)
    # Episodes 2, 3 live in file-001: corrupt its parquet. Episodes 4, 5: delete one mp4.
    parquet = root / "data/chunk-000/file-001.parquet"
    parquet.write_bytes(parquet.read_bytes()[:100])
    (root / "videos/observation.images.wrist/chunk-000/file-002.mp4").unlink()
    lake = Lake(_config(root, max_skip_fraction=0.95))
    loader = lake.packed()
    used = sum(len(b) for b in loader)
    bad_frames = sum(len(eps[i].action) for i in (1, 2, 3, 4, 5))
    assert used == len(eps[0].action)
    assert loader.ledger.skipped == bad_frames
    assert len(loader.ledger.problems) == 3  # one entry per bad file, not one per frame
    problems = " ".join(loader.ledger.problems)
    assert "file-001.parquet" in problems
    assert "missing video" in problems and "file-002.mp4" in problems
    assert "wrist/chunk-000/file-000.mp4: requested frames lie past the end" in problems

    strict = Lake(_config(root, max_skip_fraction=0.1))
    with pytest.raises(LakeError, match=r"skipped \d+ of \d+ samples .* max_skip_fraction=10.0%"):
        _drain(strict.packed())


def test_unreadable_dataset_in_a_mix_is_skipped(ray_cluster, datasets, tmp_path):
    base, _, _ = datasets
    old = tmp_path / "old"
    shutil.copytree(base / "b", old)
    info = (old / "meta/info.json").read_text().replace('"v3.0"', '"v2.1"')
    (old / "meta/info.json").write_text(info)
    lake = Lake(_config(base / "a", old, max_skip_fraction=0.5))
    assert lake.metas[1] is None and "v2.1" in lake.dataset_problems[0][0]
    loader = lake.packed()
    sources = np.concatenate([b.source for b in loader])
    assert set(sources[:, 0].tolist()) == {0}
    assert any("v2.1" in p for p in loader.ledger.problems)
    with pytest.raises(LakeError, match="no readable dataset"):
        Lake(_config(old))
