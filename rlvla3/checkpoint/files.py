"""Checkpoints at a local path or a storage URI (``rlvla3.checkpoint.storage``): safetensors
weights (``policy.safetensors``), optional ``optimizer.pt`` (loaded ``weights_only``),
``rng.safetensors`` and ``shadow.safetensors``, and ``meta.json`` (``CheckpointMeta``, each file's
size and sha256) written last, so a directory without it is an unfinished write no reader takes.
A run directory's ``checkpoints/latest`` names its newest complete ``step-<version>``, written
after it; a save never overwrites a checkpoint ``latest`` may name. Readers open only the files
``meta.json`` lists, by plain relative names, and unpickle nothing::

    meta = CheckpointMeta(Named("vla", {"preset": "tiny"}), spec, version=3)
    path = save_run_checkpoint(run_dir, policy, meta, optimizer)  # checkpoints/step-00000003
    policy, meta = load_policy(run_dir)  # the checkpoint run_dir's latest names

Design notes: docs/concepts/checkpoints.md"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import struct
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file, save_file

from rlvla3.checkpoint.storage import (
    Storage,
    file_sha256,
    join,
    scratch_dir,
)
from rlvla3.checkpoint.trust import (
    check_present,
    locate_checkpoint,
    open_listed,
    resolve_checkpoint,
)
from rlvla3.config import ConfigError, Named, require
from rlvla3.protocols import Policy
from rlvla3.types import EnvSpec

if TYPE_CHECKING:
    from rlvla3.engine.sharded import RowSource


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
    learner: dict[str, Any] = field(default_factory=dict)
    """The RL learner's state between two optimizer steps (``LearnerState.as_json``: the
    advantage normaliser's moments, the proximal copy's version); empty for SFT and for
    checkpoints written before it was kept."""


class HasState(Protocol):
    """What ``save_checkpoint`` reads of a module or optimizer: a live one or a
    ``StateSnapshot``."""

    def state_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StateSnapshot:
    """A state dict taken at one moment, standing in for the module or optimizer that
    ``save_checkpoint`` reads (it only calls ``state_dict()``): lets a trainer copy its state
    between two optimizer steps and write it while it trains on, or stand in for a live object
    no single rank holds whole (FSDP)."""

    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


@dataclass(frozen=True)
class SavedCheckpoint:
    """What one save wrote, and what it cost the trainer."""

    path: str
    """The checkpoint directory (a local path or URI)."""
    version: int
    pause_s: float
    """How long the trainer stopped to copy its state (``snapshot``)."""
    write_s: float
    """Writing (and uploading) that copy, while the trainer went on."""
    bytes: int
    """Size of the files written (weights, optimizer state, RNG state)."""


def snapshot(policy: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             reuse: tuple[StateSnapshot, StateSnapshot | None] | None = None
             ) -> tuple[StateSnapshot, StateSnapshot | None, torch.Tensor]:
    """Copies of the weights, the optimizer state and the RNG state, taken at one moment (the
    trainer's pause per checkpoint); ``save_checkpoint`` writes them while training goes on.

    ``reuse``: an earlier snapshot whose write has finished; its tensors are copied into where
    shapes and dtypes match, instead of allocating (and page-faulting) new memory each time,
    which on a large model is most of the pause."""
    old_weights, old_state = reuse or (None, None)
    weights = StateSnapshot(_copy_into(policy.state_dict(), old_weights and old_weights.state))
    state = None if optimizer is None else StateSnapshot(
        _copy_into(optimizer.state_dict(), old_state and old_state.state))
    return weights, state, torch.get_rng_state()


def _copy_into(value: Any, into: Any) -> Any:
    """A copy of ``value`` (nested dicts and lists of tensors), written into the tensors of
    ``into`` (the same structure, from an earlier copy) where they fit."""
    if isinstance(value, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == value.shape
                and into.dtype == value.dtype and into.device == torch.device("cpu")):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _copy_into(v, into.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not (isinstance(into, (list, tuple)) and len(into) == len(value)):
            into = [None] * len(value)
        return type(value)(_copy_into(v, i) for v, i in zip(value, into, strict=True))
    return copy.deepcopy(value)


_WRITING = threading.RLock()
"""Saves in one process are serialised: two threads saving the same version would otherwise
pick the same new directory."""
_STEP = re.compile(r"step-(\d+)(?:-(\d+))?")


def _step_key(name: str) -> tuple[int, int] | None:
    """``step-<version>[-<k>]`` -> (version, k); None for other names."""
    match = _STEP.fullmatch(name)
    return None if match is None else (int(match[1]), int(match[2] or 0))


def _write_files(stage: Path, policy: HasState, optimizer: HasState | None,
                 rng: torch.Tensor | None, shadow: Any = None) -> list[str]:
    state = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
    save_file(state, str(stage / "policy.safetensors"))
    names = ["policy.safetensors"]
    if shadow is not None:
        from rlvla3.engine.sharded import SHADOW_FILE

        save_file({k: v.detach().cpu().contiguous() for k, v in shadow.state_dict().items()},
                  str(stage / SHADOW_FILE))
        names.append(SHADOW_FILE)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), stage / "optimizer.pt")
        names.append("optimizer.pt")
    if rng is not None:
        save_file({"torch": rng.contiguous()}, str(stage / "rng.safetensors"))
        names.append("rng.safetensors")
    return names


def save_checkpoint(
    directory: str | Path,
    policy: HasState,
    meta: CheckpointMeta,
    optimizer: HasState | None = None,
    rng: torch.Tensor | None = None,
    shadow: Any = None,
) -> str:
    """Write a checkpoint into ``directory`` (a local path or URI), ``meta.json`` last (see the
    module docstring); ``shadow``: the learner's proximal copy (anything with ``state_dict``). A checkpoint already there stops being one (its ``meta.json`` goes)
    before its files are overwritten. A remote checkpoint is staged in this node's scratch
    directory and uploaded. Returns the directory's location."""
    store = Storage(directory)
    with _WRITING:
        store.delete("meta.json")
        stage = Path(store.root) if store.local else scratch_dir() / "staging" / uuid.uuid4().hex
        stage.mkdir(parents=True, exist_ok=True)
        files = {}
        try:
            for name in _write_files(stage, policy, optimizer, rng, shadow):
                if store.local:
                    files[name] = {"size": (stage / name).stat().st_size,
                                   "sha256": file_sha256(stage / name)}
                else:
                    moved = store.upload(stage / name, name)
                    files[name] = {"size": moved.size, "sha256": moved.sha256}
        finally:
            if not store.local:
                shutil.rmtree(stage, ignore_errors=True)
        store.write_text("meta.json", _meta_payload(meta, files))
    return store.uri


def _meta_payload(meta: CheckpointMeta, files: dict[str, Any], **extra: Any) -> str:
    return json.dumps({
        "policy": {"name": meta.policy.name, "options": dict(meta.policy.options)},
        "spec": dataclasses.asdict(meta.spec),
        "version": meta.version,
        "counters": meta.counters,
        "samplers": meta.samplers,
        **({"learner": meta.learner} if meta.learner else {}),
        "files": files,
        **extra,
    }, indent=2)


def _new_step_dir(root: Storage, version: int) -> str:
    """``step-<version>``, or ``step-<version>-<k>`` when that version was saved before."""
    taken = {key for key in map(_step_key, root.listdir()) if key is not None}
    k = 1 + max((k for v, k in taken if v == version), default=-1)
    return f"step-{version:08d}" + (f"-{k}" if k else "")


def _point_latest_and_prune(root: Storage, keep: int, pinned: Iterable[str]) -> None:
    """``latest`` at the newest complete checkpoint; all but the newest ``keep`` versions
    pruned, never a ``pinned`` one, never one newer than ``latest``."""
    pinned = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in pinned}
    complete = _complete(root)
    names = sorted(complete, key=complete.__getitem__)
    root.write_text("latest", names[-1] + "\n")
    newest_copy = {complete[n][0]: n for n in names}  # sorted: the last copy wins
    kept = {newest_copy[v] for v in sorted(newest_copy)[-keep:]}
    latest = complete[names[-1]]
    for old in root.listdir():
        key = _step_key(old)
        if key is not None and old not in kept and old not in pinned and key < latest:
            root.delete(old)


