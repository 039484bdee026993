"""Per-decision traces of evaluation episodes, and the decision at which two traces part.

Role: an episode's digest (``EpisodeOutcome.digest``) says *whether* two runs of it took the
same actions; a trace says *where* they parted and *in what*. For every decision it holds a
short hash of each camera image and of the proprioceptive state the policy was given, and of
the action it returned. ``rlvla3 eval --trace`` writes one JSON-lines file per episode,
``trace/task{T}_init{K}.jsonl`` (suite task, initial state), into the output directory (a
re-check with ``--trace`` too); ``python -m actors.eval.trace A B`` compares two output
directories (or two trace files) episode by episode and prints, for each episode both hold,
the first decision at which they differ and which of its fields do.

Reading a divergence: observation fields that differ while every earlier action was identical
mean the simulator (physics, controller or renderer) went elsewhere on the same actions; an
action that differs on an identical observation means the policy's arithmetic did.

Inputs: observations and actions as the eval worker has them. Outputs: ``decision_hashes``
rows ``{camera: hash, ..., "state": hash, "action": hash}`` (12 hex digits of the sha256 of the
exact bytes: uint8 images, float32 state and action, as the digest hashes actions), and
``first_divergence`` reports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.types import Observation

TRACE_DIR = "trace"
"""Where an evaluation's output directory keeps its traces."""
_NAME = re.compile(r"task(\d+)_init(\d+)\.jsonl$")


def _hash(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]


def decision_hashes(obs: Observation, action: np.ndarray) -> dict[str, str]:
    """One decision: each camera image the policy saw, its state and the action it took."""
    row = {camera: _hash(obs.images[camera]) for camera in sorted(obs.images)}
    row["state"] = _hash(np.asarray(obs.state, dtype=np.float32))
    row["action"] = _hash(np.asarray(action, dtype=np.float32))
    return row


def trace_name(task: int, init_state: int) -> str:
    """The file name of one episode's trace (suite task, initial state)."""
    return f"task{task}_init{init_state}.jsonl"


def write_trace(path: Path, rows: Sequence[Mapping[str, str]]) -> None:
    """One JSON line per decision."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(row)) + "\n" for row in rows))


def read_traces(path: str | Path) -> dict[tuple[int, int], list[dict[str, str]]]:
    """``(task, initial state) -> rows`` of an output directory's traces, of a directory of
    trace files, or of one trace file."""
    path = Path(path)
    if path.is_dir() and (path / TRACE_DIR).is_dir():
        path = path / TRACE_DIR
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    traces = {}
    for file in files:
        match = _NAME.search(file.name)
        if match is None:
            raise ValueError(f"{file} is not an episode trace (task<T>_init<K>.jsonl)")
        key = (int(match[1]), int(match[2]))
        traces[key] = [json.loads(line) for line in file.read_text().splitlines() if line]
    return traces


def first_divergence(a: Sequence[Mapping[str, str]],
                     b: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """Where two traces of one episode part: ``decision`` (None when identical), the
    ``fields`` that differ there, ``part``: ``observation`` (the simulator gave another
    observation after identical actions; the action then differs too, as a consequence),
    ``action`` (the policy answered an identical observation differently) or ``length`` (one
    ended earlier, identical until then), and both traces' lengths."""
    out: dict[str, Any] = {"decision": None, "part": "", "fields": [],
                           "decisions": [len(a), len(b)]}
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        fields = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if fields:
            part = "action" if fields == ["action"] else "observation"
            return {**out, "decision": i, "part": part, "fields": fields}
    if len(a) != len(b):
        return {**out, "decision": min(len(a), len(b)), "part": "length"}
    return out


def compare_traces(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Every episode both ``a`` and ``b`` traced: its first divergence."""
    ta, tb = read_traces(a), read_traces(b)
    common = sorted(set(ta) & set(tb))
    episodes = [{"task": t, "init_state": k, **first_divergence(ta[t, k], tb[t, k])}
                for t, k in common]
    return {
        "a": str(a),
        "b": str(b),
        "episodes": episodes,
        "identical": sum(e["decision"] is None for e in episodes),
        "only_in_a": [list(k) for k in sorted(set(ta) - set(tb))],
        "only_in_b": [list(k) for k in sorted(set(tb) - set(ta))],
    }


def _line(episode: Mapping[str, Any]) -> str:
    head = f"task {episode['task']} state {episode['init_state']}: "
    if episode["decision"] is None:
        return head + f"identical over {episode['decisions'][0]} decisions"
    what = {"observation": "the observation differs after identical actions",
            "action": "the action differs on an identical observation",
            "length": "one run ended there, identical until then"}[episode["part"]]
    fields = f" ({', '.join(episode['fields'])})" if episode["fields"] else ""
    return head + f"first divergence at decision {episode['decision']}: {what}{fields}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.eval.trace",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("a", help="an evaluation output directory made with --trace, a "
                        "directory of traces or one trace file")
    parser.add_argument("b", help="the same, of another run of the same episodes")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = compare_traces(args.a, args.b)
    if args.json:
        print(json.dumps(report))
    else:
        for episode in report["episodes"]:
            print(_line(episode))
        if not report["episodes"]:
            print("no episode is traced in both")
    return 0 if report["identical"] == len(report["episodes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
