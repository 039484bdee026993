"""The Isaac Lab environment: a Python 3.12 virtual environment built once, found by every worker.

Role: Isaac Lab 3.0 needs Python >= 3.12 and pins its own torch (2.11), Warp and Newton; the
env workers run this project's interpreter and torch. ``ensure`` builds a separate virtual
environment from ``requirements.txt`` (``python -m rlvla3 envs setup isaaclab``) and
``located`` finds it again; ``envs.isaaclab.client`` runs the Isaac Lab server in it.

Where: ``$RLVLA3_ENVS/isaaclab-<key>`` (default ``~/.cache/rlvla3/envs``), ``key`` a hash of
the requirements, the interpreter's minor version and whether Isaac Sim (``--kit``) is in:
a changed requirement builds a new environment beside the old one. The environment is ready
when its ``rlvla3-env.json`` exists, which is written last (an interrupted build is rebuilt
from scratch the next time). Warp compiles its kernels into ``warp-cache/`` inside it (the
server sets ``WARP_CACHE_PATH``), so the first start of a task pays the compilation (about
90 s here) once per environment, and a CI run that builds the environment keeps the cache for
its own runs; ``--warm TASK`` pays it during setup. Builds of one environment are serialised by
a lock file beside it, so a second ``ensure`` waits for a build in progress and then returns.

Which Python 3.12: ``--python`` or ``$RLVLA3_PYTHON312``, else ``python3.12`` on ``PATH``, else
a pyenv 3.12 (``$PYENV_ROOT/versions/3.12.*``); an error says what to install otherwise.
Measured here (2 cores, shared): about 6 min and 7.8 GB (PyPI's torch 2.11 for Linux is the
CUDA build with its NVIDIA libraries; no CPU build of it is reachable through PyPI).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
MARKER = "rlvla3-env.json"
KIT_REQUIREMENT = "isaaclab[isaacsim]==3.0.0"
PACKAGES = ("isaaclab", "torch", "warp-lang", "newton", "mujoco-warp", "isaacsim")


class SetupError(RuntimeError):
    """The environment cannot be built here (no Python 3.12, an install that failed)."""


def root() -> Path:
    return Path(os.environ.get("RLVLA3_ENVS") or Path.home() / ".cache" / "rlvla3" / "envs")


def _python_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    major, minor = out.split()
    return int(major), int(minor)


def find_python(explicit: str = "") -> str:
    """A Python 3.12 interpreter to build the environment with (``SetupError`` if none)."""
    candidates = [explicit] if explicit else []
    if not explicit:
        candidates += [os.environ.get("RLVLA3_PYTHON312", ""), shutil.which("python3.12") or ""]
        pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
        candidates += sorted(glob.glob(f"{pyenv}/versions/3.12.*/bin/python3.12"), reverse=True)
    for python in filter(None, candidates):
        if _python_version(python) == (3, 12):
            return python
    looked = explicit or "python3.12 on PATH, $RLVLA3_PYTHON312, pyenv"
    raise SetupError(
        f"Isaac Lab needs Python 3.12 and none was found ({looked}): install it (`apt-get "
        "install python3.12 python3.12-venv`, `pyenv install 3.12`, `uv python install 3.12`) "
        "or pass --python PATH")


def _requirements(kit: bool) -> list[str]:
    lines = [line.strip() for line in REQUIREMENTS.read_text().splitlines()]
    reqs = [line for line in lines if line and not line.startswith("#")]
    return [*reqs, KIT_REQUIREMENT] if kit else reqs


def env_dir(kit: bool = False, minor: str = "3.12") -> Path:
    """Where the environment for these requirements lives (it may not exist yet)."""
    key = hashlib.sha256(json.dumps([minor, _requirements(kit)]).encode()).hexdigest()[:12]
    return root() / f"isaaclab-{key}"


def located(kit: bool = False) -> dict[str, Any] | None:
    """The ready environment's record (``MARKER``, plus ``dir`` and ``python``), or None."""
    path = env_dir(kit)
    marker = path / MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    return {**info, "dir": str(path), "python": str(path / "bin" / "python")}


