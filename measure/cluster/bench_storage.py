"""``rlvla3 bench storage``: what a checkpoint costs on a run's storage, against a local disk.

    rlvla3 bench storage --storage s3://bucket/bench [--policies default,vla-300m]
                         [--optimizer adam|none] [--repeats 3] --json

For each policy (random weights, with an Adam state as a learner holds it after a step, or
none: weights alone, a third of the bytes), each repeat times what a learner does per checkpoint and what a restarted learner on another node
does to restore it:

- ``pause_s``: the learner's pause, copying weights, optimizer and RNG state between two
  optimizer steps (``rlvla3.checkpoint.files.snapshot``, what ``actors.roles.learner_rank.Learner.save`` holds
  its step lock for; from the second save on into the previous copy's buffers, as it does);
- ``write_s``: ``save_run_checkpoint`` of that copy (staged on local scratch, uploaded,
  ``meta.json`` with every file's size and sha256, then ``latest``); a learner does this in the
  background while it trains, so it is not a pause;
- ``fetch_s``: ``resolve_checkpoint`` into an empty scratch directory (a node that never saw the
  run: download and check every file against ``meta.json``);
- ``load_s``: reading the fetched weights into the policy and the optimizer state into memory;
- ``restore_s``: the two together, what a restarted learner waits (on a local directory the
  fetch only checks the files' sizes).

The baseline is the same sequence on a local directory (``local``); ratios are storage over
local. Policies: ``default`` (the default preset's policy for its env) and ``vla-300m`` (the
packed VLA widened to about 300M parameters). Credentials and the endpoint come from the
environment (``AWS_*``; ``AWS_ENDPOINT_URL`` for an S3-compatible server such as
``moto_server``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("small", {}),
    "vla-300m": ("vla", {"preset": "small", "shapes": {
        "width": 1024, "depth": 12, "heads": 8, "kv_heads": 2, "head_dim": 128, "mlp": 4096,
        "expert_width": 512, "expert_mlp": 2048, "vision_width": 768, "vision_depth": 6,
        "vision_heads": 12, "vision_mlp": 3072}}),
}


def _policy(name: str, adam: bool) -> tuple[Any, Any, torch.optim.Optimizer | None]:
    """The policy with random weights and (``adam``) an Adam state: one step on zero
    gradients."""
    from envs import env_spec
    from rlvla3.config import Named
    from rlvla3.policies import build_policy

    kind, options = POLICIES[name]
    choice, spec = Named(kind, options), env_spec(Named("reach"))
    torch.manual_seed(0)
    policy = build_policy(choice, spec)
    if not adam:
        return (choice, spec), policy, None
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)
    for p in policy.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in policy.parameters():
        p.grad = None
    return (choice, spec), policy, optimizer


@contextlib.contextmanager
def _scratch(path: str):
    """This process's scratch directory is ``path`` for the block."""
    from rlvla3.checkpoint.storage import SCRATCH_ENV

    previous = os.environ.get(SCRATCH_ENV)
    os.environ[SCRATCH_ENV] = path
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SCRATCH_ENV]
        else:
            os.environ[SCRATCH_ENV] = previous


def measure(where: str, name: str, repeats: int, adam: bool) -> dict[str, Any]:
    """Save and restore ``name``'s checkpoint ``repeats`` times under ``where``."""
    from rlvla3.checkpoint.files import CheckpointMeta, save_run_checkpoint, snapshot
    from rlvla3.checkpoint.storage import Storage, join
    from rlvla3.checkpoint.trust import listed_files, resolve_checkpoint

    (choice, spec), policy, optimizer = _policy(name, adam)
    run = join(where, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    rows, previous = [], None
    for version in range(1, repeats + 1):
        start = time.perf_counter()
        weights, state, rng = snapshot(policy, optimizer, previous)  # as Learner.save does
        paused = time.perf_counter()
        path = save_run_checkpoint(run, weights, CheckpointMeta(choice, spec, version), state,
                                   rng=rng)
        written = time.perf_counter()
        previous = (weights, state)
        size = sum(f["size"] for f in listed_files(path).values())
        with tempfile.TemporaryDirectory(prefix="rlvla3-bench-") as scratch:
            with _scratch(scratch):  # a node that never saw the run
                t0 = time.perf_counter()
                local = resolve_checkpoint(run)
                t1 = time.perf_counter()
                policy.load_state_dict(load_file(str(local / "policy.safetensors")))
                if adam:
                    torch.load(local / "optimizer.pt", map_location="cpu", weights_only=True)
                t2 = time.perf_counter()
        gc.collect()
        rows.append({"pause_s": paused - start, "write_s": written - paused,
                     "fetch_s": t1 - t0, "load_s": t2 - t1, "mb": size / 2**20})
    Storage(run).delete("")
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in policy.parameters()),
                           "mb": round(rows[-1]["mb"], 1)}
    for r in rows:
        r["restore_s"] = r["fetch_s"] + r["load_s"]
    for key in ("pause_s", "write_s", "fetch_s", "load_s", "restore_s"):
        out[key] = round(statistics.median(r[key] for r in rows), 4)
    out["first_pause_s"] = round(rows[0]["pause_s"], 4)  # the first copy allocates its buffers
    out["pause_s"] = round(statistics.median(r["pause_s"] for r in rows[1:] or rows), 4)
    out["write_mb_s"] = round(out["mb"] / out["write_s"], 1)
    out["restore_mb_s"] = round(out["mb"] / out["restore_s"], 1)
    return out


def against_local(storage: str, names: list[str], repeats: int, optimizer: str) -> dict[str, Any]:
    """``measure`` of each policy in ``names`` on ``storage`` and on a local directory, with
    the storage-over-local ratios (each side's figures on stderr as they come)."""
    adam = optimizer == "adam"
    result: dict[str, Any] = {"storage": storage, "repeats": repeats, "optimizer": optimizer,
                              "baseline": "the same saves and restores on a local directory",
                              "policies": {}}
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-local-") as local_root:
        for name in names:
            row: dict[str, Any] = {"local": measure(str(Path(local_root)), name, repeats, adam)}
            print(f"{name} local: {json.dumps(row['local'])}", file=sys.stderr, flush=True)
            row["storage"] = measure(storage, name, repeats, adam)
            print(f"{name} storage: {json.dumps(row['storage'])}", file=sys.stderr, flush=True)
            row["storage_over_local"] = {
                k: round(row["storage"][k] / row["local"][k], 2)
                for k in ("write_s", "restore_s")}
            row["learner_pause_s"] = row["storage"]["pause_s"]
            row["upload_in_background"] = True  # Learner.save writes after the pause
            result["policies"][name] = row
    return result
