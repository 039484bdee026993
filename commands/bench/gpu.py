"""``rlvla3 bench gpu``: the GPU check (``measure.gpu.bench_gpu``: its entries, isolation
and output). Prints the JSON report (and writes it to ``--report``); exit status 0 when every
entry passed or there is no GPU to check (a JSON object says it skipped), 1 otherwise. Imports
the Ray-free core only: the GPU image has no Ray."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from measure.gpu import bench_gpu
from measure.gpu.check_context import sizes_for
from measure.gpu.gpu_checks import ENTRIES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench gpu",
                                description=bench_gpu.__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line (else indented)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the same code on CPU at tiny shapes (timings meaningless)")
    p.add_argument("--only", default=",".join(ENTRIES),
                   help="comma-separated entries to run (default: all): " + "; ".join(
                       f"{k}: {e.what}" for k, e in ENTRIES.items()))
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check (default: 630 on a GPU, 500 dry run)")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="also write the JSON report to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print(json.dumps({"gpu": False, "skipped": True,
                          "reason": "no NVIDIA GPU visible to torch; nothing to check "
                                    "(--dry-run runs the same code on CPU)"}))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENTRIES))
    if unknown:
        p.error(f"unknown entries {unknown}; choose from {', '.join(ENTRIES)}")
    budget = args.budget or sizes_for(args.dry_run).budget_s
    report = bench_gpu.run_check(names, args.dry_run, budget)
    print(json.dumps(report, indent=None if args.json else 2))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["pass"] else 1
