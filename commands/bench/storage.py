"""``rlvla3 bench storage``: what a checkpoint costs on a run's storage, against a local disk
(``measure.cluster.bench_storage``: what is timed and why). Prints the figures per policy, or with
``--json`` one JSON object; an unknown policy or ``--repeats`` below 1 is exit status 2."""

from __future__ import annotations

import argparse
import json
import sys

from measure.cluster import bench_storage


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench storage",
                                description=bench_storage.__doc__.split("\n")[0])
    p.add_argument("--storage", required=True, help="a storage URI or path to measure")
    p.add_argument("--policies", default="default,vla-300m",
                   help=f"comma-separated, of: {', '.join(bench_storage.POLICIES)}")
    p.add_argument("--optimizer", choices=["adam", "none"], default="adam",
                   help="checkpoint an Adam state beside the weights (as a learner does)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = args.policies.split(",")
    unknown = [n for n in names if n not in bench_storage.POLICIES]
    if unknown or args.repeats < 1:
        print(f"rlvla3 bench storage: unknown policies {unknown} or --repeats < 1",
              file=sys.stderr)
        return 2
    result = bench_storage.against_local(args.storage, names, args.repeats, args.optimizer)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, row in result["policies"].items():
        st, lo = row["storage"], row["local"]
        print(f"{name} ({st['parameters'] / 1e6:.1f}M parameters, {st['mb']} MB): learner pause "
              f"{st['pause_s']:.3f}s; write {st['write_s']:.2f}s (local {lo['write_s']:.2f}s), "
              f"restore {st['restore_s']:.2f}s (local {lo['restore_s']:.2f}s)")
    return 0
