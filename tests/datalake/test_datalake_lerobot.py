"""Compatibility: a dataset written by LeRobot itself (``tests/data/lerobot_v30``, made by
``tests/data/make_lerobot_fixture.py``) read frame for frame and value for value."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from datalake.format import open_dataset
from datalake.pipeline import Lake, LakeConfig
from datalake.report import inspect_dataset
from datalake.samples import episode_samples
from datalake.video import DecoderCache, decode_image

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = DATA / "lerobot_v30"


def _load_fixture_module():
    spec = importlib.util.spec_from_file_location("make_lerobot_fixture",
                                                  DATA / "make_lerobot_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fx = _load_fixture_module()
CHUNK = 4


def _expected_chunk(episode: int, t: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    steps = [min(t + k, length - 1) for k in range(CHUNK)]
    return np.stack([fx.action(episode, s) for s in steps]), np.arange(t, t + CHUNK) < length


def _assert_video_frame(image: np.ndarray, episode: int, t: int) -> None:
    """AV1 is lossy: the frame is within a few levels of frame t and far from t +- 1."""
    error = np.abs(image.astype(np.int16) - fx.image(episode, t, 0)).mean()
    assert error < 8, (episode, t, error)
    for other in (t - 1, t + 1):
        assert np.abs(image.astype(np.int16) - fx.image(episode, other, 0)).mean() > 30


def test_lerobot_metadata_is_read_as_written():
    meta = open_dataset(ROOT)
    assert meta.info["codebase_version"] == "v3.0" and meta.fps == fx.FPS
    assert [(e.index, e.length) for e in meta.episodes] == list(enumerate(fx.LENGTHS))
    assert [e.tasks for e in meta.episodes] == [(fx.task(i),) for i in range(len(fx.LENGTHS))]
    assert sorted(meta.tasks.values()) == sorted(fx.TASKS)
    assert meta.video_keys == ["observation.images.front"]
    assert set(meta.camera_keys) == {"observation.images.front", "observation.images.wrist"}
    assert meta.feature_shape("observation.state") == (fx.STATE_DIM,)
    states = np.stack([fx.state(e, t) for e, n in enumerate(fx.LENGTHS) for t in range(n)])
    np.testing.assert_allclose(meta.stats["observation.state"]["mean"], states.mean(0), atol=1e-5)


def test_lerobot_samples_frame_for_frame_and_value_for_value():
    meta = open_dataset(ROOT)
    cache = DecoderCache()
    for ep in meta.episodes:
        e, n = ep.index, ep.length
        rows = episode_samples(meta, 0, ep, ("front", "wrist"), CHUNK)
        assert (rows["problem"] == "").all()
        assert rows["frame"].tolist() == list(range(n))
        assert set(rows["task"]) == {fx.task(e)}
        for i, t in enumerate(rows["frame"]):
            np.testing.assert_array_equal(rows["state"][i], fx.state(e, t))
            chunk, mask = _expected_chunk(e, t, n)
            np.testing.assert_array_equal(rows["actions"][i], chunk)
            np.testing.assert_array_equal(rows["action_mask"][i], mask)
            np.testing.assert_array_equal(decode_image(rows["png.wrist"][i]), fx.image(e, t, 1))
            frame = cache.frame(meta.fs, rows["video.front"][i], rows["ts.front"][i], None)
            _assert_video_frame(frame, e, t)


def test_lerobot_dataset_passes_inspect_and_verify():
    for verify in (False, True):
        report = inspect_dataset(str(ROOT), verify=verify)
        assert report["problems"] == [], report["problems"]
        assert report["episodes"] == len(fx.LENGTHS) and report["codec"] == ["av1"]
    assert report["verified"]["frames_decoded"] == sum(fx.LENGTHS)


def test_lerobot_dataset_through_the_lake(ray_cluster):
    cfg = LakeConfig(datasets=(str(ROOT),), chunk_len=CHUNK, normalize="none", shuffle_buffer=8,
                     decode_actors=1, decode_batch_size=8, max_tokens=600, pack_window=16)
    lake = Lake(cfg)
    assert lake.cameras == ("front", "wrist") and lake.image_size == (fx.HEIGHT, fx.WIDTH)
    seen = set()
    for batch in lake.packed():
        for i, (_, e, t) in enumerate(batch.source):
            seen.add((int(e), int(t)))
            np.testing.assert_array_equal(batch.obs.state[i], fx.state(e, t))
            np.testing.assert_array_equal(batch.actions[i], _expected_chunk(e, t, fx.LENGTHS[e])[0])
            np.testing.assert_array_equal(batch.obs.images["wrist"][i], fx.image(e, t, 1))
            _assert_video_frame(batch.obs.images["front"][i], e, t)
            assert batch.obs.instruction[i] == fx.task(e)
    assert seen == {(e, t) for e, n in enumerate(fx.LENGTHS) for t in range(n)}
