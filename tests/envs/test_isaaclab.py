"""The Isaac Lab adapter: the batched step for many slots, the server process and its shared
memory, its faults and restarts, and (where the Isaac Lab environment is built) the real task.

Most tests run the real server (``envs.isaaclab.server``) in this interpreter on a torch-only
task with Isaac Lab's batched interface (``tests/support/isaaclab_standin.py``): the process boundary,
the shared memory and the fault handling are the production code. The last tests run Isaac Lab
itself (Newton, kit-less, CPU) and are skipped, and counted, where its environment is missing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from envs import check_training_split, eval_env, missing_extra, require_extra
from envs.isaaclab import setup
from envs.isaaclab.batched import BatchedSlots, spec_of
from envs.isaaclab.client import IsaacLabServer, ServerConfig
from envs.isaaclab.env import IsaacLabConfig, isaaclab_spec, make_isaaclab_env, server_config
from envs.isaaclab.slots import ServerSlots, slots_over
from envs.isaaclab.wire import Layout
from envs.process_env import EnvProcessError
from rlvla3.config import ConfigError, Named, build
from rlvla3.types import EnvSpec

ROOT = Path(__file__).resolve().parents[2]
STANDIN = "tests.support.isaaclab_standin:DEFINITION"


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
    """The server imports the stand-in from ``tests/``."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _spec(n: int = 4, chunk: int = 3) -> EnvSpec:
    return EnvSpec(cameras=("front",), image_size=(2, 2), state_dim=3, action_dim=2,
                   chunk_len=chunk, max_decisions=2, num_tasks=2, num_init_states=100)


def _server(n: int = 4, chunk: int = 3, **kw) -> ServerSlots:
    cfg = ServerConfig(task=STANDIN, num_envs=n, cameras=("front",), chunk_len=chunk,
                       python=sys.executable, start_timeout_s=120, **kw)
    return ServerSlots(IsaacLabServer(cfg), _spec(n, chunk), layout_of=lambda k: k)


def _chunk(value: float, n: int = 3, code: float = 0.0) -> np.ndarray:
    return np.tile([value, code], (n, 1)).astype(np.float32)


def test_batched_step_accounts_each_sub_env_and_holds_the_others():
    from tests.support.isaaclab_standin import LineTask

    task = LineTask({"num_envs": 4, "cameras": ["front"], "max_steps": 0})
    layout = Layout(spec_of(task, 3), bytearray(Layout(spec_of(task, 3)).nbytes))
    batched = BatchedSlots(task, 3, layout)
    batched.reset([1, 2], [0, 1], [0, 50])
    assert layout["state"][2].tolist() == [0.5, 0.0, 2.0]
    layout["actions"][:] = 0.0
    layout["actions"][:, 1] = _chunk(0.5)
    layout["actions"][:, 2] = _chunk(2.0)
    batched.step([1, 2])
    assert task.step_calls == 3 and task.pos[0] == 0.0 and task.pos[3] == 0.0  # held
    assert layout["reward"][1] == pytest.approx(1.5) and layout["steps"][1] == 3
    assert layout["state"][1].tolist() == [1.5, 3.0, 1.0]
    # 0.5 + 2.0 + 2.0 >= 3 at the second step: the episode ends there, the rest is held
    assert layout["steps"][2] == 2 and layout["reward"][2] == pytest.approx(4.0)
    assert layout["flags"][2].tolist() == [1, 0, 1] and layout["flags"][1].tolist() == [0, 0, 0]
    assert layout.image("front")[1, 0, 0, 0] == round(0.15 * 255)


def test_a_server_process_serves_slots_through_shared_memory():
    batch = _server()
    try:
        assert batch.server.spec.num_envs == 4 and batch.server.pid != os.getpid()
        obs = batch.reset(2, 1, 25)
        assert obs.instruction == "reach the goal again" and obs.state.tolist() == [0.25, 0, 2]
        assert obs.images["front"].shape == (2, 2, 3) and obs.images["front"].dtype == np.uint8
        batch.reset(1, 0, 0)
        results = batch.step({1: _chunk(0.5), 2: _chunk(2.0)})
        assert results[1].reward == pytest.approx(1.5) and results[1].steps == 3
        assert not results[1].terminated and results[1].obs.state.tolist() == [1.5, 3.0, 1.0]
        assert results[2].terminated and results[2].success and results[2].steps == 2
        assert obs.state.tolist() == [0.25, 0, 2]  # an observation is a copy, not a view
        limit = batch.step({1: _chunk(0.1)})[1]  # 6 steps: the time limit
        assert limit.truncated and not limit.terminated and not limit.success
        assert batch.server.describe()["task"] == STANDIN
    finally:
        batch.close()
    assert batch.server.pid is None


