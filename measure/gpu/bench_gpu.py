"""``rlvla3 bench gpu``: the GPU check. One command that measures every GPU path of the VLA
against its reference on a machine with one NVIDIA GPU, prepared to work the first time such a
machine is lent (docs/guides/gpu-check.md).

Entries (the table ``measure.gpu.gpu_checks.ENTRIES``, in run order): ``act`` per acting
strategy (eager, static, CUDA graph) at batch 1-64; every FP8 kernel candidate per pi0.5 layer
(``fp8_linear``, which chooses one) and the FP8 training step with its loss over 50 steps
(``fp8_training``, with that choice); packed vs padded training step with MFU and a kernel
breakdown (``packing``); this GPU's cost model (``costs``); varlen attention (``attention``);
the RL path (``rl``); GR00T-N1.5's and N1.7's cost models and packed vs padded steps (``groot``,
``groot17``). ``--dry-run`` runs exactly this code on CPU at tiny shapes (per-segment
attention, emulated FP8, no capture), so CI keeps the command from rotting. Without a GPU and
without ``--dry-run`` it prints a JSON object saying it skipped, and exits 0.

Isolation and time: each entry runs in its own Python process, killed at the entry's timeout or
when the whole budget (``--budget``, 630 s on a GPU; a warm H200 needed about six minutes
before the ``groot17`` entry) is
spent; a hang, a
crash or a CUDA error stays in its entry, which then fails and still reports what it measured
(entries print a complete snapshot after each step). Imports: torch, numpy and the Ray-free
core only (the GPU image has no Ray); torchao, triton, flash-attn and transformer-engine when
importable.

Output: one JSON object: versions, device, ``pass`` (all entries passed), ``summary`` (the
headline speed-ups) and ``entries`` (each with ``pass``, its figures, the backends that ran and
``seconds``). Exit status 0 when every entry passed (or the check was skipped), 1 otherwise.
The command is ``commands.bench.gpu``; ``run_check`` runs the entries, each in a process of
its own (``python -m measure.gpu.bench_gpu ENTRY [--dry-run]``: ``run_child``).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from measure.gpu.check_context import Context, sizes_for
from measure.gpu.fp8_check import BENCH_FP8
from measure.gpu.gpu_checks import ENTRIES

MIN_ENTRY_S = 15.0
"""An entry is not started with less budget left than this."""

PACKAGES = ("torch", "numpy", "triton", "torchao", "flash-attn", "transformer-engine",
            "safetensors", "pyyaml")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_child(name: str, dry_run: bool) -> int:
    """Run one entry in this process; print each snapshot as one JSON line."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"bench gpu [{name}] %(name)s: %(message)s")
    logging.getLogger("rlvla3").setLevel(logging.INFO)  # backend choices; libraries: warnings
    sizes = sizes_for(dry_run)
    if dry_run:
        torch.set_num_threads(1)  # tiny shapes: one thread is fastest on a shared machine
    ctx = Context(torch.device("cpu" if dry_run else "cuda"), sizes)
    snap: dict = {}
    try:
        for snap in ENTRIES[name].run(ctx):
            print(json.dumps(snap), flush=True)
    except Exception as exc:
        print(json.dumps({**snap, "pass": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=6)[-3000:]}), flush=True)
        return 1
    return 0