def missing(options: Any = None) -> str:
    """Why an ``isaaclab`` env cannot start here ("" when it can): for ``envs.EXTRAS``."""
    options = dict(options or {})
    python = options.get("python") or ""
    if python:
        return "" if Path(python).is_file() else (
            f"env 'isaaclab': env.options.python {python} does not exist")
    if located(bool(options.get("kit", False))) is None:
        kit = " --kit" if options.get("kit") else ""
        return ("env 'isaaclab' runs in its own Python 3.12 environment, which is not built "
                f"here: python -m rlvla3 envs setup isaaclab{kit} (about 6 min and 8 GB, once)")
    return ""


def _run(command: list[str], what: str) -> None:
    print(f"[envs] {what}: {' '.join(command)}", file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode:
        raise SetupError(f"{what} failed (exit status {result.returncode}): {' '.join(command)}")


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total


@contextlib.contextmanager
def _building(kit: bool) -> Iterator[None]:
    """Hold the build lock of this environment: a second ``ensure`` (another process on the
    node, a CI step while a background one builds) waits for the first, then finds it ready."""
    import fcntl

    root().mkdir(parents=True, exist_ok=True)
    with open(root() / f".{env_dir(kit).name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


Starter = Callable[[str, bool], float]
"""Starts a task once in the environment, returning the seconds it took
(``envs.isaaclab.client.warm_task``: this module builds the environment, the client runs it)."""


def ensure(python: str = "", kit: bool = False, warm: tuple[str, ...] = (),
           start: Starter | None = None) -> dict[str, Any]:
    """Build the environment unless it is ready; warm the Warp cache of ``warm`` tasks by
    starting each once with ``start``. Returns its record with ``cached`` (it was ready before)
    and the seconds each part took. Concurrent calls for one environment run one after the
    other (``_building``)."""
    if warm and start is None:
        raise ValueError("ensure: warming tasks needs start (envs.isaaclab.client.warm_task)")
    with _building(kit):
        return _ensure(python, kit, warm, start)


def _ensure(python: str, kit: bool, warm: tuple[str, ...], start: Starter | None
            ) -> dict[str, Any]:
    info = located(kit)
    cached = info is not None
    if info is None:
        interpreter = find_python(python)
        path = env_dir(kit)
        if path.exists():  # an interrupted build: start over
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _run([interpreter, "-m", "venv", str(path)], "create the environment")
        venv_python = str(path / "bin" / "python")
        _run([venv_python, "-m", "pip", "install", "-q", *_requirements(kit)],
             "install Isaac Lab")
        seconds = time.perf_counter() - t0
        versions = subprocess.run(
            [venv_python, "-c", "import json, importlib.metadata as m, sys\n"
             f"out = {{'python': sys.version.split()[0]}}\nfor p in {list(PACKAGES)!r}:\n"
             "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\n"
             "print(json.dumps(out))"], capture_output=True, text=True, check=True).stdout
        record = {"requirements": _requirements(kit), "kit": kit, "built_from": interpreter,
                  "install_s": round(seconds, 1), "size_bytes": _size(path),
                  "versions": json.loads(versions),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (path / "warp-cache").mkdir(exist_ok=True)
        (path / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        info = located(kit)
    assert info is not None
    warmed = dict(info.get("warm_s", {}))
    for task in warm:
        if task not in warmed:  # its kernels are in the environment's cache once started
            assert start is not None
            warmed[task] = round(start(task, kit), 1)
            marker = Path(info["dir"]) / MARKER
            record = json.loads(marker.read_text())
            marker.write_text(json.dumps({**record, "warm_s": warmed}, indent=2) + "\n")
    return {**info, "cached": cached, **({"warm_s": warmed} if warmed else {})}
