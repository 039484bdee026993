"""The env worker's side of an Isaac Lab server: start it, talk to it, restart it when it fails.

Role: ``IsaacLabServer`` starts ``envs.isaaclab.server`` in the Isaac Lab environment (the one
``envs.isaaclab.setup`` builds, or ``ServerConfig.python``) with this package on its
``PYTHONPATH`` (a directory of links to ``envs`` and ``rlvla3`` alone, so no installed package
of this interpreter leaks into Python 3.12; an existing ``PYTHONPATH`` follows it), waits for
its ``ready`` spec, creates the shared-memory segment the spec sizes
(``envs.isaaclab.wire.Layout``) and hands it over. Afterwards ``reset`` and ``step`` are one
JSON line each way; the arrays stay in the segment.

Invariants (as ``envs.process_env.ProcessEnv`` keeps them for one env):
- A command returns within ``step_timeout_s``. A server that dies, or stays silent past the
  timeout, is killed with its process group and a fresh one started at once, which builds its
  task while the caller goes on: ``restarts`` counts them, ``faults`` says why, and
  ``generation`` increases, so the slots of the lost server know their episodes are gone.
- The first server must be ready within ``start_timeout_s`` (Warp compiles its kernels then),
  a replacement within ``restart_timeout_s`` (they are compiled), waited for by the next
  command that needs it. A server that fails to come up in time, dies or fails to build is
  killed (no process outlives its fault); the constructor then raises ``EnvProcessError``.
- ``step`` raises ``ServerFault`` on a fault (the caller truncates the episodes of that
  round), and only that; it never waits for a replacement; a Python exception inside the
  server's step is a fault too, without a restart.
- ``reset`` retries a crashed, hung or unstarted server up to ``reset_retries`` times on fresh
  servers, then raises ``EnvProcessError`` naming the fault; an exception raised by the task's
  own reset is re-raised (``EnvProcessError``), not retried.
- The segment belongs to this side: it is unlinked when the server is replaced or closed.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from envs.isaaclab.wire import Layout, ServerSpec, decode, encode
from envs.process_env import EnvProcessError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the ``envs`` and ``rlvla3`` packages."""


@dataclass(frozen=True)
class ServerConfig:
    """One Isaac Lab server: which task, how many sub-envs, where and how it runs."""

    task: str = "reach"
    num_envs: int = 1
    device: str = "cpu"
    cameras: tuple[str, ...] = ()
    image_size: tuple[int, int] = (64, 64)
    max_steps: int = 0
    chunk_len: int = 1
    kit: bool = False
    python: str = ""
    """The interpreter to run the server with; empty: the managed environment's."""
    seed: int = 0
    task_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of one of our tasks (``envs.isaaclab.env.IsaacLabConfig.task_options``)."""
    gym: Mapping[str, Any] = field(default_factory=dict)
    """``state_key``, ``camera_keys``, ``success_term``, ``instruction`` of a Gym task."""
    step_timeout_s: float = 120.0
    start_timeout_s: float = 1200.0
    restart_timeout_s: float = 90.0
    """A replacement server's start (its kernels compiled: about 20 s here)."""
    reset_retries: int = 2

    def message(self) -> dict[str, Any]:
        options = {"num_envs": self.num_envs, "device": self.device,
                   "cameras": list(self.cameras), "image_size": list(self.image_size),
                   "max_steps": self.max_steps, "task_options": dict(self.task_options),
                   **dict(self.gym)}
        return {"task": self.task, "options": options, "chunk_len": self.chunk_len,
                "kit": self.kit, "seed": self.seed}


class ServerFault(RuntimeError):
    """A step the server did not complete (it died, hung or raised); says what happened."""


class _Fault(Exception):
    """The server died, hung or failed to come up; ``str`` says which."""


