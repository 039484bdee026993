"""``rlvla3 bench band``: a reference band of a preset's success curve over seeds, and the check
that a new run's curve falls inside it.

``make`` runs ``rlvla3 rl --preset P`` once per seed (the rl command itself, in this process,
on one local Ray; each run in ``<work-dir>/seed<N>``, its console in ``<work-dir>/seed<N>.log``)
or reads finished run directories (``--from-runs``), takes each run's training success against
env steps from its ``metrics.jsonl`` and writes the band (``measure.cluster.bands``: the curves, the
preset, its ``--set`` overrides, the resolved config and its fingerprint, the env steps, the
seeds, the git commit). ``check`` re-runs the band's preset with its overrides on new seeds (or
reads finished runs) and judges each curve under the band's rule (``Rule.describe``).

Invariants: a curve is compared only with a band of the same resolved config (the fields that
name or place a run aside): a band of another preset or config is refused in one line, before
any run starts; a reference seed is never checked against its own band; every run's config is
validated before the first run starts; progress goes to stderr, one line as each seed starts
and ends, and the JSON result alone to stdout.

Example::

    rlvla3 bench band make --preset smoke --seeds 0 1 2 --band results/bands/smoke.json
    rlvla3 bench band check --band results/bands/smoke.json --seeds 3 4
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from envs import OPTIONS as ENV_OPTIONS
from measure.cluster.bands import (
    Band,
    BandError,
    BandMeta,
    Curve,
    Rule,
    check_curve,
    config_differences,
    make_band,
    read_band,
    run_config_data,
    write_band,
)
from rlvla3.checkpoint.storage import Storage
from rlvla3.config import ConfigError, build, to_dict
from rlvla3.policies import OPTIONS as POLICY_OPTIONS
from rlvla3.run_config import RunConfig, load_run_config, upgrade

RunRl = Callable[[list[str]], int]
"""``rlvla3 rl``'s ``main``: arguments in, exit status out."""

REPO = Path(__file__).resolve().parents[2]


class RunFailed(RuntimeError):
    """A seed's ``rlvla3 rl`` exited with a non-zero status (the message names its log)."""


@dataclass(frozen=True)
class MakeOptions:
    """What ``bench band make`` was asked."""

    preset: str
    """The ``rlvla3 rl --preset`` to run (or that the runs of ``from_runs`` started from)."""
    overrides: tuple[str, ...]
    """Its ``--set`` overrides (never ``seed``)."""
    seeds: tuple[int, ...]
    """Seeds to run (ignored with ``from_runs``)."""
    from_runs: tuple[str, ...]
    """Finished run directories to read instead of running."""
    work_dir: str
    """Where the runs of each seed go (``seed<N>`` and ``seed<N>.log``)."""
    band: str
    """The band file to write."""
    points: int
    """Grid points of the band."""
    rule: Rule


@dataclass(frozen=True)
class CheckOptions:
    """What ``bench band check`` was asked."""

    band: str
    """The band file to check against."""
    seeds: tuple[int, ...]
    """New seeds to run (empty: as many as the band has, after its highest)."""
    from_runs: tuple[str, ...]
    """Finished run directories to read instead of running."""
    work_dir: str | None
    """Where the runs of each seed go (default: ``runs/band-<preset>-check``)."""


@dataclass(frozen=True)
class SeedRun:
    """One finished run, as a band reads it."""

    seed: int
    run_dir: str
    curve: Curve
    config: dict[str, Any]
    """``run_config_data`` of its resolved config."""


def say(message: str) -> None:
    """One progress line on stderr."""
    print(f"bench band: {message}", file=sys.stderr, flush=True)


def config_data(cfg: RunConfig) -> dict[str, Any]:
    """What a band records of a run config: all of it but the fields that name a run, with
    the env's and the policy's options built into their dataclasses (a default spelled out
    in ``--set`` and one left out are the same config)."""
    data = run_config_data(to_dict(cfg))
    for section, table in (("env", ENV_OPTIONS), ("policy", POLICY_OPTIONS)):
        choice = getattr(cfg, section)
        module, name = table[choice.name].split(":")
        options = build(getattr(importlib.import_module(module), name), choice.options,
                        f"{section}.options")
        data[section] = {**data[section], "options": to_dict(options)}
    return data


