"""ProcessEnv: a crash, a hang or an exception in the env process truncates one episode only."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from envs.process_env import EnvProcessError, ProcessEnv
from rlvla3.types import EnvSpec, Observation, StepResult

SPEC = EnvSpec(("cam",), (4, 4), 2, 1, 2, 10, 3, 5)


class CounterEnv:
    """A tiny deterministic env; action values 7, 8 and 9 crash, hang and raise."""

    spec = SPEC

    def __init__(self, start: int = 0):
        self.count = start
        self.task = 0

    def _obs(self) -> Observation:
        image = np.full((4, 4, 3), self.count % 256, dtype=np.uint8)
        state = np.array([self.task, self.count], dtype=np.float32)
        return Observation({"cam": image}, state, f"task {self.task} pid {os.getpid()}")

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        if task_id >= SPEC.num_tasks:
            raise IndexError(f"no task {task_id}")
        self.task, self.count = task_id, init_state_id
        return self._obs()

    def step(self, actions: np.ndarray) -> StepResult:
        for a in actions[:, 0]:
            if a == 7:
                os._exit(3)
            if a == 8:
                time.sleep(3600)
            if a == 9:
                raise FloatingPointError("simulation unstable")
            self.count += 1
        return StepResult(self._obs(), float(len(actions)), False, False, False, len(actions))

    def close(self) -> None:
        pass


def _env(**kw) -> ProcessEnv:
    return ProcessEnv(CounterEnv, {"start": 0}, spec=SPEC, **kw)


def test_runs_env_in_a_child_process_and_returns_its_results():
    env = _env()
    try:
        obs = env.reset(1, 3)
        assert env.pid != os.getpid()
        assert obs.instruction == f"task 1 pid {env.pid}"
        res = env.step(np.zeros((2, 1)))
        assert res.steps == 2 and res.reward == 2.0 and not res.truncated and res.fault == ""
        assert res.obs.state.tolist() == [1.0, 5.0]
        assert env.restarts == 0
    finally:
        env.close()


def test_spec_comes_from_the_child_when_not_given():
    env = ProcessEnv(CounterEnv, {})
    try:
        assert env.spec == SPEC
    finally:
        env.close()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_dead_child_truncates_the_episode_and_is_restarted(how):
    env = _env()
    try:
        env.reset(0, 0)
        first = env.pid
        env.step(np.zeros((2, 1)))
        if how == "sigkill":
            os.kill(first, signal.SIGKILL)
            res = env.step(np.zeros((2, 1)))
        else:
            res = env.step(np.array([[0.0], [7.0]]))
        assert res.truncated and not res.terminated and "died" in res.fault
        assert res.obs.state.tolist() == [0.0, 2.0]  # the last good observation
        assert env.restarts == 1 and env.faults == [res.fault]
        obs = env.reset(2, 1)
        assert env.pid != first and obs.state.tolist() == [2.0, 1.0]
        assert env.step(np.zeros((2, 1))).fault == ""
    finally:
        env.close()


def test_hung_child_is_killed_after_the_step_timeout():
    env = _env(step_timeout_s=1.0)
    try:
        env.reset(0, 0)
        first = env.pid
        t0 = time.monotonic()
        res = env.step(np.array([[8.0]]))
        assert time.monotonic() - t0 < 10
        assert res.truncated and "hung" in res.fault and env.restarts == 1
        env.reset(0, 0)
        assert env.pid != first
        assert env.step(np.zeros((1, 1))).steps == 1
    finally:
        env.close()


def test_exception_in_step_is_a_fault_without_restart():
    env = _env()
    try:
        env.reset(0, 0)
        res = env.step(np.array([[9.0]]))
        assert res.truncated and "FloatingPointError: simulation unstable" in res.fault
        assert env.restarts == 0
        assert env.reset(1, 0).state.tolist() == [1.0, 0.0]
    finally:
        env.close()


def test_error_in_env_reset_is_raised_not_retried():
    env = _env()
    try:
        with pytest.raises(EnvProcessError, match="no task 5"):
            env.reset(5, 0)
        assert env.restarts == 0
    finally:
        env.close()


def test_close_ends_the_child():
    env = _env()
    env.reset(0, 0)
    proc = env._proc
    env.close()
    assert proc is not None and not proc.is_alive()
