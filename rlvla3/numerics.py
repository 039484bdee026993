"""Reproducible CPU arithmetic for evaluation. ``pinned`` (the default) makes the policy's and the
simulator's arm controller's numbers independent of the host CPU: baseline PyTorch kernels
(``ATEN_CPU_CAPABILITY=default``), one MKL code path (``MKL_CBWR=COMPATIBLE``), oneDNN off, one
thread, and NumPy's OpenBLAS on ``PINNED_BLAS`` kernels; ``native`` leaves it all to the host.
The variables act only when a process starts, so a worker starts with ``env_vars(mode)``, and
``apply`` refuses (``NumericsError``) to run pinned where they did not take effect::

    runtime_env = {"env_vars": env_vars("pinned")}  # given to Ray when it creates the worker
    info = apply("pinned")  # in the worker: one thread, oneDNN off; returns describe("pinned")

Design notes: docs/concepts/numerics.md"""

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
