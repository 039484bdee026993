"""``datalake inspect --verify`` and ``sft --verify-data`` find the damage that the metadata
check passes: an mp4 cut short (LeRobot writes its header first, so it still opens and announces
the full duration) and a data parquet with corrupt pages (its footer is intact)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from commands.datalake import main as datalake_main
from datalake.format import open_dataset
from datalake.samples import episode_samples
from datalake.verify import format_episodes, verify_dataset
from datalake.video import DecoderCache, VideoError

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "lerobot_v30"
VIDEO = "videos/observation.images.front/chunk-000/file-000.mp4"
DATA = "data/chunk-000/file-000.parquet"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dataset(tmp_path):
    return Path(shutil.copytree(FIXTURE, tmp_path / "ds"))


def _truncate_video(root: Path) -> None:
    """Keep the first 60%: frames up to 1.4 s survive; episode 0 (0-1.1 s) is whole,
    episode 1 (1.2-1.8 s) keeps 3 of 7 frames, episode 2 (1.9-3.3 s) none."""
    path = root / VIDEO
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])


def _corrupt_row_group(root: Path, group: int, column: str = "action") -> None:
    """Scramble the pages of one column chunk of ``group``; the footer stays intact."""
    path = root / DATA
    meta = pq.ParquetFile(path).metadata
    rg = meta.row_group(group)
    chunk = next(rg.column(c) for c in range(rg.num_columns)
                 if rg.column(c).path_in_schema.startswith(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 6, start + chunk.total_compressed_size):
        data[i] = (data[i] * 7 + 13) % 256
    path.write_bytes(bytes(data))


def _inspect(root: Path, *flags: str, capsys) -> tuple[int, dict]:
    code = datalake_main(["inspect", str(root), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_truncated_video_passes_inspect_and_fails_verify(dataset, capsys):
    _truncate_video(dataset)
    code, report = _inspect(dataset, capsys=capsys)
    assert code == 0 and report["problems"] == []
    code, report = _inspect(dataset, "--verify", capsys=capsys)
    assert code == 1 and len(report["problems"]) == 1
    problem = report["problems"][0]
    assert VIDEO in problem and "affects episodes 1-2 (19 frames)" in problem
    assert report["verified"]["affected_episodes"] == [1, 2]
    assert report["verified"]["affected_frames"] == 4 + 15


def test_corrupt_data_pages_pass_inspect_and_fail_verify(dataset, capsys):
    _corrupt_row_group(dataset, 1)
    code, report = _inspect(dataset, capsys=capsys)
    assert code == 0 and report["problems"] == []
    code, report = _inspect(dataset, "--verify", capsys=capsys)
    assert code == 1 and len(report["problems"]) == 1
    problem = report["problems"][0]
    assert DATA in problem and "row group 1" in problem and "affects episode 1 (7 frames)" in problem
    assert report["verified"]["row_groups"] == 3


def test_verify_names_the_episodes_training_would_lose(dataset):
    """What verify names is what reading the samples loses, frame for frame."""
    _truncate_video(dataset)
    _corrupt_row_group(dataset, 2, column="observation.state")
    meta = open_dataset(dataset)
    report = verify_dataset(meta)
    lost_video = {p.path: dict(zip(p.episodes, p.frames, strict=True)) for p in report.problems}
    assert lost_video[meta.path(VIDEO)] == {1: 4, 2: 15}
    assert lost_video[meta.path(DATA)] == {2: 15}
    cache = DecoderCache()
    for ep in meta.episodes:
        rows = episode_samples(meta, 0, ep, ("front",), chunk_len=2)
        if ep.index == 2:  # unreadable rows: the whole episode is one problem row
            assert rows["skips"].tolist() == [15] and DATA in rows["problem"][0]
            continue
        failed = 0
        for path, ts in zip(rows["video.front"], rows["ts.front"], strict=True):
            try:
                cache.frame(meta.fs, path, float(ts), None)
            except VideoError:
                failed += 1
        assert failed == {0: 0, 1: 4}[ep.index]


def test_episode_lists_read_as_ranges():
    assert format_episodes([3, 0, 1, 2, 7, 9, 10]) == "episodes 0-3, 7, 9-10"
    assert format_episodes([5]) == "episode 5"


@pytest.mark.slow
def test_sft_on_a_video_cut_short_ends_in_one_line_not_in_tracebacks(dataset, tmp_path):
    """The video's header survives, so the quick check passes and the lake finds the damage
    while training: more samples skipped than lake.max_skip_fraction. The job ends with that
    error in one line (exit 2); Ray Train's reports of it (the worker's traceback, its
    controller's) are not printed."""
    _truncate_video(dataset)
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "sft", "--dataset", str(dataset), "--max-steps", "5",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlvla3 sft: skipped ") and VIDEO in last, proc.stderr[-3000:]
    assert "more than max_skip_fraction" in last


def test_sft_verify_data_stops_before_ray_with_one_line(dataset, tmp_path):
    _corrupt_row_group(dataset, 0)
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "sft", "--dataset", str(dataset), "--verify-data",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlvla3 sft: --verify-data:"), proc.stderr
    assert DATA in lines[0] and "episode 0" in lines[0]
    assert not (tmp_path / "run").exists()
