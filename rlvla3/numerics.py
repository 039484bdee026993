"""Reproducible CPU arithmetic: a policy's numbers independent of the host CPU.

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
  split across threads adds in an order that depends on their number.

``native`` leaves all of it to the host (fastest, reproducible only on the same CPU model).

The environment variables act only when a process starts (before PyTorch first dispatches and
MKL initialises), so they are given to a worker when Ray creates its process
(``runtime_env={"env_vars": env_vars(mode)}``); ``apply`` then sets the in-process switches and
refuses to run pinned when the variables did not take effect.

Measured here (64 px libero_spatial VLA, one thread): pinned acting costs about 17 ms per
decision against 11 ms native, small beside the simulator's 5 control steps. Simulator-side
choices were checked and change nothing: Mesa llvmpipe's vector width, numba's target CPU and
NumPy's dispatched SIMD kernels give bit-identical episodes. Not covered: another architecture
(x86-64 against aarch64) or another build of torch or MKL; ``describe`` records both, and the
evaluation fingerprint carries them.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from typing import Any, Literal

Numerics = Literal["pinned", "native"]
NUMERICS: tuple[str, ...] = ("pinned", "native")

PINNED_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}
"""What a pinned worker process must start with."""


class NumericsError(RuntimeError):
    """Pinned arithmetic was asked for in a process that did not start pinned."""


def env_vars(mode: str) -> dict[str, str]:
    """Environment variables a worker process running ``mode`` starts with."""
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics {mode!r}; choose one of {NUMERICS}")
    return dict(PINNED_ENV) if mode == "pinned" else {}


def apply(mode: str, threads: int = 1) -> dict[str, Any]:
    """Set this process's switches for ``mode`` (PyTorch threads; oneDNN off when pinned) and
    return ``describe(mode)``. Raises ``NumericsError`` when ``mode`` is pinned but the process
    did not start with ``env_vars("pinned")``."""
    import torch

    env_vars(mode)  # validates the name
    pinned = mode == "pinned"
    torch.set_num_threads(1 if pinned else threads)
    torch.backends.mkldnn.enabled = not pinned  # type: ignore[assignment]  # a ContextProp
    info = describe(mode)
    if pinned and info["torch_cpu_capability"] != "DEFAULT":
        raise NumericsError(
            "pinned numerics need the process to start with "
            + " ".join(f"{k}={v}" for k, v in PINNED_ENV.items())
            + f" (PyTorch dispatches {info['torch_cpu_capability']} kernels here); start the "
            "worker with runtime_env={'env_vars': rlvla3.numerics.env_vars('pinned')}"
        )
    return info


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
    }
    if mode == "native":
        info["host"] = host()
    return info


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