def save_sharded_run_checkpoint(run_dir: str | Path, tensors: dict[str, torch.Tensor],
                                meta: CheckpointMeta, ranks: Any,
                                optimizer: dict[str, Any] | None = None,
                                rng: torch.Tensor | None = None, keep: int = 2,
                                pinned: Iterable[str] = ()) -> str:
    """A sharded checkpoint (``rlvla3.engine.sharded``) in ``run_dir/checkpoints``, written
    by every rank of ``ranks`` at once (a collective: every rank calls it): each rank writes
    and uploads its own shard file; rank 0, once every rank's file is up and listed, writes
    ``meta.json`` (sizes and sha256 of every shard, each tensor's whole shape, ``optimizer``:
    the param groups and the order the optimizer indexes parameters in), then ``latest``, then
    prunes. Returns the checkpoint's location."""
    from rlvla3.engine.sharded import FORMAT, cleanup, stage_dir, write_shard

    root = Storage(join(run_dir, "checkpoints"))
    with _WRITING:
        name = ranks.gather_objects(_new_step_dir(root, meta.version) if ranks.rank == 0
                                    else None)[0]
        target = Storage(join(root.uri, name))
        stage = stage_dir(scratch_dir())
        try:
            written = write_shard(stage, tensors, ranks)
            extra = {}
            if ranks.rank == 0 and rng is not None:
                save_file({"torch": rng.contiguous()}, str(stage / "rng.safetensors"))
                extra["rng.safetensors"] = stage / "rng.safetensors"
            if target.local:
                (Path(target.root) / "shards").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stage / written.name, Path(target.root) / written.name)
                for file_name, path in extra.items():
                    shutil.copyfile(path, Path(target.root) / file_name)
            else:
                target.upload(stage / written.name, written.name)
                for file_name, path in extra.items():
                    target.upload(path, file_name)
            records = ranks.gather_objects(dataclasses.asdict(written))
            files = {w["name"]: {"size": w["size"], "sha256": w["sha256"]} for w in records}
            shapes = {k: v for w in records for k, v in w["keys"].items()}
            if ranks.rank == 0:
                for file_name, path in extra.items():
                    files[file_name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
                target.write_text("meta.json", _meta_payload(
                    meta, files, format=FORMAT, world=ranks.world, tensors=shapes,
                    optimizer=optimizer or {}))
                _point_latest_and_prune(root, keep, pinned)
        finally:
            cleanup(stage)
        ranks.barrier()  # no rank returns before meta.json and latest name its checkpoint
    return target.uri


def save_run_checkpoint(run_dir: str | Path, policy: HasState, meta: CheckpointMeta,
                        optimizer: HasState | None = None, keep: int = 2,
                        rng: torch.Tensor | None = None, pinned: Iterable[str] = (),
                        shadow: Any = None) -> str:
    """Save ``checkpoints/step-<version>`` in a run directory (a local path or URI), point
    ``latest`` at the newest complete checkpoint there and prune all but the newest ``keep``
    versions, and never a ``pinned`` one (a checkpoint name or location another reader is
    still loading, e.g. a periodic evaluation's). ``latest`` never moves back: a save of an
    older version arriving after a newer one (two calls into one learner, in either order) is
    written and then pruned, so ``latest`` never names a pruned checkpoint. Returns the new
    checkpoint's location."""
    root = Storage(join(run_dir, "checkpoints"))
    with _WRITING:
        name = _new_step_dir(root, meta.version)
        path = save_checkpoint(join(root.uri, name), policy, meta, optimizer, rng, shadow)
        _point_latest_and_prune(root, keep, pinned)
    return path


def _complete(root: Storage) -> dict[str, tuple[int, int]]:
    """The checkpoint directories under ``root`` whose ``meta.json`` was written, each with
    its ``_step_key``."""
    out = {}
    for name in root.sizes():
        if name.endswith("/meta.json") and name.count("/") == 1:
            key = _step_key(name.split("/")[0])
            if key is not None:
                out[name.split("/")[0]] = key
    return out


def read_meta(path: str | Path) -> CheckpointMeta:
    """Metadata of the checkpoint at ``path`` (a checkpoint or run directory, path or URI)."""
    raw = json.loads(Storage(locate_checkpoint(path)).read_text("meta.json"))
    spec: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                            for k, v in raw["spec"].items()}
    return CheckpointMeta(
        policy=Named(raw["policy"]["name"], raw["policy"].get("options", {})),
        spec=EnvSpec(**spec),
        version=int(raw["version"]),
        counters=dict(raw.get("counters", {})),
        samplers=list(raw.get("samplers", [])),
        learner=dict(raw.get("learner", {})),
    )


