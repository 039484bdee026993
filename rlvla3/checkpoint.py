"""Checkpoints: safetensors weights, a weights-only optimizer state, and JSON metadata.

Layout of one checkpoint directory::

    policy.safetensors   policy parameters and buffers
    optimizer.pt         optimizer state dict (loaded with ``weights_only=True``; optional)
    rng.safetensors      torch RNG state of the learner (optional)
    meta.json            policy choice (name + options), env spec, policy version, counters,
                         env workers' episode sampler states (RL runs)

A run directory keeps checkpoints in ``checkpoints/step-<version>/`` and points at the newest
with ``checkpoints/latest`` (a one-line text file, so it works on filesystems without symlinks).
Nothing here unpickles arbitrary objects: an untrusted checkpoint can at worst fail to load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlvla3.config import ConfigError, Named, require
from rlvla3.protocols import Policy
from rlvla3.types import EnvSpec


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint says about itself."""

    policy: Named
    """The policy choice the weights belong to."""
    spec: EnvSpec
    """Shapes of the env the policy was built for."""
    version: int
    """Policy version (optimizer steps taken)."""
    counters: dict[str, Any] = field(default_factory=dict)
    """Run counters to restore on resume (env steps, episodes, ...)."""
    samplers: list[dict | None] = field(default_factory=list)
    """Each env worker's episode sampler state (``TaskSampler.state``; None where a worker did
    not answer), so that a resumed run continues its episode sequence."""


@dataclass(frozen=True)
class StateSnapshot:
    """A state dict taken at one moment, standing in for the module or optimizer that
    ``save_checkpoint`` reads (it only calls ``state_dict()``): lets a trainer copy its state
    between two optimizer steps and write it while it trains on, or stand in for a live object
    no single rank holds whole (FSDP)."""

    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


_WRITING = threading.RLock()
"""Saves in one process are serialised: two threads saving the same version would otherwise
share its temporary directory."""


def save_checkpoint(
    directory: str | Path,
    policy: Policy,
    meta: CheckpointMeta,
    optimizer: torch.optim.Optimizer | None = None,
    rng: torch.Tensor | None = None,
) -> Path:
    """Write a checkpoint atomically (a temporary directory renamed into place)."""
    directory = Path(directory)
    with _WRITING:
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
        save_file(state, str(tmp / "policy.safetensors"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if rng is not None:
            save_file({"torch": rng.contiguous()}, str(tmp / "rng.safetensors"))
        payload = {
            "policy": {"name": meta.policy.name, "options": dict(meta.policy.options)},
            "spec": dataclasses.asdict(meta.spec),
            "version": meta.version,
            "counters": meta.counters,
            "samplers": meta.samplers,
        }
        (tmp / "meta.json").write_text(json.dumps(payload, indent=2))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        return directory


def save_run_checkpoint(run_dir: str | Path, policy: Policy, meta: CheckpointMeta,
                        optimizer: torch.optim.Optimizer | None = None, keep: int = 2,
                        rng: torch.Tensor | None = None) -> Path:
    """Save ``checkpoints/step-<version>`` in a run directory, point ``latest`` at the newest
    version there and prune all but the newest ``keep``. ``latest`` never moves back: a save of
    an older version arriving after a newer one (two calls into one learner, in either order)
    is written and then pruned, so ``latest`` never names a pruned checkpoint."""
    root = Path(run_dir) / "checkpoints"
    with _WRITING:
        path = save_checkpoint(root / f"step-{meta.version:08d}", policy, meta, optimizer, rng)
        steps = sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp"))
        (root / "latest.tmp").write_text(steps[-1].name + "\n")
        os.replace(root / "latest.tmp", root / "latest")
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (its latest checkpoint)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        ckpt = path / "checkpoints" / latest.read_text().strip()
        if (ckpt / "meta.json").is_file():
            return ckpt
    raise FileNotFoundError(f"no checkpoint at {path} (expected meta.json or checkpoints/latest)")


def read_meta(path: str | Path) -> CheckpointMeta:
    """Metadata of the checkpoint at ``path`` (a checkpoint or run directory)."""
    ckpt = resolve_checkpoint(path)
    raw = json.loads((ckpt / "meta.json").read_text())
    return CheckpointMeta(
        policy=Named(raw["policy"]["name"], raw["policy"].get("options", {})),
        spec=EnvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw["spec"].items()}),
        version=int(raw["version"]),
        counters=dict(raw.get("counters", {})),
        samplers=list(raw.get("samplers", [])),
    )


def check_init_from(path: str | Path, policy: Named, spec: EnvSpec,
                    built: torch.nn.Module | None = None) -> Path:
    """The checkpoint a run's ``init_from`` names (a checkpoint or run directory), checked
    against the run that starts from it; raises ``ConfigError("init_from", ...)`` when it is
    missing, holds another policy, was trained for another env (action size, cameras) or, given
    the ``built`` policy, holds weights of other names or shapes (read from the safetensors
    header, no weights loaded). Returns the checkpoint directory."""
    try:
        ckpt = resolve_checkpoint(path)
    except FileNotFoundError as exc:
        raise ConfigError("init_from", str(exc)) from None
    meta = read_meta(ckpt)
    require(meta.policy.name == policy.name, "init_from",
            f"the checkpoint holds a {meta.policy.name!r} policy, not {policy.name!r}")
    require(meta.spec.action_dim == spec.action_dim and meta.spec.cameras == spec.cameras,
            "init_from", f"the checkpoint was trained for {meta.spec}, this env is {spec}")
    if built is not None:
        from safetensors import safe_open

        with safe_open(str(ckpt / "policy.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        own = {k: tuple(v.shape) for k, v in built.state_dict().items()}
        differ = sorted(k for k in own.keys() & saved.keys() if own[k] != saved[k])
        if differ:
            raise ConfigError("init_from", (
                f"{len(differ)} weight(s) differ in shape from this policy's, e.g. {differ[0]}: "
                f"{saved[differ[0]]} in the checkpoint, {own[differ[0]]} here (policy.options "
                "must describe the model the checkpoint holds)"))
        for names, where in ((own.keys() - saved.keys(), "missing from the checkpoint"),
                             (saved.keys() - own.keys(), "not in this policy")):
            if names:
                raise ConfigError("init_from", f"{len(names)} weight(s) {where}, e.g. "
                                  f"{min(names)}")
    return ckpt


def load_policy(path: str | Path) -> tuple[Policy, CheckpointMeta]:
    """Rebuild the policy a checkpoint was saved from and load its weights (strictly)."""
    from rlvla3.policies import build_policy

    meta = read_meta(path)
    policy = build_policy(meta.policy, meta.spec)
    policy.load_state_dict(load_file(str(resolve_checkpoint(path) / "policy.safetensors")))
    return policy, meta


def load_optimizer_state(path: str | Path) -> dict[str, Any] | None:
    """The optimizer state saved beside the weights, or None; never unpickles objects."""
    file = resolve_checkpoint(path) / "optimizer.pt"
    if not file.is_file():
        return None
    return torch.load(file, map_location="cpu", weights_only=True)


def load_rng_state(path: str | Path) -> torch.Tensor | None:
    """The torch RNG state saved beside the weights, or None."""
    file = resolve_checkpoint(path) / "rng.safetensors"
    return load_file(str(file))["torch"] if file.is_file() else None
