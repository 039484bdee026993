"""Crash isolation: any ``Env`` in its own child process, killed and restarted on a fault.

Role: a simulator that segfaults, deadlocks in a GL driver or leaks until the OOM killer comes
must cost one episode, not an env worker. ``ProcessEnv`` builds the env inside a child process
(``multiprocessing`` *spawn*: no inherited GL contexts, locks or threads) from a picklable
factory and talks to it over a pipe:

    parent -> child   ("reset", (task_id, init_state_id)) | ("step", actions) | ("describe", None)
                      | ("close", None)
    child -> parent   ("ready", spec) once built, then ("ok", result) | ("error", traceback)

Invariants:
- A ``step`` always returns within ``step_timeout_s`` (plus the time to kill the child, and
  ``start_timeout_s`` for a child that is still building its env after a restart). If the
  child dies or does not answer in time it is killed, a fresh child is started right away (it
  builds its simulator while the caller moves on), ``restarts`` increments, and the step
  returns ``StepResult(truncated=True, fault=...)`` carrying the last good observation.
- A Python exception inside the child's ``step`` is a fault too (the episode is truncated, the
  simulator state is not trusted); the child stays up because the next ``reset`` rebuilds it.
- ``reset`` retries a crashed or hung child up to ``reset_retries`` times on fresh children, so
  the next episode starts on a working simulator; an exception raised by the env's own
  ``reset`` (a bad task id, say) is re-raised in the parent, not retried.
- The child's stdout goes to stderr, so a command whose stdout is JSON stays parseable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from rlvla3.protocols import Env
from rlvla3.types import EnvSpec, Observation, StepResult


class EnvProcessError(RuntimeError):
    """The env process failed in a way a retry did not fix."""


def _child_main(conn: Connection, factory: Callable[..., Env], kwargs: Mapping[str, Any]) -> None:
    """Child loop: build the env, then serve commands until ``close`` or a closed pipe."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        env = factory(**kwargs)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", env.spec))
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):
            break
        if command == "close":
            break
        try:
            result: Observation | StepResult | dict[str, Any]
            if command == "reset":
                result = env.reset(*payload)
            elif command == "step":
                result = env.step(payload)
            elif command == "describe":
                describe = getattr(env, "describe", None)
                result = describe() if describe is not None else {}
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    env.close()
    conn.close()


class _Fault(Exception):
    """The child died or hung; ``str`` says which."""


class ProcessEnv:
    """An ``Env`` whose simulator lives in a child process; see the module docstring."""

    def __init__(
        self,
        factory: Callable[..., Env],
        kwargs: Mapping[str, Any] | None = None,
        spec: EnvSpec | None = None,
        step_timeout_s: float = 60.0,
        reset_timeout_s: float = 300.0,
        reset_retries: int = 2,
        start_timeout_s: float = 600.0,
    ):
        self._factory = factory
        self._kwargs = dict(kwargs or {})
        self.step_timeout_s = step_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.reset_retries = reset_retries
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        """Children killed and replaced after a crash or hang."""
        self.faults: list[str] = []
        """What each fault was, in order."""
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._last_obs: Observation | None = None
        self._start()
        self.spec = spec if spec is not None else self._receive_ready(start_timeout_s)

    @property
    def pid(self) -> int | None:
        """Process id of the current child (tests kill it to simulate a crash)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_child_main, args=(child, self._factory, self._kwargs), daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        self._ready = False

    def _kill(self) -> None:
        if self._proc is not None and self._proc.pid is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self._ready = None, None, False

    def _restart(self, why: str) -> None:
        self._kill()
        self.restarts += 1
        self.faults.append(why)
        self._start()

    def _receive(self, timeout: float, what: str) -> tuple[str, Any]:
        """The child's next message, or ``_Fault`` if it dies or stays silent past ``timeout``."""
        assert self._conn is not None and self._proc is not None
        ready = wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise _Fault(f"{what} hung for more than {timeout:.0f} s")
        if self._conn in ready or self._conn.poll():
            try:
                return self._conn.recv()
            except (EOFError, OSError):
                pass
        self._proc.join(timeout=1)
        raise _Fault(f"simulator process died during {what} (exit code {self._proc.exitcode})")

    def _wait_ready(self, timeout: float) -> None:
        if not self._ready:
            self._receive_ready(timeout)

    def _receive_ready(self, timeout: float) -> EnvSpec:
        kind, payload = self._receive(timeout, "start")
        if kind != "ready":
            raise EnvProcessError(f"env process failed to start:\n{payload}")
        self._ready = True
        return payload

    def _call(self, command: str, payload: Any, timeout: float) -> tuple[str, Any]:
        self._wait_ready(self.start_timeout_s)
        assert self._conn is not None
        try:
            self._conn.send((command, payload))
        except (BrokenPipeError, OSError) as exc:
            raise _Fault(f"simulator process gone before {command} ({exc})") from None
        return self._receive(timeout, command)

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        for attempt in range(self.reset_retries + 1):
            try:
                kind, payload = self._call("reset", (task_id, init_state_id), self.reset_timeout_s)
            except _Fault as fault:
                self._restart(str(fault))
                if attempt == self.reset_retries:
                    raise EnvProcessError(f"reset failed {attempt + 1} times: {fault}") from None
                continue
            if kind == "error":
                raise EnvProcessError(f"env reset raised in the env process:\n{payload}")
            self._last_obs = payload
            return payload
        raise AssertionError("unreachable")

    def step(self, actions: np.ndarray) -> StepResult:
        try:
            kind, payload = self._call("step", np.asarray(actions), self.step_timeout_s)
        except _Fault as fault:
            self._restart(str(fault))
            return self._fault_result(str(fault))
        if kind == "error":
            self.faults.append(payload.strip().splitlines()[-1])
            return self._fault_result(payload.strip().splitlines()[-1])
        self._last_obs = payload.obs
        return payload

    def describe(self) -> dict[str, Any]:
        """The child env's ``describe()`` (renderer, control rate); ``{"error": ...}`` on a
        fault (the child is then restarted like after a failed step)."""
        try:
            kind, payload = self._call("describe", None, self.step_timeout_s)
        except _Fault as fault:
            self._restart(str(fault))
            return {"error": str(fault)}
        return payload if kind == "ok" else {"error": payload.strip().splitlines()[-1]}

    def _fault_result(self, why: str) -> StepResult:
        if self._last_obs is None:
            raise EnvProcessError(f"step() before a successful reset(): {why}")
        return StepResult(self._last_obs, 0.0, False, True, False, 0, fault=why)

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(("close", None))
                self._proc.join(timeout=10)
            except (BrokenPipeError, OSError):
                pass
        self._kill()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._kill()