def check_resume(path: str | Path) -> str:
    """Before a resumed run starts anything: the checkpoint it continues from (a run
    directory's ``latest``) holds every file its ``meta.json`` lists, the optimizer and RNG
    state included, else ``ConfigError("--resume", ...)`` naming the first one missing and
    what it is for. A checkpoint that lists no optimizer state resumes with a fresh optimizer.
    Returns the checkpoint's location."""
    try:
        ckpt = locate_checkpoint(path)
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError("--resume", str(exc)) from None
    check_present(ckpt, "--resume", everything=True)
    return ckpt


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a checkpoint's weights, from the safetensors header alone (two
    ranged reads; nothing downloaded)."""
    store = Storage(locate_checkpoint(path))
    meta = json.loads(store.read_text("meta.json"))
    if meta.get("format") == "sharded":
        return {k.removeprefix("model/"): tuple(v) for k, v in meta.get("tensors", {}).items()
                if k.startswith("model/")}
    (length,) = struct.unpack("<Q", store.read_range("policy.safetensors", 0, 8))
    header = json.loads(store.read_range("policy.safetensors", 8, length))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def check_init_from(path: str | Path, policy: Named, spec: EnvSpec,
                    built: torch.nn.Module | None = None) -> str:
    """The checkpoint a run's ``init_from`` names (a checkpoint or run directory, a path or
    URI), checked against the run that starts from it; raises ``ConfigError("init_from", ...)``
    when it is missing, lacks its weights (a missing optimizer or RNG state does not matter:
    a run starts from the weights alone), holds another policy, was trained for another env (action size,
    cameras) or, given the ``built`` policy, holds weights of other names or shapes (read from
    the safetensors header, no weights loaded). Returns the checkpoint's location."""
    try:
        ckpt = locate_checkpoint(path)
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError("init_from", str(exc)) from None
    check_present(ckpt, "init_from", everything=False)
    meta = read_meta(ckpt)
    require(meta.policy.name == policy.name, "init_from",
            f"the checkpoint holds a {meta.policy.name!r} policy, not {policy.name!r}")
    require(meta.spec.action_dim == spec.action_dim and meta.spec.cameras == spec.cameras,
            "init_from", f"the checkpoint was trained for {meta.spec}, this env is {spec}")
    if built is not None:
        saved = safetensors_shapes(ckpt)
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