def run_entry(name: str, dry_run: bool, timeout: float, fp8: str | None = None) -> dict:
    """Run entry ``name`` in a fresh Python process for at most ``timeout`` seconds
    (``fp8``: the FP8 backend the training entries use, ``fp8_linear``'s choice)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    if fp8:
        env[BENCH_FP8] = fp8
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # later entries reuse earlier tuning
    cmd = [sys.executable, "-m", "measure.gpu.bench_gpu", name]
    cmd += ["--dry-run"] if dry_run else []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    snaps = []
    for line in out.splitlines():
        try:
            snap = json.loads(line)
        except json.JSONDecodeError:
            continue  # stray output of a library
        if isinstance(snap, dict):
            snaps.append(snap)
    result = snaps[-1] if snaps else {}
    if timed_out:
        result.update({"pass": False, "error": f"timed out after {timeout:g} s"})
    elif proc.returncode and "error" not in result:
        result.update({"pass": False, "error": f"process exited with status {proc.returncode}"})
    result["pass"] = bool(result.get("pass", False))
    result["seconds"] = round(seconds, 1)
    return result


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu (dry run)", "capability": None}
    major, minor = torch.cuda.get_device_capability()
    return {"device": torch.cuda.get_device_name(), "capability": f"{major}.{minor}"}


def _get(entries: dict, *path: str) -> Any:
    node: Any = entries
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


SUMMARY = {
    "act_ms_batch1": ("act", "act_ms_batch1"),
    "act_fastest": ("act", "fastest"),
    "act_goal_met": ("act", "goal_met"),
    "fp8_kernel": ("fp8_linear", "chosen"),
    "fp8_linear_model_weighted_speedup": ("fp8_linear", "model_weighted_speedup"),
    "fp8_training_speedup": ("fp8_training", "speedup"),
    "fp8_training_speedup_with_optimizer": ("fp8_training", "loss_run", "speedup_with_optimizer"),
    "fp8_loss_mean_rel_diff": ("fp8_training", "loss_run", "mean_rel_diff"),
    "packing_speedup": ("packing", "speedup"),
    "packing_token_ratio": ("packing", "token_ratio"),
    "packing_flop_ratio": ("packing", "flop_ratio"),
    "packed_mfu": ("packing", "variants", "packed", "mfu"),
    "attention_speedup_over_padded": ("attention", "speedup_over_padded"),
    "cost_model": ("costs", "cost_model"),
    "groot_cost_model": ("groot", "cost_model"),
    "groot_packing_speedup": ("groot", "packing", "speedup"),
    "groot17_cost_model": ("groot17", "cost_model"),
    "groot17_packing_speedup": ("groot17", "packing", "speedup"),
}
"""Headline figure -> where it sits in the entries."""


def _summary(entries: dict) -> dict:
    out = {key: _get(entries, *path) for key, path in SUMMARY.items()}
    rl = entries.get("rl", {}).get("dtypes", {})
    out["rl_decisions_per_s"] = next((r["decisions_per_s"] for r in rl.values()
                                      if "decisions_per_s" in r), None)
    return out


def run_check(names: list[str], dry_run: bool, budget: float) -> dict:
    sizes = sizes_for(dry_run)
    start = time.monotonic()
    report = {
        "check": "rlvla3 bench gpu", "gpu": torch.cuda.is_available() and not dry_run,
        "dry_run": dry_run, **_device(),
        "versions": {"python": platform.python_version(), "cuda": torch.version.cuda,
                     **{p: _version(p) for p in PACKAGES}},
        "budget_s": budget, "entries": {},
    }
    fp8 = os.environ.get(BENCH_FP8)
    for name in names:
        left = budget - (time.monotonic() - start)
        result: dict[str, Any]
        if left < MIN_ENTRY_S:
            result = {"pass": False, "error": f"not run: {left:.0f} s of the budget left"}
        else:
            limit = sizes.entry_timeout_s or ENTRIES[name].gpu_timeout_s
            result = run_entry(name, dry_run, min(limit, left), fp8)
        fp8 = result.get("chosen", fp8) if name == "fp8_linear" else fp8
        report["entries"][name] = result
        error = f": {result['error']}" if "error" in result else ""
        print(f"bench gpu: {name}: {'pass' if result['pass'] else 'FAIL'} "
              f"({result.get('seconds', 0)} s){error}", file=sys.stderr)
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    report["pass"] = all(r["pass"] for r in report["entries"].values())
    report["summary"] = _summary(report["entries"])
    return report


if __name__ == "__main__":  # one entry, in the process run_entry starts
    raise SystemExit(run_child(sys.argv[1], "--dry-run" in sys.argv[2:]))
