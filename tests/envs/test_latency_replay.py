"""Latency replay: sampled latencies and episode lengths match the configured workload; files."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import envs
from envs.latency_replay import (
    CAMERA,
    LatencyReplayEnv,
    latency_replay_spec,
    make_latency_replay_env,
    resolve_latency_path,
    summarize_latency,
)
from rlvla3.config import ConfigError
from rlvla3.protocols import Env

TINY = 1e-6
"""A time scale at which sleeps are negligible but ``last_latency_s`` keeps the draw."""


def make(seed: int = 0, **options) -> LatencyReplayEnv:
    """An env on the synthetic model unless the test names a distribution."""
    options.setdefault("distribution", "synthetic")
    return make_latency_replay_env(options, "env.options", seed)


def run_episode(env: LatencyReplayEnv, task_id: int = 0) -> dict:
    """One episode; latencies in ms before ``time_scale``."""
    scale = env.config.time_scale
    env.reset(task_id, 0)
    reset_ms = env.last_latency_s / scale * 1e3
    chunk_ms, results = [], []
    actions = np.zeros((env.spec.chunk_len, env.spec.action_dim), dtype=np.float32)
    while True:
        result = env.step(actions)
        results.append(result)
        chunk_ms.append(env.last_latency_s / scale * 1e3 / result.steps)
        if result.terminated or result.truncated:
            break
    return {
        "reset_ms": reset_ms,
        "step_ms": np.array(chunk_ms),
        "results": results,
        "steps": sum(r.steps for r in results),
    }


def test_spec_defaults_and_protocol():
    env = make(time_scale=0.0)
    assert isinstance(env, Env)
    spec = latency_replay_spec({}, "env.options")
    assert spec == env.spec
    assert (spec.chunk_len, spec.max_decisions) == (5, 44)
    assert spec.image_size == (16, 16) and spec.cameras == (CAMERA,)
    obs = env.reset(3, 0)
    image = obs.images[CAMERA]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8
    assert not image.flags.writeable
    assert obs.state.shape == (8,) and obs.state.dtype == np.float32
    assert obs.instruction == "task 3"
    result = env.step(np.zeros((5, 7), dtype=np.float32))
    assert result.obs.images[CAMERA] is image  # precomputed, no per-step image
    assert result.obs.state[0] == pytest.approx(5 / 220)
    other = env.reset(4, 0).images[CAMERA]
    assert not np.array_equal(other, image)


def test_summary_matches_configured_distribution():
    summary = summarize_latency({"distribution": "synthetic"}, episodes=2000)
    assert summary["source"].startswith("synthetic")
    step, reset = summary["step_ms"], summary["reset_ms"]
    assert 110 < step["mean"] < 130  # scene means uniform in [60, 180] ms
    assert 60 < step["p50"] < 180 and step["p99"] < 180 * 1.3
    assert summary["scene_p99_over_mean"] == pytest.approx(1.2, abs=0.03)
    assert 1500 <= reset["p50"] <= 2300
    assert 2300 < reset["p99"] <= 6000  # the contention tail
    assert 0.45 < summary["success_rate"] < 0.55
    assert 150 < summary["episode_steps"]["mean"] < 200
    assert summary["episode_steps"]["p99"] == 220
    json.dumps(summary)
    scaled = summarize_latency({"distribution": "synthetic", "step_ms_min": 30,
                                "step_ms_max": 30}, episodes=200)
    assert scaled["step_ms"]["mean"] == pytest.approx(30, rel=0.02)


def test_env_draws_match_the_distribution():
    env = make(time_scale=TINY)
    episodes = [run_episode(env, task_id=i % 10) for i in range(300)]
    resets = np.array([e["reset_ms"] for e in episodes])
    assert resets.min() >= 1500 and resets.max() <= 6000
    assert 0.05 < np.mean(resets > 2300) < 0.16
    scene_means = np.array([e["step_ms"].mean() for e in episodes])
    assert scene_means.min() > 55 and scene_means.max() < 190
    assert 110 < scene_means.mean() < 130
    steps = env.model.steps_ms(100.0, np.random.default_rng(0), 100_000)
    assert steps.mean() == pytest.approx(100.0, rel=0.01)
    assert np.percentile(steps, 99) == pytest.approx(120.0, rel=0.02)


def test_episode_lengths_are_those_of_a_half_successful_policy():
    env = make(time_scale=TINY)
    episodes = [run_episode(env) for _ in range(400)]
    last = [e["results"][-1] for e in episodes]
    success = np.array([r.success for r in last])
    assert 0.42 < success.mean() < 0.58
    for e, r in zip(episodes, last, strict=True):
        if r.success:
            assert r.terminated and not r.truncated and r.reward == 1.0
            assert 80 <= e["steps"] <= 200
            assert all(x.reward == 0.0 for x in e["results"][:-1])
        else:
            assert r.truncated and not r.terminated and r.reward == 0.0
            assert e["steps"] == 220 and len(e["results"]) == 44
    lengths = np.array([e["steps"] for e in episodes])[success]
    assert lengths.std() > 20  # spread, not one fixed length
    assert any(r.steps < 5 for r in last)  # the success chunk stops early


def test_seed_determinism_and_actions_are_ignored():
    def trace(seed: int, action: float) -> list:
        env = make(seed, time_scale=TINY)
        out = []
        for _ in range(5):
            env.reset(0, 0)
            out.append(env.last_latency_s)
            while True:
                r = env.step(np.full((5, 7), action, dtype=np.float32))
                out.append((env.last_latency_s, r.steps, r.success))
                if r.terminated or r.truncated:
                    break
        return out

    assert trace(1, 0.0) == trace(1, 0.9)
    assert trace(1, 0.0) != trace(2, 0.0)


def test_sleeps_for_the_scaled_latency():
    env = make(time_scale=0.01)
    start = time.perf_counter()
    env.reset(0, 0)
    elapsed = time.perf_counter() - start
    assert env.last_latency_s <= elapsed < env.last_latency_s + 1.0  # a loaded machine oversleeps
    assert 0.015 <= env.last_latency_s <= 0.06
    start = time.perf_counter()
    env.step(np.zeros((5, 7), dtype=np.float32))
    elapsed = time.perf_counter() - start
    assert elapsed >= env.last_latency_s
    assert 5 * 0.6e-3 * 0.8 < env.last_latency_s < 5 * 1.8e-3 * 1.3


def test_many_slots_overlap_on_few_cores():
    """64 slot threads: their latencies are sleeps that release the interpreter (many slots
    inside a step at one moment) and cost almost no CPU. Overlap is read from the recorded
    call intervals, not from a wall-clock ratio a loaded machine could spoil."""
    slots, sleeps, intervals = 64, [], []
    lock = threading.Lock()

    def slot(seed: int) -> None:
        env = make(seed, time_scale=0.03)
        total, mine = 0.0, []
        env.reset(0, 0)
        total += env.last_latency_s
        for _ in range(10):
            start = time.perf_counter()
            env.step(np.zeros((5, 7), dtype=np.float32))
            mine.append((start, time.perf_counter()))
            total += env.last_latency_s
        with lock:
            sleeps.append(total)
            intervals.extend(mine)

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(slots)]
    cpu = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu
    assert len(sleeps) == slots
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    inside = most_inside = 0
    for _, change in events:
        inside += change
        most_inside = max(most_inside, inside)
    assert most_inside >= slots // 2, f"at most {most_inside} of {slots} slots stepped at once"
    assert cpu < sum(sleeps) / 4  # sleeping, not spinning


def write(path: Path, data) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def measured(**override) -> dict:
    data = {
        "description": "two scenes measured by hand",
        "command": "python measure.py",
        "step_ms": {"fast": [10.0, 10.0, 10.0], "slow": [100.0]},
        "reset_ms": [50.0, 70.0],
    }
    data.update(override)
    return data


def test_file_distribution_replays_samples(tmp_path, monkeypatch):
    path = write(tmp_path / "lat.json", measured())
    env = make(distribution=path, time_scale=TINY)
    episodes = [run_episode(env) for _ in range(40)]
    for e in episodes:
        assert e["reset_ms"] == pytest.approx(50.0) or e["reset_ms"] == pytest.approx(70.0)
        per_step = e["step_ms"]
        assert np.allclose(per_step, 10.0) or np.allclose(per_step, 100.0)
    groups = {round(float(e["step_ms"][0])) for e in episodes}
    assert groups == {10, 100}
    summary = summarize_latency({"distribution": path}, episodes=400)
    assert summary["source"] == "two scenes measured by hand"
    assert summary["reset_ms"]["p50"] in (50.0, 70.0)
    assert summary["step_ms"]["p50"] in (10.0, 100.0)
    monkeypatch.chdir(tmp_path)
    assert make(distribution="lat.json", time_scale=0.0).model.group_names == ("fast", "slow")


def test_relative_paths_fall_back_to_the_envs_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = Path(envs.__file__).parent / "data" / "nothing.json"
    assert resolve_latency_path("data/nothing.json") == expected
    with pytest.raises(ConfigError, match="no such latency file"):
        make(distribution="data/nothing.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "top level must be an object"),
        ({"step_ms": {"a": [1.0]}, "reset_ms": [1.0]}, "missing key"),
        (measured(step_ms={}), "step_ms must be a non-empty object"),
        (measured(step_ms=[1.0, 2.0]), "step_ms must be a non-empty object"),
        (measured(step_ms={"a": []}), "step_ms['a'] must be a non-empty list"),
        (measured(step_ms={"a": [1.0, -3.0]}), "step_ms['a'] must be a non-empty list"),
        (measured(step_ms={"a": ["fast"]}), "step_ms['a'] must be a non-empty list"),
        (measured(reset_ms=[]), "reset_ms must be a non-empty list"),
        (measured(description=3), "description must be a string"),
    ],
)
def test_malformed_file_gives_a_clear_error(tmp_path, content, message):
    path = write(tmp_path / "bad.json", content)
    with pytest.raises(ConfigError) as info:
        latency_replay_spec({"distribution": path}, "env.options")
    assert info.value.field == "env.options.distribution"
    assert message in str(info.value)
    assert "bad.json" in str(info.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"time_scale": -1.0}, "env.options.time_scale"),
        ({"success_steps_max": 221}, "env.options.success_steps_max"),
        ({"success_steps_min": 0}, "env.options.success_steps_max"),
        ({"success_rate": 1.5}, "env.options.success_rate"),
        ({"step_ms_min": 200.0}, "env.options.step_ms_max"),
        ({"reset_tail_ms_max": 2000.0}, "env.options.reset_tail_ms_max"),
        ({"chunk_len": 0}, "env.options.chunk_len"),
        ({"num_tasks": 0}, "env.options.num_tasks"),
        ({"latency": 1}, "env.options.latency"),
    ],
)
def test_config_errors_name_the_field(options, field):
    with pytest.raises(ConfigError) as info:
        latency_replay_spec(options, "env.options")
    assert info.value.field == field


def test_default_distribution_is_libero_measured_here():
    summary = summarize_latency({}, episodes=300)
    assert summary["source"].startswith("LIBERO")
    assert 50 < summary["step_ms"]["p50"] < 400  # a LIBERO step with fast rendering
    assert summary["reset_ms"]["p50"] > 1000  # a hard reset takes seconds