def _source_dir() -> str:
    """A directory with only ``envs`` and ``rlvla3`` in it (links), for the server's path."""
    digest = hashlib.sha256(str(PACKAGE_ROOT).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"rlvla3-isaaclab-{os.getuid()}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    for package in ("envs", "rlvla3"):
        link = path / package
        if not link.is_symlink():
            tmp = path / f".{package}.{os.getpid()}"
            tmp.symlink_to(PACKAGE_ROOT / package)
            tmp.replace(link)
    return str(path)


def _last_line(answer: Mapping[str, Any]) -> str:
    """The last line of an error answer; the whole traceback goes to a file named on stderr."""
    import tempfile

    text = str(answer.get("error", "")).strip()
    if not text:
        return "no error text"
    with tempfile.NamedTemporaryFile("w", prefix="isaaclab-server-", suffix=".txt",
                                     delete=False) as log:
        log.write(text + "\n")
    print(f"[isaaclab server] its traceback: {log.name}", file=sys.stderr, flush=True)
    return text.splitlines()[-1]


def _interpreter(cfg: ServerConfig) -> tuple[str, dict[str, str]]:
    """The server's interpreter and the environment variables it needs."""
    from envs.isaaclab import setup

    if cfg.python:
        return cfg.python, {}
    info = setup.located(cfg.kit)
    if info is None:
        raise EnvProcessError(setup.missing({"kit": cfg.kit}))
    return info["python"], {"WARP_CACHE_PATH": str(Path(info["dir"]) / "warp-cache")}


class IsaacLabServer:
    """One running Isaac Lab server; see the module docstring."""

    def __init__(self, cfg: ServerConfig, expect: Any = None):
        """``expect``: a ``catalog.TaskShape`` the server's spec must agree with."""
        self.cfg = cfg
        self.expect = expect
        self.restarts = 0
        self.faults: list[str] = []
        self.generation = 0
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._shm: shared_memory.SharedMemory | None = None
        self.layout: Layout | None = None
        """The segment's arrays while a server is up and attached; None otherwise."""
        self.spec: ServerSpec | None = None
        self._start_timeout = cfg.start_timeout_s
        self._launch()
        try:
            self._ready()
        except _Fault as fault:
            raise EnvProcessError(f"Isaac Lab server failed to start: {fault}") from None

    @property
    def pid(self) -> int | None:
        """Process id of the current server (tests kill it)."""
        return self._proc.pid if self._proc is not None else None

    # -- process ---------------------------------------------------------------------------
    def _launch(self) -> None:
        """Start a server process; it builds its task while the caller goes on."""
        python, extra_env = _interpreter(self.cfg)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        path = os.pathsep.join(filter(None, [_source_dir(), os.environ.get("PYTHONPATH", "")]))
        env.update(extra_env, PYTHONPATH=path, PYTHONNOUSERSITE="1")
        command = [python, "-u", "-m", "envs.isaaclab.server", json.dumps(self.cfg.message())]
        self._buffer = b""
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, start_new_session=True)

    def _ready(self) -> None:
        """Wait for the launched server's spec, then create its segment and attach it. A
        server that dies, hangs or fails to build is killed (``_Fault``)."""
        if self.layout is not None:
            return
        if self._proc is None:
            raise _Fault("Isaac Lab server is not running")
        try:
            what = "start" if self.spec is None else "start of a replacement"
            answer = self._receive(self._start_timeout, what)
            if "ready" not in answer:
                raise _Fault(_last_line(answer))
            spec = ServerSpec.from_json(answer["ready"])
            self._check(spec)
            self.spec = spec
            self._shm = shared_memory.SharedMemory(create=True, size=Layout(spec).nbytes)
            self.layout = Layout(spec, self._shm.buf)
            self._command({"cmd": "attach", "shm": self._shm.name}, self.cfg.step_timeout_s)
        except BaseException:
            self._kill()
            raise

    def _check(self, spec: ServerSpec) -> None:
        want = self.expect
        if want is None:
            return
        got = (spec.state_dim, spec.action_dim, spec.instructions)
        if got != (want.state_dim, want.action_dim, want.instructions):
            raise EnvProcessError(f"the Isaac Lab server's task {self.cfg.task!r} has state "
                                  f"{got[0]}, action {got[1]}, instructions {got[2]}; "
                                  f"envs.isaaclab.catalog says {want}")

    def _release_segment(self) -> None:
        self.layout = None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # a view of it is still alive somewhere; the unlink still holds
                pass
            self._shm.unlink()
            self._shm = None

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        self._release_segment()

    def _lose(self, why: str) -> None:
        """Kill the server: the episodes on it are gone (a new ``generation``)."""
        self._kill()
        self.generation += 1
        self.faults.append(why)

    def _restart(self, why: str) -> None:
        """Kill the server and launch a replacement (waited for by the next command)."""
        self._lose(why)
        self.restarts += 1
        self._start_timeout = self.cfg.restart_timeout_s
        self._launch()

    # -- messages --------------------------------------------------------------------------
    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Fault(f"Isaac Lab server: {what} hung for more than {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = proc.wait(timeout=10)
                    raise _Fault(f"Isaac Lab server died during {what} (exit code {code})")
                self._buffer += chunk
            elif proc.poll() is not None:
                raise _Fault(f"Isaac Lab server died during {what} (exit code {proc.returncode})")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return decode(line)

    def _command(self, message: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise _Fault("Isaac Lab server is not running")
        try:
            proc.stdin.write(encode(message))
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise _Fault(f"Isaac Lab server gone before {message['cmd']} ({exc})") from None
        return self._receive(timeout, str(message["cmd"]))

    # -- commands --------------------------------------------------------------------------
    def reset(self, ids: Sequence[int], variants: Sequence[int], layouts: Sequence[int]) -> None:
        message = {"cmd": "reset", "ids": [int(i) for i in ids],
                   "variants": [int(v) for v in variants], "layouts": [int(k) for k in layouts]}
        for attempt in range(self.cfg.reset_retries + 1):
            try:
                self._ready()
                answer = self._command(message, self.cfg.step_timeout_s)
            except _Fault as fault:
                if attempt == self.cfg.reset_retries:
                    self._lose(str(fault))
                    raise EnvProcessError(f"reset failed {attempt + 1} times: {fault}") from None
                self._restart(str(fault))
                continue
            if "error" in answer:
                raise EnvProcessError(f"Isaac Lab task reset raised: {_last_line(answer)}")
            return

    def step(self, ids: Sequence[int]) -> None:
        """Step the sub-envs ``ids`` on the actions already in ``layout["actions"]`` (of a
        server that is up: the slots of a replaced one are truncated without a step)."""
        if self.layout is None:
            raise ServerFault("Isaac Lab server is not up (the next reset waits for its "
                              "replacement)")
        try:
            answer = self._command({"cmd": "step", "ids": [int(i) for i in ids]},
                                   self.cfg.step_timeout_s)
        except _Fault as fault:
            self._restart(str(fault))
            raise ServerFault(str(fault)) from None
        if "error" in answer:
            why = _last_line(answer)
            self.faults.append(why)
            raise ServerFault(why)

    def describe(self) -> dict[str, Any]:
        try:
            self._ready()
            answer = self._command({"cmd": "describe"}, self.cfg.step_timeout_s)
        except _Fault as fault:
            self._restart(str(fault))
            return {"error": str(fault)}
        return answer.get("ok") or {"error": answer.get("error", "")}

    def close(self) -> None:
        proc = self._proc
        if (self.layout is not None and proc is not None and proc.poll() is None
                and proc.stdin is not None):
            try:
                proc.stdin.write(encode({"cmd": "close"}))
                proc.stdin.flush()
                proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._kill()


def warm_task(task: str, kit: bool = False) -> float:
    """Start ``task`` once (one sub-env, its cameras) so Warp compiles its kernels into the
    environment's cache; returns the seconds it took."""
    t0 = time.perf_counter()
    server = IsaacLabServer(ServerConfig(task=task, num_envs=1, kit=kit))
    try:
        server.reset([0], [0], [0])
        server.step([0])
    finally:
        server.close()
    return time.perf_counter() - t0
