"""``rlvla3 bench gpu``: the GPU check. One command that measures every GPU path of the VLA
against its reference on a machine with one NVIDIA GPU, prepared to work the first time such a
machine is lent (docs/guides/gpu-check.md).

Entries (``rlvla3.model.gpu_checks``): packed varlen attention vs the exact per-segment path;
packed vs padded bf16 training step at pi0.5 shapes; FP8 block-scaled linears (torchao) vs bf16;
the RL path (``act`` / ``evaluate``, log-probability agreement, decisions/s); the FP8 training
step; the VLA's cost model; GR00T-N1.5's cost model and packed vs padded step (``groot``). ``--dry-run`` runs exactly this code on CPU at tiny shapes (per-segment attention,
emulated FP8), so CI keeps the command from rotting. Without a GPU and without ``--dry-run`` it
prints a JSON object saying it skipped, and exits 0.

Isolation and time: each entry runs in its own Python process, killed at the entry's timeout or
when the whole budget (``--budget``, eight minutes on a GPU) is spent; a hang, a
crash or a CUDA error stays in its entry, which then fails and still reports what it measured
(entries print a complete snapshot after each step). Imports: torch, numpy and the Ray-free
core only (the GPU image has no Ray); torchao, triton, flash-attn and transformer-engine when
importable.

Output: one JSON object: versions, device, ``pass`` (all entries passed), ``summary`` (the
headline speed-ups) and ``entries`` (each with ``pass``, its figures, the backends that ran and
``seconds``). Exit status 0 when every entry passed (or the check was skipped), 1 otherwise.
Entry point: ``main(argv) -> int``.
"""

from __future__ import annotations

import argparse
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

import torch

from rlvla3.model.gpu_checks import DRY_RUN, ENTRIES, GPU, Context

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
    sizes = DRY_RUN if dry_run else GPU
    if dry_run:
        torch.set_num_threads(1)  # tiny shapes: one thread is fastest on a shared machine
    ctx = Context(torch.device("cpu" if dry_run else "cuda"), sizes)
    snap: dict = {}
    try:
        for snap in ENTRIES[name](ctx):
            print(json.dumps(snap), flush=True)
    except Exception as exc:
        print(json.dumps({**snap, "pass": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=6)[-3000:]}), flush=True)
        return 1
    return 0


def run_entry(name: str, dry_run: bool, timeout: float) -> dict:
    """Run entry ``name`` in a fresh Python process for at most ``timeout`` seconds."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # later entries reuse earlier tuning
    cmd = [sys.executable, "-m", "rlvla3.model.bench_gpu", "--entry", name]
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


def _summary(entries: dict) -> dict:
    pick = {
        "attention_speedup_over_padded": ("attention", "speedup_over_padded"),
        "packing_speedup": ("packing", "speedup"),
        "packing_token_ratio": ("packing", "token_ratio"),
        "fp8_linear_model_weighted_speedup": ("fp8_linear", "model_weighted_speedup"),
        "fp8_training_speedup": ("fp8_training", "speedup"),
    }
    out = {key: entries.get(e, {}).get(field) for key, (e, field) in pick.items()}
    rl = entries.get("rl", {}).get("dtypes", {})
    out["rl_decisions_per_s"] = next((r["decisions_per_s"] for r in rl.values()
                                      if "decisions_per_s" in r), None)
    out["cost_model"] = entries.get("costs", {}).get("cost_model")
    out["groot_cost_model"] = entries.get("groot", {}).get("cost_model")
    out["groot_packing_speedup"] = entries.get("groot", {}).get("packing", {}).get("speedup")
    return out


def run_check(names: list[str], dry_run: bool, budget: float) -> dict:
    sizes = DRY_RUN if dry_run else GPU
    start = time.monotonic()
    report = {
        "check": "rlvla3 bench gpu", "gpu": torch.cuda.is_available() and not dry_run,
        "dry_run": dry_run, **_device(),
        "versions": {"python": platform.python_version(), "cuda": torch.version.cuda,
                     **{p: _version(p) for p in PACKAGES}},
        "budget_s": budget, "entries": {},
    }
    for name in names:
        left = budget - (time.monotonic() - start)
        if left < MIN_ENTRY_S:
            result = {"pass": False, "error": f"not run: {left:.0f} s of the budget left"}
        else:
            result = run_entry(name, dry_run, min(sizes.timeouts.get(name, left), left))
        report["entries"][name] = result
        error = f": {result['error']}" if "error" in result else ""
        print(f"bench gpu: {name}: {'pass' if result['pass'] else 'FAIL'} "
              f"({result.get('seconds', 0)} s){error}", file=sys.stderr)
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    report["pass"] = all(r["pass"] for r in report["entries"].values())
    report["summary"] = _summary(report["entries"])
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlvla3 bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line (else indented)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run the same code on CPU at tiny shapes (timings meaningless)")
    ap.add_argument("--only", default=",".join(ENTRIES),
                    help=f"comma-separated entries to run (default: {','.join(ENTRIES)})")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check (default: 480 on a GPU, 500 dry run)")
    ap.add_argument("--entry", choices=sorted(ENTRIES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.entry:
        return run_child(args.entry, args.dry_run)
    if not torch.cuda.is_available() and not args.dry_run:
        print(json.dumps({"gpu": False, "skipped": True,
                          "reason": "no NVIDIA GPU visible to torch; nothing to check "
                                    "(--dry-run runs the same code on CPU)"}))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENTRIES))
    if unknown:
        ap.error(f"unknown entries {unknown}; choose from {', '.join(ENTRIES)}")
    budget = args.budget or (DRY_RUN if args.dry_run else GPU).budget_s
    report = run_check(names, args.dry_run, budget)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