def read_run(run_dir: str) -> SeedRun:
    """The seed, curve and config of a finished run directory (a path or URI)."""
    storage = Storage(run_dir)
    try:
        text = storage.read_text("metrics.jsonl")
    except FileNotFoundError:
        raise BandError(f"{run_dir}: no metrics.jsonl (not a run directory, or a run that "
                        "logged nothing)") from None
    try:
        saved = yaml.safe_load(storage.read_text("config.yaml"))
    except FileNotFoundError:
        raise BandError(f"{run_dir}: no config.yaml (not a run directory)") from None
    except yaml.YAMLError as exc:
        raise BandError(f"{run_dir}/config.yaml: not YAML ({' '.join(str(exc).split())})"
                        ) from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise BandError(f"{run_dir}/metrics.jsonl line {i}: not JSON ({exc})") from None
    try:
        cfg = build(RunConfig, upgrade(saved if isinstance(saved, dict) else {}))
    except ConfigError as exc:
        raise BandError(f"{run_dir}/config.yaml: {exc}") from None
    return SeedRun(cfg.seed, run_dir, Curve.from_rows(rows, f"{run_dir}/metrics.jsonl"),
                   config_data(cfg))


def revision() -> str | None:
    """The git commit of this checkout (``-dirty`` with changes to tracked files), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


@contextlib.contextmanager
def console_to(path: Path) -> Iterator[None]:
    """While active, file descriptors 1 and 2 write to ``path`` (a run's console: Python and
    native writes, Ray's forwarded actor output)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _stopped_by(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("stopped_by")
    except (OSError, ValueError, AttributeError):
        return None


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run_seeds(preset: str, overrides: Sequence[str], seeds: Sequence[int], work_dir: str,
              run_rl: RunRl, expected: dict[str, Any] | None = None) -> list[SeedRun]:
    """Run ``rlvla3 rl`` once per seed into ``<work_dir>/seed<N>``; every seed's config is
    built (and, with ``expected``, compared with it) before the first run starts."""
    for seed in seeds:
        cfg = load_run_config(preset, None, [*overrides, f"seed={seed}"])
        diff = [] if expected is None else config_differences(expected, config_data(cfg))
        if diff:
            raise BandError(f"--preset {preset} with the band's overrides now resolves to "
                            f"another config than the band's ({'; '.join(diff[:3])}): make "
                            "the band again")
        run_dir = Path(work_dir) / f"seed{seed}"
        if run_dir.exists() and any(run_dir.iterdir()):
            raise BandError(f"--work-dir: {run_dir} is not empty: choose another --work-dir, or "
                            "read finished runs with --from-runs")
    runs = []
    for seed in seeds:
        run_dir, log = Path(work_dir) / f"seed{seed}", Path(work_dir) / f"seed{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = ["--preset", preset, *(a for o in overrides for a in ("--set", o)),
                "--set", f"seed={seed}", "--run-dir", str(run_dir)]
        say(f"seed {seed}: rlvla3 rl {' '.join(argv)} (console: {log})")
        start = time.monotonic()
        with console_to(log):
            status = run_rl(argv)
        if status:
            raise RunFailed(f"seed {seed}: rlvla3 rl exited {status}: {_last_line(log)} "
                            f"(console: {log})")
        stopped_by = _stopped_by(run_dir)
        if stopped_by in ("SIGINT", "SIGTERM"):  # its curve ends early: no seed of a band
            raise RunFailed(f"seed {seed}: the run was stopped by {stopped_by} (console: {log})")
        run = read_run(str(run_dir))
        final = run.curve.final
        say(f"seed {seed}: done in {time.monotonic() - start:.0f} s, "
            + (f"{run.curve.env_steps[-1]} env steps, success {final.success:.3f} over the "
               f"last {final.window} episodes" if final else "no episode finished"))
        runs.append(run)
    return runs


def _read_runs(dirs: Sequence[str], expected: Mapping[str, Any], what: str,
               reference: Band | None = None) -> list[SeedRun]:
    """The finished runs of ``--from-runs``, each of config ``expected`` (``what`` names it),
    of its own seed and of none of ``reference``'s seeds."""
    runs = [read_run(d) for d in dirs]
    seen: dict[int, str] = {}
    for run in runs:
        if run.seed in seen:
            raise BandError(f"--from-runs: {seen[run.seed]} and {run.run_dir} both ran seed "
                            f"{run.seed}")
        seen[run.seed] = run.run_dir
        diff = config_differences(expected, run.config)
        if diff:
            raise BandError(f"--from-runs: {run.run_dir} ran another config than {what} "
                            f"({'; '.join(diff[:3])})")
    if reference is not None:
        _refuse_reference_seeds(reference, list(seen))
    for run in runs:
        say(f"seed {run.seed}: read {run.run_dir} ({len(run.curve)} progress rows)")
    return runs


