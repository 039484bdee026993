"""``rlvla3 eval --recheck DIR``: run a random subset of a finished evaluation again and say
whether every episode comes out the same.

Role: an evaluation's episodes are functions of (checkpoint, task, initial state, seeds,
settings) alone (``actors.eval.worker``), so anyone holding the checkpoint can re-check a
published figure on a few episodes instead of all of them. The re-check reads what ``DIR``
evaluated (``eval.json``'s identity, ``results.json``'s fingerprint and episodes), draws
``--sample`` of its episodes with ``--sample-seed``, evaluates exactly those with the same
settings (the same numerics mode and BLAS kernels included) into ``--output-dir`` (default
``DIR/recheck``), and compares each episode's outcome, step count and, where both have one,
its action digest.

Inputs: ``DIR`` and, when the checkpoint moved since, ``--checkpoint`` (its weights must hash
to the sha256 ``DIR`` names). Output: a JSON-able report (``matching``, ``outcome_flips``,
``step_differences``, ``digest_differences``, the mismatched episodes, the episodes that could
not be re-run (``faults``), the fingerprint fields that differ); ``rlvla3 eval`` exits 1 when
an episode differs and 3 when none differs but some could not be re-run.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from actors.eval.compare import legacy_fields
from actors.eval.options import EvalOptions
from rlvla3.checkpoint.storage import Storage
from rlvla3.config import ConfigError
from rlvla3.fingerprint import PLAN_FIELDS, checkpoint_identity, fingerprint_differences
from rlvla3.numerics import HOST_BLAS

Episode = tuple[int, int]
"""(suite task, initial state)."""


def stored_rows(results: Mapping[str, Any]) -> dict[Episode, dict[str, Any]]:
    """Every episode of a ``results.json`` dict: ``(task, state) -> its by_init_state row``."""
    return {
        (int(task), int(row["init_state"])): row
        for task, entry in results["tasks"].items()
        for row in entry["by_init_state"]
    }


def sample_episodes(episodes: Sequence[Episode], n: int, seed: int) -> list[Episode]:
    """``n`` of ``episodes`` drawn without replacement by ``seed`` (all when fewer), sorted."""
    ordered = sorted(episodes)
    return sorted(random.Random(seed).sample(ordered, min(n, len(ordered))))


def compare_rows(
    stored: Mapping[Episode, Mapping[str, Any]], now: Mapping[Episode, Mapping[str, Any]]
) -> dict[str, Any]:
    """Episode by episode: outcome, steps and (when both have one) action digest. An episode
    that did not run to its end on either side (a ``fault`` row: a lost worker, a crashed
    simulator) is not compared but listed in ``faults``: it says nothing about reproducibility,
    and re-running the same command runs it again."""
    mismatches, faults, flips, steps, digests, digest_checked = [], [], 0, 0, 0, 0
    for key in sorted(now):
        a, b = stored[key], now[key]
        if a.get("fault") or b.get("fault"):
            faults.append({"task": key[0], "init_state": key[1],
                           "fault": b.get("fault") or f"stored: {a.get('fault')}"})
            continue
        flip = bool(a["success"]) != bool(b["success"])
        step = a["steps"] != b["steps"]
        both = "digest" in a and "digest" in b
        digest = both and a["digest"] != b["digest"]
        digest_checked += both
        flips, steps, digests = flips + flip, steps + step, digests + digest
        if flip or step or digest:
            mismatches.append(
                {
                    "task": key[0],
                    "init_state": key[1],
                    "stored": {k: a.get(k) for k in ("success", "steps", "digest")},
                    "now": {k: b.get(k) for k in ("success", "steps", "digest")},
                }
            )
    compared = len(now) - len(faults)
    return {
        "checked": compared,
        "matching": compared - len(mismatches),
        "outcome_flips": flips,
        "step_differences": steps,
        "digest_checked": digest_checked,
        "digest_differences": digests,
        "mismatches": mismatches,
        "faults": faults,
    }


def recheck_status(report: Mapping[str, Any]) -> int:
    """``rlvla3 eval --recheck``'s exit status: 0 every episode identical, 1 an episode differs,
    3 none differs but some could not be re-run (run the same command again)."""
    if report["mismatches"]:
        return 1
    return 3 if report["faults"] else 0


def _acting(acting: str) -> dict[str, Any]:
    """``--sampled/--noise-level/--init-noise`` of a stored ``acting`` string."""
    words = acting.split()
    if not words or words[0] != "sampled":
        return {"sampled": False, "noise_level": None, "init_noise": None}
    options = dict(word.split("=", 1) for word in words[1:])
    return {
        "sampled": True,
        "noise_level": _float(options.get("noise_level")),
        "init_noise": _float(options.get("init_noise")),
    }


def _float(text: str | None) -> float | None:
    return None if text is None else float(text)


def rerun_args(
    args: EvalOptions, source: Path, episodes: list[Episode]
) -> EvalOptions:
    """The ``rlvla3 eval`` arguments that evaluate ``episodes`` exactly as ``source`` did."""
    header = json.loads((source / "eval.json").read_text())
    identity = legacy_fields(header["identity"], {})
    identity.setdefault("numerics", "native")  # evaluations before pinning ran natively
    identity.setdefault("blas", HOST_BLAS)  # and before the kernels were pinned, the host's
    fp = header.get("fingerprint", {})
    policy = str(identity["policy"])
    checkpoint = None
    if not policy.startswith("random"):
        checkpoint = args.checkpoint or fp.get("checkpoint", {}).get("path")
        if not checkpoint or not Storage(checkpoint).exists():  # a path or a storage URI
            raise ConfigError(
                "--checkpoint",
                f"{source} evaluated {checkpoint!r}, which is not "
                "here: give the checkpoint with --checkpoint",
            )
        sha = checkpoint_identity(checkpoint)["sha256"]
        if sha != policy:
            raise ConfigError(
                "--checkpoint",
                f"{checkpoint} holds weights {sha[:12]}..., but "
                f"{source} evaluated {policy[:12]}...",
            )
    elif args.checkpoint:
        raise ConfigError("--checkpoint", f"{source} evaluated a built-in policy ({policy})")
    return dataclasses.replace(
        args,
        **{
            "suite": identity["suite"],
            "placements": identity["placements"],
            "placement_seed": identity["placement_seed"],
            "checkpoint": checkpoint,
            "policy": None if checkpoint else "random",
            "image_size": tuple(identity["image_size"]),
            "max_steps": identity["max_steps"],
            "no_fast_render": not identity["fast_render"],
            "seed": identity["seed"] if identity["seed"] is not None else 0,
            "language": identity.get("language", "own"),
            "numerics": identity["numerics"],
            "blas": identity["blas"],
            **_acting(str(identity["acting"])),
            "episodes": tuple(episodes),
            "task_ids": (),
            "init_ids": (),
            "videos": 0,
            "output_dir": args.output_dir or str(source / "recheck"),
            "recheck": None,
            "compare": (),
        }
    )


def recheck(
    args: EvalOptions, run: Callable[[EvalOptions], dict[str, Any]]
) -> dict[str, Any]:
    """Re-run ``--sample`` episodes of ``args.recheck`` with ``run`` (``rlvla3 eval``'s) and
    compare them with the stored ones."""
    if not args.recheck:
        raise ValueError("recheck: no evaluation to re-check (--recheck EVAL_DIR)")
    source = Path(args.recheck)
    if source.name == "results.json":
        source = source.parent
    for name in ("eval.json", "results.json"):
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source} is not an evaluation's output ({name} missing)")
    results = json.loads((source / "results.json").read_text())
    stored = stored_rows(results)
    episodes = sample_episodes(list(stored), args.sample, args.sample_seed)
    summary = run(rerun_args(args, source, episodes))
    report = compare_rows(stored, {k: stored_rows(summary)[k] for k in episodes})
    return {
        "recheck": str(source),
        "sample_seed": args.sample_seed,
        "episodes": [list(e) for e in episodes],
        **report,
        "fingerprint_differences": fingerprint_differences(
            *(
                {k: v for k, v in fp.items() if k not in PLAN_FIELDS}
                for fp in (results.get("fingerprint", {}), summary["fingerprint"])
            )
        ),
        "output_dir": summary["output_dir"],
    }


def recheck_line(report: Mapping[str, Any]) -> str:
    """One line for the terminal: how many re-run episodes match, and how the others differ."""
    line = (
        f"re-checked {report['checked']} episodes of {report['recheck']}: "
        f"{report['matching']} identical"
    )
    if report["digest_checked"]:
        line += f" ({report['digest_checked']} compared action by action)"
    if report["mismatches"]:
        line += (
            f"; {report['outcome_flips']} outcomes flipped, {report['step_differences']} "
            f"step counts and {report['digest_differences']} action digests differ"
        )
    if report["faults"]:
        line += (
            f"; {len(report['faults'])} not re-run ({report['faults'][0]['fault']}): the same "
            "command runs them again"
        )
    for diff in report["fingerprint_differences"]:
        line += f"\n  fingerprint: {diff}"
    return line