def is_sharded(local: Path) -> bool:
    """Whether the checkpoint in ``local`` was written shard by shard (``rlvla3.engine``)."""
    return json.loads((Path(local) / "meta.json").read_text()).get("format") == "sharded"


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's whole weights (a sharded one's shards put together)."""
    local = resolve_checkpoint(path)
    if not is_sharded(local):
        return load_file(str(local / "policy.safetensors"))
    from rlvla3.engine.sharded import RowSource

    source = RowSource(local)
    return {k.removeprefix("model/"): source.whole(k) for k in source.keys("model/")}


def load_policy(path: str | Path) -> tuple[Policy, CheckpointMeta]:
    """Rebuild the policy a checkpoint was saved from and load its weights (strictly)."""
    from rlvla3.policies import build_policy

    local = resolve_checkpoint(path)
    meta = read_meta(local)
    policy = build_policy(meta.policy, meta.spec)
    policy.load_state_dict(load_weights(local))
    return policy, meta


def row_source(path: str | Path, optimizer: bool) -> RowSource:
    """What a training engine restores from (``TrainingEngine.restore``): the rows of the
    checkpoint at ``path`` (``resolve_checkpoint``'s local copy) and, with ``optimizer`` (a
    resumed run), the optimizer state of a whole checkpoint where it lists one (a sharded
    checkpoint's is in its shards)."""
    from rlvla3.engine.sharded import RowSource

    local = resolve_checkpoint(path)
    whole = optimizer and not is_sharded(local)
    return RowSource(local, load_optimizer_state(local) if whole else None)


def load_optimizer_state(path: str | Path) -> dict[str, Any] | None:
    """The optimizer state saved beside the weights in ``Optimizer.state_dict``'s layout
    (parameters by index; a sharded checkpoint's shards put together), or None where the
    checkpoint lists none; never unpickles objects."""
    local = resolve_checkpoint(path)
    if is_sharded(local):
        from rlvla3.engine.sharded import RowSource

        source = RowSource(local)
        saved = json.loads((local / "meta.json").read_text()).get("optimizer") or {}
        order = saved.get("param_order") or []
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(order):
            for key in source.keys(f"optim/{name}/"):
                state.setdefault(index, {})[key.rsplit("/", 1)[1]] = source.whole(key)
        groups = [{**g, "params": list(range(len(order)))} for g in saved.get("param_groups")
                  or []]
        return {"state": state, "param_groups": groups} if order else None
    handle = open_listed(local, "optimizer.pt")
    if handle is None:
        return None
    with handle:
        return torch.load(handle, map_location="cpu", weights_only=True)


def load_rng_state(path: str | Path) -> torch.Tensor | None:
    """The torch RNG state saved beside the weights, or None where the checkpoint lists
    none."""
    handle = open_listed(resolve_checkpoint(path), "rng.safetensors")
    if handle is None:
        return None
    with handle:
        return safetensors_load(handle.read())["torch"]


def saved_run(checkpoint: str) -> tuple[str, dict[str, Any]]:
    """The run directory a checkpoint belongs to (the run itself, or ``RUN`` of
    ``RUN/checkpoints/step-N``) and the config it was started with: ``config.yaml`` (RL and
    SFT runs), else the ``config.json`` of an SFT run written before it, else ``{}``."""
    import yaml

    from rlvla3.checkpoint.storage import basename, parent

    path = Storage(checkpoint).uri  # a path or a storage URI
    run = parent(parent(path)) if basename(parent(path)) == "checkpoints" else path
    files = Storage(run)
    if files.is_file("config.yaml"):
        return run, dict(yaml.safe_load(files.read_text("config.yaml")) or {})
    if files.is_file("config.json"):
        return run, dict(json.loads(files.read_text("config.json")))
    return run, {}