def test_slot_threads_step_the_server_together():
    batch = _server(n=3, chunk=2, max_steps=100)
    slots = slots_over(batch, gather_timeout_s=30.0)
    for slot in slots:
        slot.reset(0, 0)
    finals = {}

    def run(slot):
        for _ in range(5):
            finals[slot.slot] = slot.step(_chunk(0.1 + 0.1 * slot.slot, 2))

    threads = [threading.Thread(target=run, args=(s,)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert batch.server.describe()  # still up
    for i in range(3):
        assert finals[i].obs.state[1] == 10  # one batched step per round: 5 rounds x 2
        assert finals[i].obs.state[0] == pytest.approx(10 * (0.1 + 0.1 * i), abs=1e-5)
    for s in slots:
        s.close()
    assert batch.server.pid is None


def test_a_slot_held_past_the_gather_window_is_not_continued_on_a_reset_scene():
    """Slot 1's actions come later than the gather window: slot 0's rounds step the simulator
    without it, its sub-env's clock runs out and the task resets it by itself. Slot 1's next
    step must end its episode truncated with the reason, on the last observation it saw, not
    continue on the reset scene; rounds after the first no longer wait for it."""
    batch = _server(n=2)  # chunks of 3 steps, episodes of 6
    slots = slots_over(batch, gather_timeout_s=0.5)
    try:
        slots[0].reset(0, 0)
        before = slots[1].reset(1, 10)
        first = slots[0].step(_chunk(0.1))  # waits for slot 1, then runs without it
        t0 = time.monotonic()
        second = slots[0].step(_chunk(0.1))
        alone = time.monotonic() - t0
        assert not first.fault and second.truncated and not second.fault  # its own time limit
        late = slots[1].step(_chunk(0.1))
        assert late.truncated and not late.terminated and late.steps == 0
        assert "gather_timeout_s" in late.fault
        assert late.obs.state.tolist() == before.state.tolist()  # its last good observation
        assert late.obs.instruction == "reach the goal again"
        assert alone < 0.5  # slot 1 is out of its episode: nobody waits for it any more
        again = slots[1].reset(1, 20)  # a new episode on the slot steps normally
        assert again.state[0] == pytest.approx(0.2)
        assert slots[1].step(_chunk(0.1)).steps == 3
    finally:
        for slot in slots:
            slot.close()


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_dead_server_truncates_the_round_and_is_replaced(how):
    batch = _server(n=2)
    try:
        batch.reset(0, 0, 10)
        batch.reset(1, 0, 10)
        pid = batch.server.pid
        if how == "sigkill":
            os.kill(pid, signal.SIGKILL)
            results = batch.step({0: _chunk(0.1), 1: _chunk(0.1)})
        else:
            results = batch.step({0: _chunk(0.1, code=7), 1: _chunk(0.1)})
        for r in results.values():
            assert r.truncated and not r.terminated and "died" in r.fault
            assert r.obs.state.tolist()[0] == pytest.approx(0.1)  # the last good observation
        assert batch.server.restarts == 1 and batch.server.pid not in (None, pid)
        assert batch.reset(0, 0, 20).state[0] == pytest.approx(0.2)
        assert batch.step({0: _chunk(0.1)})[0].steps == 3  # the new server steps
    finally:
        batch.close()


def test_an_episode_of_a_lost_server_is_not_continued_on_its_replacement():
    batch = _server(n=2)
    try:
        batch.reset(0, 0, 0)
        batch.reset(1, 0, 0)
        os.kill(batch.server.pid, signal.SIGKILL)
        batch.step({0: _chunk(0.1)})  # slot 1 sat this round out
        late = batch.step({1: _chunk(0.1)})[1]
        assert late.truncated and "restarted" in late.fault and late.steps == 0
    finally:
        batch.close()


def test_a_hung_server_is_killed_after_the_step_timeout():
    batch = _server(n=1, step_timeout_s=2.0)
    try:
        batch.reset(0, 0, 0)
        t0 = time.monotonic()
        result = batch.step({0: _chunk(0.1, code=8)})[0]
        assert result.truncated and "hung" in result.fault
        assert time.monotonic() - t0 < 60 and batch.server.restarts == 1
    finally:
        batch.close()


def _servers_running() -> list[int]:
    """Isaac Lab server processes this test process started that still run."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "envs.isaaclab.server" in " ".join(p.cmdline())]


def test_a_replacement_that_hangs_at_start_is_killed_and_named_within_its_bound(tmp_path):
    """The server dies and its replacement hangs while it builds: the round ends at once with
    the public fault (no wait for the replacement), the next reset tries fresh servers for at
    most ``restart_timeout_s`` each and then raises ``EnvProcessError`` naming the hang, with
    no hung process left; once starts work again, a reset brings a server back."""
    hang = tmp_path / "hang"
    batch = _server(n=2, restart_timeout_s=10.0, reset_retries=1,
                    gym={"hang_at_start_if": str(hang)})
    try:
        batch.reset(0, 0, 0)
        batch.reset(1, 0, 0)
        hang.touch()
        os.kill(batch.server.pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = batch.step({0: _chunk(0.1), 1: _chunk(0.1)})
        assert time.monotonic() - t0 < 5.0  # the replacement is not waited for here
        assert all(r.truncated and "died" in r.fault for r in results.values())
        t0 = time.monotonic()
        with pytest.raises(EnvProcessError,
                           match=r"reset failed 2 times: .*start of a replacement hung for "
                                 r"more than 10 s"):
            batch.reset(0, 0, 0)
        assert time.monotonic() - t0 < 40  # two tries of 10 s, plus killing them
        assert batch.server.pid is None and _servers_running() == []
        hang.unlink()
        assert batch.reset(0, 0, 5).state[0] == pytest.approx(0.05)
        assert batch.step({0: _chunk(0.1)})[0].steps == 3
        assert batch.step({1: _chunk(0.1)})[1].fault  # its episode was on a lost server
    finally:
        batch.close()
    assert _servers_running() == []


def test_a_first_server_that_hangs_at_start_is_one_public_error_and_killed(tmp_path):
    hang = tmp_path / "hang"
    hang.touch()
    cfg = ServerConfig(task=STANDIN, python=sys.executable, start_timeout_s=2.0,
                       gym={"hang_at_start_if": str(hang)})
    with pytest.raises(EnvProcessError, match="failed to start: .*start hung for more than 2 s"):
        IsaacLabServer(cfg)
    assert _servers_running() == []


def test_an_exception_in_a_step_is_a_fault_without_a_restart():
    batch = _server(n=1)
    try:
        batch.reset(0, 0, 0)
        pid = batch.server.pid
        result = batch.step({0: _chunk(0.1, code=9)})[0]
        assert result.truncated and "the simulator raised" in result.fault
        assert batch.server.restarts == 0 and batch.server.pid == pid
    finally:
        batch.close()


def test_a_task_that_fails_to_build_is_one_error_not_a_hang(capsys):
    """One line names the fault; the server's traceback is kept in a file the stderr names,
    not poured onto the console."""
    cfg = ServerConfig(task="tests.support.isaaclab_standin:NO_SUCH_TASK", python=sys.executable,
                       start_timeout_s=60)
    with pytest.raises(EnvProcessError, match="failed to start.*NO_SUCH_TASK"):
        IsaacLabServer(cfg)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    kept = err.split("its traceback: ")[1].split()[0]
    assert "Traceback" in open(kept).read()


def test_config_spec_split_and_errors():
    spec = isaaclab_spec({"task": "reach", "chunk_len": 4})
    assert (spec.state_dim, spec.action_dim, spec.num_tasks, spec.max_decisions) == (10, 3, 3, 10)
    assert spec.cameras == ("front", "wrist") and spec.num_init_states == 10_000
    assert isaaclab_spec({"task": "reach", "split": "test"}).num_init_states == 50
    assert isaaclab_spec({"task": "cartpole", "chunk_len": 1}).max_decisions == 300
    cfg = IsaacLabConfig(split="test")
    assert cfg.layout(3) == 1_000_003 and IsaacLabConfig().layout(3) == 3
    with pytest.raises(IndexError):
        cfg.layout(50)
    with pytest.raises(ConfigError, match="env.options.task.*unknown task 'lift'"):
        isaaclab_spec({"task": "lift"})
    with pytest.raises(ConfigError, match="env.options.cameras"):
        isaaclab_spec({"task": "cartpole", "cameras": ["front"]})
    with pytest.raises(ConfigError, match="state_dim"):
        isaaclab_spec({"task": "Isaac-Lift-Cube-Franka-v0"})
    train = Named("isaaclab", {"task": "reach"})
    check_training_split(train)
    assert eval_env(train).options["split"] == "test"
    with pytest.raises(ConfigError, match="env.options.split"):
        check_training_split(eval_env(train))


def test_reach_task_options_shape_the_state_and_reach_the_server():
    assert isaaclab_spec({"task": "reach", "task_options": {"state": "cubes"}}).state_dim == 19
    assert isaaclab_spec({"task": "reach", "task_options": {"state": "target"}}).state_dim == 13
    spec = isaaclab_spec({"task": "reach", "task_ids": [2, 0], "cameras": []})
    assert spec.num_tasks == 2 and spec.cameras == ()
    cfg = build(IsaacLabConfig, {"task": "reach", "task_ids": [2, 0], "reward": "sparse",
                                 "task_options": {"state": "cubes", "max_move": 0.05}},
                "env.options")
    assert (cfg.variant(0), cfg.variant(1)) == (2, 0)
    sent = server_config(cfg, 0).message()["options"]["task_options"]
    assert sent == {"state": "cubes", "max_move": 0.05, "progress_scale": 0.0,
                    "success_bonus": 1.0}  # sparse: the success alone
    for options, field in (({"task_options": {"stat": "cubes"}}, "task_options"),
                           ({"task_options": {"state": "pixels"}}, "task_options.state"),
                           ({"task_options": {"max_move": 0}}, "task_options.max_move"),
                           ({"reward": "dense"}, "reward"), ({"task_ids": [3]}, "task_ids")):
        with pytest.raises(ConfigError, match=f"env.options.{field}"):
            isaaclab_spec({"task": "reach", **options})
    with pytest.raises(ConfigError, match="env.options.reward"):
        isaaclab_spec({"task": "cartpole", "reward": "sparse"})


def test_without_the_isaaclab_environment_the_error_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RLVLA3_ENVS", str(tmp_path))
    why = missing_extra("isaaclab", {})
    assert "python -m rlvla3 envs setup isaaclab" in why
    with pytest.raises(ConfigError, match="envs setup isaaclab"):
        require_extra(Named("isaaclab", {}))
    with pytest.raises(EnvProcessError, match="envs setup isaaclab"):
        make_isaaclab_env({"task": "reach", "num_envs": 1})
    assert "does not exist" in missing_extra("isaaclab", {"python": str(tmp_path / "py")})


needs_isaaclab = pytest.mark.skipif(
    setup.located() is None,
    reason="the Isaac Lab environment is not built here (python -m rlvla3 envs setup isaaclab)")


@pytest.mark.slow
@needs_isaaclab
def test_isaaclab_reach_rollout_on_newton_kitless():
    """The real task: Isaac Lab 3.0, Newton physics on Warp's CPU device, two cameras."""
    cfg = IsaacLabConfig(task="reach", num_envs=2, chunk_len=4)
    slots = [make_isaaclab_env({"task": "reach", "num_envs": 2, "chunk_len": 4}, seed=0)
             for _ in range(2)]
    try:
        info = slots[0].describe()
        assert info["isaaclab"].startswith("3.") and info["device"] == "cpu" and not info["kit"]
        obs = [slot.reset(k, 7) for k, slot in enumerate(slots)]
        assert obs[0].instruction == "reach the red cube"
        assert obs[1].instruction == "reach the green cube"
        for o in obs:
            assert o.images["front"].shape == (64, 64, 3) and o.images["wrist"].shape == (64, 64, 3)
            assert o.images["front"].std() > 5  # a rendered scene, not a blank frame
        assert np.allclose(obs[0].state[:3], obs[1].state[:3], atol=1e-3)  # the same home pose
        # the same layout puts the cubes at the same places for both: same front image
        assert np.abs(obs[0].images["front"].astype(int) - obs[1].images["front"]).mean() < 1
        threads, results = [], {}
        for k, slot in enumerate(slots):
            move = np.tile([0.0, 0.0, -1.0], (4, 1)) if k else np.zeros((4, 3))

            def run(slot=slot, move=move, k=k):
                results[k] = slot.step(move)
            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert results[0].steps == results[1].steps == 4 and not results[1].fault
        drop = obs[1].state[2] - results[1].obs.state[2]
        assert 0.06 < drop < 0.16  # about 3 cm a step down; the held arm stays put
        assert abs(obs[0].state[2] - results[0].obs.state[2]) < 0.01
        assert cfg.layout(7) == 7
    finally:
        for slot in slots:
            slot.close()


@pytest.mark.slow
@needs_isaaclab
def test_isaaclab_stock_cartpole_runs_kitless_on_a_local_usd():
    """The smallest check: Isaac Lab's own Cartpole task, its USD from Newton's package."""
    slot = make_isaaclab_env({"task": "cartpole", "num_envs": 1, "chunk_len": 10}, seed=0)
    try:
        first = slot.reset(0, 3)
        again = slot.reset(0, 3)
        assert first.instruction == "balance the pole" and first.state.shape == (4,)
        assert np.allclose(first.state, again.state)  # a layout seeds the initial state
        assert not np.allclose(first.state, slot.reset(0, 4).state)
        result = slot.step(np.zeros((10, 1)))
        assert result.steps == 10 and not result.fault and result.reward != 0.0
    finally:
        slot.close()


@pytest.mark.slow
@needs_isaaclab
def test_reach_privileged_states_let_an_oracle_succeed_for_a_sparse_reward():
    """The privileged state modes hold what they promise (the target is the named colour's
    cube), and a controller that reads them solves the reach: the task is solvable as built,
    and the sparse reward pays exactly the success."""
    slots = [make_isaaclab_env({"task": "reach", "num_envs": 1, "chunk_len": 4, "cameras": [],
                                "reward": "sparse", "task_options": {"state": state}}, seed=0)
             for state in ("target", "cubes")]
    try:
        target, cubes = slots[0].reset(1, 5), slots[1].reset(1, 5)
        assert target.instruction == cubes.instruction == "reach the green cube"
        assert np.allclose(target.state[10:13], cubes.state[10:19].reshape(3, 3)[1], atol=1e-5)
        obs, rewards = target, []
        for _ in range(10):
            move = np.clip((obs.state[10:13] - obs.state[:3]) / 0.03, -1, 1)
            result = slots[0].step(np.tile(move, (4, 1)).astype(np.float32))
            rewards.append(result.reward)
            obs = result.obs
            if result.terminated or result.truncated:
                break
        assert result.success and result.terminated and rewards[-1] == 1.0
        assert rewards[:-1] == [0.0] * (len(rewards) - 1)
    finally:
        for slot in slots:
            slot.close()


@pytest.mark.slow
@needs_isaaclab
def test_eval_judges_a_committed_reach_policy_on_held_out_layouts_and_rechecks(tmp_path):
    """``eval --suite isaaclab_reach`` on the committed reach checkpoint: the test split's
    layouts (never trained on), episode records with Wilson intervals, the suite's identity, and
    ``--recheck`` replaying a sample of its episodes to the same outcomes."""
    import json
    import subprocess
    import sys

    out = tmp_path / "eval"
    run = subprocess.run([sys.executable, "-m", "rlvla3", "eval", "--suite", "isaaclab_reach",
                          "--checkpoint", "results/isaaclab/reach_rl4", "--task-ids", "0", "2",
                          "--episodes-per-task", "2", "--workers", "1", "--videos", "0",
                          "--output-dir", str(out), "--json"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "results.json").read_text())
    records = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["task"] for r in records} == {0, 2}
    assert summary["complete"] and summary["episodes"] == 4 and not summary["training_overlap"]
    assert json.loads((out / "eval.json").read_text())["identity"]["suite"] == "isaaclab_reach"
    low, high = summary["ci95"]
    assert 0.0 <= low <= summary["success_rate"] <= high <= 1.0
    recheck = subprocess.run([sys.executable, "-m", "rlvla3", "eval", "--recheck", str(out),
                              "--sample", "2", "--workers", "1"],
                             capture_output=True, text=True, timeout=900)
    assert recheck.returncode == 0, recheck.stderr[-2000:]
