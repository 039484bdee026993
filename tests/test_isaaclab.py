"""The Isaac Lab adapter's slot mapping, against an in-process batched env with Isaac Lab's
interface (``reset(env_ids=...)``, ``step(actions)`` -> obs dict, reward, terminated, truncated,
extras; auto-reset of finished sub-envs; ``termination_manager.get_term``)."""

from __future__ import annotations

import threading
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from envs.isaaclab import (
    INSTALL_HINT,
    IsaacLabConfig,
    isaaclab_spec,
    make_isaaclab_env,
    slots_over,
)
from rlvla3.config import ConfigError


class _Terminations:
    def __init__(self, env: LineWorld):
        self.env = env

    def get_term(self, name: str) -> torch.Tensor:
        assert name == "reached"
        return self.env.reached


class LineWorld:
    """``N`` points on a line: an action moves a point; reaching ``goal`` terminates (success),
    ``max_episode_length`` steps truncate; finished sub-envs reset themselves, as in Isaac Lab."""

    def __init__(self, num_envs: int = 4, goal: float = 3.0, max_len: int = 6):
        self.num_envs = num_envs
        self.device = "cpu"
        self.max_episode_length = max_len
        self.goal = goal
        self.pos = torch.zeros(num_envs)
        self.length = torch.zeros(num_envs, dtype=torch.long)
        self.reached = torch.zeros(num_envs, dtype=torch.bool)
        self.termination_manager = _Terminations(self)
        self.step_calls = 0
        self.reset_ids: list[list[int]] = []
        self.closed = False

    def _obs(self) -> dict:
        ids = torch.arange(self.num_envs, dtype=torch.float32)
        state = torch.stack([self.pos, self.length.float(), ids], dim=-1)
        image = (self.pos / 10).clamp(0, 1)[:, None, None, None].expand(-1, 2, 2, 4).clone()
        return {"policy": state, "rgb": {"front": image}}

    def reset(self, seed=None, env_ids=None, options=None):
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids
        self.reset_ids.append(ids.tolist())
        self.pos[ids] = 0.0
        self.length[ids] = 0
        return self._obs(), {}

    def step(self, actions: torch.Tensor):
        assert actions.shape == (self.num_envs, 2)
        self.step_calls += 1
        self.pos += actions[:, 0]
        self.length += 1
        reward = actions[:, 0].clone()
        self.reached = self.pos >= self.goal
        terminated = self.reached.clone()
        truncated = self.length >= self.max_episode_length
        done = terminated | truncated
        self.pos[done] = 0.0
        self.length[done] = 0
        return self._obs(), reward, terminated, truncated, {"log": {}}

    def close(self) -> None:
        self.closed = True


CFG = IsaacLabConfig(
    num_envs=4,
    device="cpu",
    chunk_len=3,
    action_dim=2,
    cameras={"front": "rgb/front"},
    enable_cameras=True,
    instruction="reach the goal",
    success_term="reached",
)


def _chunk(value: float, n: int = 3) -> np.ndarray:
    return np.tile([value, 0.0], (n, 1)).astype(np.float32)


def test_slots_map_onto_sub_envs_and_idle_slots_hold():
    world = LineWorld()
    slots = slots_over(world, CFG)
    assert slots[0].spec.state_dim == 3 and slots[0].spec.max_decisions == 2  # ceil(6 / 3)
    obs = slots[2].reset(0, 0)
    assert obs.state.tolist() == [0.0, 0.0, 2.0] and obs.instruction == "reach the goal"
    assert obs.images["front"].shape == (2, 2, 3) and obs.images["front"].dtype == np.uint8
    results = slots[0].lockstep.batch.step({1: _chunk(0.5), 2: _chunk(0.25)})
    assert set(results) == {1, 2} and world.step_calls == 3
    assert results[1].reward == pytest.approx(1.5) and results[2].reward == pytest.approx(0.75)
    assert results[1].obs.state.tolist() == [1.5, 3.0, 1.0]
    assert results[2].obs.state[2] == 2.0 and results[1].steps == 3
    assert world.pos[0] == 0.0 and world.pos[3] == 0.0  # not in the call: held still
    assert results[1].obs.images["front"][0, 0, 0] == round(0.15 * 255)


