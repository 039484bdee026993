"""``rlvla3 bench band make | check``: a preset's reference band of success against env steps
over seeds, and whether new seeds' curves fall inside it (``measure.cluster.bench_band``, whose
docstring is the help; the arithmetic and the file are ``measure.cluster.bands``).

Each seed runs as ``rlvla3 rl`` does (``commands.rl.main``, in this process, on local Ray);
``--set`` addresses the same ``RunConfig``. Progress lines go to stderr and one JSON object to
stdout. Exit status: 0; 1 when ``check`` finds a curve outside the band or a seed's run fails;
2 for bad input (a missing or corrupt band file, a band of another preset or config, a run
directory without ``metrics.jsonl``), said in one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from actors.runtime.jsonout import json_text, stdout_to_stderr
from measure.cluster import bench_band
from measure.cluster.bands import BandError, Rule
from rlvla3.config import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench band", description=bench_band.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True, metavar="{make,check}")
    make = sub.add_parser("make", help="run (or read) reference seeds and write the band",
                          description="Run a preset once per seed (or read finished runs) and "
                                      "write its reference band.")
    make.add_argument("--preset", required=True,
                      help="the rlvla3 rl preset (with --from-runs: the one the runs started "
                           "from)")
    make.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="A.B=VALUE", help="override one field of the runs (repeatable; "
                                                "not seed)")
    make.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], metavar="SEED",
                      help="reference seeds, one run each (at least 2)")
    make.add_argument("--band", metavar="FILE",
                      help="the band file to write (default: results/bands/<preset>.json)")
    make.add_argument("--points", type=int, default=20,
                      help="env-step points the band is read at")
    rule = Rule()
    make.add_argument("--min-inside", type=float, default=rule.min_inside,
                      help="fraction of the points at which a new curve must be inside")
    make.add_argument("--level-fraction", type=float, default=rule.level_fraction,
                      help="the level whose env steps to reach are judged, as a fraction of the "
                           "reference seeds' median final success")
    check = sub.add_parser("check", help="run (or read) new seeds and judge their curves",
                           description="Run the band's preset on new seeds (or read finished "
                                       "runs) and say whether each curve falls inside the band; "
                                       "exit 1 when one does not.")
    check.add_argument("--band", metavar="FILE", required=True, help="the band file")
    check.add_argument("--seeds", type=int, nargs="+", default=[], metavar="SEED",
                       help="new seeds (default: as many as the band has, after its highest)")
    for command in (make, check):
        command.add_argument("--from-runs", nargs="+", default=[], metavar="RUN_DIR",
                             help="read these finished run directories instead of running")
        command.add_argument("--work-dir", metavar="DIR",
                             help="where each seed's run goes, seed<N>/ and its console "
                                  "seed<N>.log (default: runs/band-<preset>, or "
                                  "runs/band-<preset>-check)")
    return p


def _run_rl(argv: list[str]) -> int:
    from commands import rl

    return rl.main(argv)


def _measure(args: argparse.Namespace) -> dict:
    if args.mode == "make":
        opts = bench_band.MakeOptions(
            args.preset, tuple(args.overrides), tuple(args.seeds), tuple(args.from_runs),
            args.work_dir or f"runs/band-{args.preset}",
            args.band or f"results/bands/{args.preset}.json", args.points,
            Rule(min_inside=args.min_inside, level_fraction=args.level_fraction))
        return bench_band.make(opts, _run_rl)
    return bench_band.check(bench_band.CheckOptions(
        args.band, tuple(args.seeds), tuple(args.from_runs),
        args.work_dir), _run_rl)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with stdout_to_stderr():
        try:
            out = _measure(args)
        except (BandError, ConfigError) as exc:
            print(f"rlvla3 bench band: {exc}", file=sys.stderr)
            return 2
        except bench_band.RunFailed as exc:
            print(f"rlvla3 bench band: {exc}", file=sys.stderr)
            return 1
        finally:
            ray = sys.modules.get("ray")  # started by a seed's run, if any ran
            if ray is not None and ray.is_initialized():
                ray.shutdown()
    print(json_text(out))
    return 0 if out.get("inside", True) else 1
