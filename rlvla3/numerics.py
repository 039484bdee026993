"""Reproducible CPU arithmetic: an evaluation's numbers (the policy's and the simulator's arm
controller's) independent of the host CPU.

Role: evaluation runs a checkpoint on the CPU in closed loop, and a closed-loop LIBERO episode
amplifies the last bit of the policy's arithmetic. PyTorch (its own kernels), MKL (BLAS) and
oneDNN (convolutions) each pick kernels by the host's instruction set (AVX-512, AVX2, ...), and
kernels of different vector widths add in different orders: the same checkpoint on the same
observation returns actions 1-2e-7 apart on an AVX-512 and on an AVX2 machine, and within tens
of decisions the episode takes another path, often with another outcome (libero_spatial, 64 px:
an episode's success flips on some CPUs and not on others; ``docs/evaluation.md`` has the
measured figures). Within one machine nothing carries over from one episode to the next: the
host CPU is what differs between two evaluations of the same checkpoint.

``pinned`` (the evaluation default) fixes every choice the host would make:

- ``ATEN_CPU_CAPABILITY=default``: PyTorch's own kernels (softmax, norms, activations,
  elementwise) from their baseline build, the same code on every x86-64 CPU;
- ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility, one code path on every
  Intel or compatible CPU (the GEMMs of linear layers and convolutions);
- oneDNN off (``torch.backends.mkldnn.enabled = False``): convolutions take PyTorch's
  im2col + BLAS path, which the two settings above cover (oneDNN chooses kernels and blocking by
  instruction set and cache sizes and has no reproducibility switch);
- one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=MKL_NUM_THREADS=1``): a reduction
  split across threads adds in an order that depends on their number;
- NumPy's BLAS kernels (``OPENBLAS_CORETYPE``, ``PINNED_BLAS``): the simulator is numbers
  too. robosuite's operational-space controller computes every joint torque with NumPy
  (``np.linalg.inv`` of the mass matrix, ``np.linalg.pinv``, ``np.dot``), and NumPy's bundled
  OpenBLAS picks its kernels by the host CPU at load time (SkylakeX kernels on an AVX-512
  Intel Xeon, Haswell kernels on an AMD EPYC with AVX-512 as well): kernels that add in
  different orders give torques a last bit apart, the robot a few micrometres elsewhere after
  a few decisions, and then another episode. Pinned, every host runs the same kernels:
  ``Haswell``, which need AVX2 and FMA (Intel CPUs since 2013, AMD since 2017).
  ``blas`` names another core for an evaluation that ran with it (``"host"``: leave the choice
  to the host, as evaluations did before the kernels were pinned).

``native`` leaves all of it to the host (fastest, reproducible only on the same CPU model).

The environment variables act only when a process starts (before PyTorch first dispatches and
MKL initialises), so they are given to a worker when Ray creates its process
(``runtime_env={"env_vars": env_vars(mode)}``; a simulator process the worker spawns inherits
them); ``apply`` then sets the in-process switches and refuses to run pinned when the variables
did not take effect (PyTorch's kernels, or on x86-64 NumPy's OpenBLAS core).

Measured here (64 px libero_spatial VLA, one thread): pinned acting costs about 17 ms per
decision against 11 ms native, small beside the simulator's 5 control steps. Simulator-side
choices were checked and change nothing: Mesa llvmpipe's vector width, numba's target CPU and
NumPy's dispatched SIMD kernels give bit-identical episodes, and so do the renderer's thread
count and a machine saturated by other jobs; NumPy's OpenBLAS core does not (the same episode
with the SkylakeX and the Haswell kernels parts at its 9th decision, on the robot's state).
Not covered: another architecture (x86-64 against aarch64) or another build of torch, MKL or
OpenBLAS; ``describe`` records them, and the evaluation fingerprint carries them.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from pathlib import Path
from typing import Any, Literal

Numerics = Literal["pinned", "native"]
NUMERICS: tuple[str, ...] = ("pinned", "native")

PINNED_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}
"""What a pinned worker process must start with (and ``OPENBLAS_CORETYPE``, ``env_vars``)."""

PINNED_BLAS = "Haswell"
"""NumPy's OpenBLAS kernels under pinned numerics (``OPENBLAS_CORETYPE``): AVX2 and FMA."""
HOST_BLAS = "host"
"""``blas`` that leaves the kernels to the host (native numerics; pinned evaluations made
before the kernels were pinned)."""


class NumericsError(RuntimeError):
    """Pinned arithmetic was asked for in a process that did not start pinned."""