def _refuse_seed_overrides(overrides: Sequence[str]) -> None:
    if any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        raise BandError("--set seed=...: the seeds are --seeds")


def make(opts: MakeOptions, run_rl: RunRl) -> dict[str, Any]:
    """Run (or read) the reference seeds and write the band; returns the JSON result."""
    _refuse_seed_overrides(opts.overrides)
    opts.rule.validate()
    if opts.points < 2:
        raise BandError(f"--points: a band needs at least 2, got {opts.points}")
    if not opts.from_runs and len(opts.seeds) < 2:
        raise BandError(f"--seeds: a band needs at least 2 reference seeds, got "
                        f"{list(opts.seeds)}")
    expected = config_data(load_run_config(opts.preset, None, [*opts.overrides]))
    if opts.from_runs:
        runs = _read_runs(opts.from_runs, expected,
                          f"--preset {opts.preset} with these --set")
    else:
        if len(set(opts.seeds)) != len(opts.seeds):
            raise BandError(f"--seeds: repeated seeds in {list(opts.seeds)}")
        runs = run_seeds(opts.preset, opts.overrides, opts.seeds, opts.work_dir, run_rl)
    meta = BandMeta(opts.preset, tuple(opts.overrides), expected, revision(),
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    {r.seed: r.run_dir for r in runs})
    total = expected["total_env_steps"]
    band = make_band(meta, {r.seed: r.curve for r in runs}, total, opts.points, opts.rule)
    write_band(band, Path(opts.band))
    say(f"wrote {opts.band}")
    finals = [r.curve.final for r in runs]
    return {"band": opts.band, "preset": opts.preset, "overrides": list(opts.overrides),
            "fingerprint": meta.fingerprint, "total_env_steps": total,
            "seeds": list(band.curves), "runs": {str(k): v for k, v in meta.runs.items()},
            "final_success": {str(r.seed): round(f.success, 4) for r, f in zip(runs, finals,
                                                                                strict=True)
                              if f is not None},
            "level": round(band.level(band.rule), 4), "rule": band.rule.describe()}


def _refuse_reference_seeds(band: Band, seeds: Sequence[int]) -> None:
    reference = sorted(set(band.curves) & set(seeds))
    if reference:
        raise BandError(f"seed {reference[0]} is one of the band's reference seeds "
                        f"{list(band.curves)}: check new seeds")


def _verdict(band: Band, run: SeedRun) -> dict[str, Any]:
    verdict = check_curve(band, run.curve, band.rule)
    points = verdict.pop("points")
    return {"run": run.run_dir, **verdict,
            "outside": [{"env_steps": p["env_steps"], "side": p["side"]} for p in points
                        if p["inside"] is False]}


def check(opts: CheckOptions, run_rl: RunRl) -> dict[str, Any]:
    """Run (or read) new seeds and judge each curve against the band; returns the JSON result
    (``inside``: every curve inside)."""
    band = read_band(Path(opts.band))
    meta = band.meta
    if opts.from_runs:
        runs = _read_runs(opts.from_runs, meta.config, f"the band {opts.band}", band)
    else:
        seeds = opts.seeds or tuple(range(max(band.curves) + 1,
                                          max(band.curves) + 1 + len(band.curves)))
        if len(set(seeds)) != len(seeds):
            raise BandError(f"--seeds: repeated seeds in {list(seeds)}")
        _refuse_reference_seeds(band, seeds)
        runs = run_seeds(meta.preset, meta.overrides, seeds,
                         opts.work_dir or f"runs/band-{meta.preset}-check", run_rl,
                         expected=dict(meta.config))
    verdicts = {str(run.seed): _verdict(band, run) for run in runs}
    for seed, verdict in verdicts.items():
        left = verdict["left_band"]
        say(f"seed {seed}: " + ("inside" if verdict["inside"] else "outside") + " the band"
            + (f"; first left it at {left['env_steps']} env steps ({left['side']})"
               if left else ""))
    return {"band": opts.band, "preset": meta.preset, "fingerprint": meta.fingerprint,
            "band_revision": meta.revision, "revision": revision(),
            "rule": band.rule.describe(), "inside": all(v["inside"] for v in verdicts.values()),
            "seeds": verdicts}