def test_episode_ends_inside_a_chunk_with_success_and_slot_reset_is_not_repeated():
    world = LineWorld()
    batch = slots_over(world, CFG)[0].lockstep.batch
    world.reset_ids.clear()
    res = batch.step({0: _chunk(2.0), 1: _chunk(0.1)})[0]
    # 2.0 then 4.0 >= goal at the second step: it ends there; the rest of the chunk holds.
    assert res.terminated and res.success and not res.truncated
    assert res.steps == 2 and res.reward == pytest.approx(4.0)
    assert world.pos[0] == 0.0  # auto-reset, then held at zero for the third step
    assert batch._stale[0]  # it moved (held) after its auto-reset: a slot reset resets it
    batch.reset(0)
    assert world.reset_ids == [[0]]
    res = batch.step({0: _chunk(3.0, 3)})[0]
    assert res.steps == 1 and res.success
    batch.reset(0)  # auto-reset happened at the last executed step: no second reset
    assert world.reset_ids == [[0]]


def test_time_limit_truncates_without_success():
    world = LineWorld(max_len=4)
    batch = slots_over(world, CFG)[0].lockstep.batch
    first = batch.step({3: _chunk(0.1)})[3]
    second = batch.step({3: _chunk(0.1)})[3]
    assert not first.truncated and first.steps == 3
    assert second.truncated and not second.terminated and not second.success
    assert second.steps == 1 and second.reward == pytest.approx(0.1)


def test_slot_threads_step_the_batched_env_together():
    world = LineWorld(num_envs=3, max_len=100, goal=1e9)
    slots = slots_over(world, IsaacLabConfig(num_envs=3, device="cpu", chunk_len=2, action_dim=2))
    rounds, finals = 5, {}
    for slot in slots:  # every slot is in an episode before any steps
        slot.reset(0, 0)

    def run(slot):
        for _ in range(rounds):
            result = slot.step(_chunk(1.0 + slot.slot, 2))
        finals[slot.slot] = result

    threads = [threading.Thread(target=run, args=(s,)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert world.step_calls == rounds * 2  # one batched step per round, not one per slot
    for i in range(3):
        assert finals[i].obs.state.tolist() == [rounds * 2 * (1.0 + i), rounds * 2, i]
    for s in slots:
        s.close()
    assert world.closed


def test_a_slot_that_never_submits_does_not_block_the_others_forever():
    world = LineWorld(num_envs=2, max_len=100, goal=1e9)
    cfg = IsaacLabConfig(num_envs=2, device="cpu", chunk_len=1, action_dim=2, gather_timeout_s=0.2)
    slots = slots_over(world, cfg)
    slots[0].reset(0, 0)
    slots[1].reset(0, 0)  # active, but it will not step
    result = slots[0].step(_chunk(1.0, 1))
    assert result.steps == 1 and world.pos.tolist() == [1.0, 0.0]


def test_spec_and_validation():
    spec = isaaclab_spec({"state_dim": 9, "max_decisions": 50, "action_dim": 7, "chunk_len": 4})
    assert (spec.state_dim, spec.action_dim, spec.chunk_len, spec.num_tasks) == (9, 7, 4, 1)
    with pytest.raises(ConfigError, match="state_dim"):
        isaaclab_spec({"max_decisions": 5})
    with pytest.raises(ConfigError, match="enable_cameras"):
        isaaclab_spec({"state_dim": 3, "max_decisions": 5, "cameras": {"front": "rgb/front"}})


@pytest.mark.skipif(find_spec("isaaclab") is not None, reason="Isaac Lab is installed here")
def test_without_isaaclab_the_error_says_what_to_install():
    with pytest.raises(ImportError) as info:
        make_isaaclab_env({"num_envs": 2}, "env.options", 0)
    assert INSTALL_HINT in str(info.value) and "pip install isaaclab" in str(info.value)