def env_vars(mode: str, blas: str = PINNED_BLAS) -> dict[str, str]:
    """Environment variables a worker process running ``mode`` starts with; ``blas``: NumPy's
    OpenBLAS core under pinned numerics (``HOST_BLAS``: the host's choice)."""
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics {mode!r}; choose one of {NUMERICS}")
    if mode != "pinned":
        return {}
    return dict(PINNED_ENV) | ({} if blas == HOST_BLAS else {"OPENBLAS_CORETYPE": blas})


def apply(mode: str, threads: int = 1, blas: str = PINNED_BLAS) -> dict[str, Any]:
    """Set this process's switches for ``mode`` (PyTorch threads; oneDNN off when pinned) and
    return ``describe(mode)``. Raises ``NumericsError`` when ``mode`` is pinned but the process
    did not start with ``env_vars("pinned", blas)``: PyTorch dispatches other kernels than its
    baseline, or (x86-64) NumPy's OpenBLAS runs another core than ``blas`` (not started with
    it, a CPU that cannot run it, a NumPy not built on OpenBLAS)."""
    import torch

    env_vars(mode)  # validates the name
    pinned = mode == "pinned"
    torch.set_num_threads(1 if pinned else threads)
    torch.backends.mkldnn.enabled = not pinned  # type: ignore[assignment]  # a ContextProp
    info = describe(mode)
    start = ("start the worker with runtime_env={'env_vars': "
             f"rlvla3.numerics.env_vars('pinned', {blas!r})}}")
    if pinned and info["torch_cpu_capability"] != "DEFAULT":
        raise NumericsError(
            "pinned numerics need the process to start with "
            + " ".join(f"{k}={v}" for k, v in PINNED_ENV.items())
            + f" (PyTorch dispatches {info['torch_cpu_capability']} kernels here); {start}"
        )
    x86 = host()["arch"].lower() in ("x86_64", "amd64")
    if pinned and x86 and blas != HOST_BLAS and info["numpy_blas"].lower() != blas.lower():
        raise NumericsError(
            f"pinned numerics need NumPy's OpenBLAS to run its {blas} kernels "
            f"(OPENBLAS_CORETYPE={blas}), here it runs "
            f"{info['numpy_blas'] or 'a BLAS that is not OpenBLAS'} ({host()['isa'] or '?'} "
            f"CPU); {start}, on a CPU that executes them"
        )
    return info


def check_blas(blas: str) -> None:
    """Refuse, with a ``ConfigError`` naming ``--blas``, pinned kernels this machine cannot run
    (checked in a fresh process started as a pinned worker is, before any worker starts: a
    worker that cannot run them refuses at its start, ``apply``). Nothing to check for
    ``HOST_BLAS`` or off x86-64."""
    import subprocess
    import sys

    from rlvla3.config import ConfigError

    if blas == HOST_BLAS or host()["arch"].lower() not in ("x86_64", "amd64"):
        return
    probe = "from rlvla3.numerics import numpy_blas; print(numpy_blas())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "OPENBLAS_CORETYPE": blas}, timeout=120)
    runs = done.stdout.strip().splitlines()[-1:] or [""]
    if runs[0].lower() != blas.lower():
        raise ConfigError("--blas", f"NumPy's OpenBLAS does not run {blas} kernels on this "
                          f"{host()['isa'] or '?'} CPU (it runs {runs[0] or 'nothing it names'}"
                          "): pinned episodes made with them cannot be reproduced here")


def describe(mode: str) -> dict[str, Any]:
    """What decides this process's policy arithmetic: the mode and the settings in effect;
    for ``native`` also the host CPU, since the numbers depend on it."""
    import torch

    info: dict[str, Any] = {
        "mode": mode,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "threads": torch.get_num_threads(),
        "numpy_blas": numpy_blas(),
    }
    if mode == "native":
        info["host"] = host()
    return info


@cache
def numpy_blas() -> str:
    """The OpenBLAS core NumPy's linear algebra runs in this process (``Haswell``,
    ``SkylakeX``, ...; OpenBLAS chose it when it loaded), or "" when NumPy's BLAS is not a
    bundled OpenBLAS that says."""
    import numpy

    libs = Path(numpy.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")):
        lib = ctypes.CDLL(str(path))  # already loaded by NumPy: the same library
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                     "openblas_get_corename64_", "openblas_get_corename"):
            corename = getattr(lib, name, None)
            if corename is not None:
                corename.restype = ctypes.c_char_p
                return corename().decode()
    return ""


@cache
def host() -> dict[str, str]:
    """The CPU this process runs on: architecture, model name and widest vector extension."""
    model, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the architecture alone
        pass
    isa = next((name for name in ("avx512f", "avx2", "avx", "sve", "asimd") if name in flags), "")
    return {"arch": platform.machine(), "cpu": model or platform.processor(), "isa": isa}
