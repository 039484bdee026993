"""Paired comparison of two evaluations: ``rlvla3 eval --compare A B``'s statistics and tables.

Role: pure functions over ``results.json`` dicts (no Ray, no simulator), used by
``actors.eval.evaluate.compare``, which produces or reads the two results first.

- ``compare_results(a, b)``: B - A on the episodes both evaluated (keyed by suite task and
  initial state): the paired 2x2 table, the exact McNemar p-value and Newcombe's interval of
  the difference, overall and per task, and the fingerprint fields in which the two differ.
- ``compare_table(report)``: the same as a terminal table.
- ``comparison_markdown(report, a, b)``: the multi-task table a paper or README shows: per
  task and for the suite, each side's successes with its Wilson 95% interval, the paired
  difference with its interval and the McNemar p-value. Written next to ``comparison.json``
  as ``comparison.md``.
- ``compare_family(results, names)``: several policies B, C, ... each against one baseline
  A (``--compare A B C ...``): one report each, and their suite p-values adjusted by Holm's
  step-down method, so that picking the best of several runs is not mistaken for a
  significant gain; ``family_markdown`` is its summary table.

Invariant: every figure is computed on the paired episodes only, so the two sides' rates,
intervals and their difference describe the same episodes (unpaired ones are counted in
``unpaired_episodes`` and left out); an episode a fault ended is never an outcome, so it
pairs with nothing. ``rlvla3 eval --compare`` refuses an incomplete evaluation before it
gets here, unless told ``--allow-incomplete``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyarrow.fs import FileType

from rlvla3.checkpoint.storage import Storage, basename, parent
from rlvla3.confidence import compare_paired, holm, wilson
from rlvla3.fingerprint import fingerprint_differences


def legacy_fields(stored: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``stored`` (an identity or fingerprint) with the fields that outputs written before they
    existed lack: ``acting`` was never sampled, so it is ``now``'s unless ``now`` samples;
    the policy was told each task's own instruction (``language``)."""
    if "language" not in stored:
        stored = {**stored, "language": "own"}
    if "acting" in stored or str(now.get("acting", "")).startswith("sampled"):
        return stored
    return {**stored, "acting": now.get("acting")}


def load_results(path: str | Path) -> dict[str, Any] | None:
    """The ``results.json`` at ``path`` (the file, or an eval output directory; a path or a
    storage URI); None when ``path`` is not an evaluation's output (then it should be a
    checkpoint)."""
    store = Storage(path)
    if store.kind() == FileType.Directory:
        store = store.child("results.json")
    if store.kind() == FileType.File and basename(store.uri).endswith(".json"):
        return json.loads(Storage(parent(store.uri)).read_text(basename(store.uri)))
    return None


def outcomes_by_episode(results: dict[str, Any]) -> dict[tuple[str, int], bool]:
    """``(suite task, initial state) -> success`` of every episode in a results dict that ran
    to its end (one a fault ended is no outcome of the policy)."""
    return {
        (task, int(e["init_state"])): bool(e["success"])
        for task, row in results["tasks"].items()
        for e in row["by_init_state"]
        if not e.get("fault")
    }


def _task_order(task: str) -> tuple[int, int | str]:
    return (0, int(task)) if task.isdigit() else (1, task)


def compare_results(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B vs A on the episodes both evaluated: overall and per-task paired statistics."""
    ea, eb = outcomes_by_episode(a), outcomes_by_episode(b)
    keys = sorted(set(ea) & set(eb), key=lambda k: (_task_order(k[0]), k[1]))
    overall = compare_paired([ea[k] for k in keys], [eb[k] for k in keys])
    per_task = {}
    for task in sorted({k[0] for k in keys}, key=_task_order):
        mine = [k for k in keys if k[0] == task]
        per_task[task] = compare_paired([ea[k] for k in mine], [eb[k] for k in mine]).to_dict()
    if a.get("placements", "bundled") != b.get("placements", "bundled"):
        differences = [f"placements: {a.get('placements')!r} != {b.get('placements')!r}"]
    else:
        differences = []
    fa, fb = a.get("fingerprint", {}), b.get("fingerprint", {})
    differences += fingerprint_differences(legacy_fields(fa, fb), legacy_fields(fb, fa))
    sha_a = (fa.get("checkpoint") or {}).get("sha256")
    if sha_a and sha_a == (fb.get("checkpoint") or {}).get("sha256"):
        differences.append(f"checkpoint: A and B hold the same weights (sha256 {sha_a[:12]})")
    return {
        "a": a.get("policy"),
        "b": b.get("policy"),
        "paired": overall.to_dict(),
        "tasks": per_task,
        "unpaired_episodes": len(set(ea) ^ set(eb)),
        "fingerprint_differences": sorted(set(differences)),
    }


def compare_table(report: dict[str, Any]) -> Any:
    """``report`` (from ``compare_results``) as a rich table, one row per task and the suite."""
    from rich.table import Table

    table = Table(title=f"B - A   (A: {report['a']}, B: {report['b']})")
    for col in ("task", "pairs", "A", "B", "only A", "only B", "B - A", "95% CI", "McNemar p"):
        table.add_column(col, justify="right", no_wrap=True)

    def row(name: str, p: dict[str, Any], **kw: Any) -> None:
        table.add_row(name, str(p["pairs"]), f"{p['rate_a']:.3f}", f"{p['rate_b']:.3f}",
                      str(p["only_a"]), str(p["only_b"]), f"{p['difference']:+.3f}",
                      f"{p['ci95'][0]:+.3f}..{p['ci95'][1]:+.3f}", _p_value(p["mcnemar_p"]),
                      **kw)

    for task, p in report["tasks"].items():
        row(task, p)
    row("all", report["paired"], end_section=True)
    return table


def _p_value(p: float) -> str:
    return "1.0" if p >= 1 else f"{p:.2f}" if p >= 0.1 else f"{p:.2g}"


def _side(successes: int, n: int, digits: int) -> str:
    low, high = wilson(successes, n)
    rate = successes / n if n else 0.0
    return f"{successes}/{n} = {rate:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", "\u2212")


def _won(p: dict[str, Any], side: str, digits: int) -> str:
    """Side ``"a"`` or ``"b"`` of a paired comparison: its successes with their interval."""
    return _side(p["both"] + p[f"only_{side}"], p["pairs"], digits)


def _difference(p: dict[str, Any], digits: int) -> str:
    """B - A with Newcombe's interval."""
    low, high = p["ci95"]
    return (f"{_signed(p['difference'], digits)} [{_signed(low, digits)}, "
            f"{_signed(high, digits)}]")


def comparison_markdown(report: dict[str, Any], a: dict[str, Any] | None = None,
                        b: dict[str, Any] | None = None, names: tuple[str, str] = ("A", "B"),
                        ) -> str:
    """The paired comparison as a Markdown table: per task and for the suite, A's and B's
    successes with Wilson 95% intervals, B - A with Newcombe's interval, McNemar's p.

    ``a``/``b`` (the compared results) lend each task its instruction; ``names`` head the
    columns. All figures are over the paired episodes."""
    instructions = {**(a or {}).get("tasks", {}), **(b or {}).get("tasks", {})}
    head = f"| task | A: {names[0]} | B: {names[1]} | B \u2212 A [95%] | McNemar p |"
    lines = [head, "|---|---|---|---|---|"]

    def line(name: str, p: dict[str, Any], digits: int, bold: bool = False) -> str:
        cells = [_won(p, "a", digits), _won(p, "b", digits), _difference(p, digits),
                 _p_value(p["mcnemar_p"])]
        if bold:
            cells = [f"**{c}**" for c in cells]
        return "| " + " | ".join([name, *cells]) + " |"

    for task, p in report["tasks"].items():
        instruction = (instructions.get(task) or {}).get("instruction")
        lines.append(line(f"{task} {instruction}" if instruction else task, p, 2))
    lines.append(line("all", report["paired"], 3, bold=True))
    notes = [f"A: {report['a']}; B: {report['b']}; {report['paired']['pairs']} paired episodes"
             f" ({report['paired']['only_a']} only A, {report['paired']['only_b']} only B)."]
    if report.get("unpaired_episodes"):
        notes.append(f"{report['unpaired_episodes']} episodes evaluated for only one side are "
                     "left out.")
    notes += [f"Fingerprints differ: {d}." for d in report.get("fingerprint_differences", [])]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def compare_family(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """``results[1:]`` each against ``results[0]``; ``holm``: the suite McNemar p-values
    adjusted for the number of comparisons (Holm's step-down, family-wise 5% at < 0.05)."""
    reports = {name: compare_results(results[0], other)
               for name, other in zip(names[1:], results[1:], strict=True)}
    adjusted = holm([r["paired"]["mcnemar_p"] for r in reports.values()])
    return {"baseline": names[0], "comparisons": reports,
            "holm": dict(zip(reports, adjusted, strict=True))}


def family_markdown(family: dict[str, Any]) -> str:
    """The family's summary: one row per policy against the baseline, with Holm's p."""
    reports = family["comparisons"]
    baseline = _won(next(iter(reports.values()))["paired"], "a", 3)
    lines = [f"Against {family['baseline']} ({baseline}), Holm-adjusted over "
             f"{len(reports)} comparisons:", "",
             "| policy | successes [95%] | \u2212 baseline [95%] | only policy / only baseline "
             "| McNemar p | Holm p |", "|---|---|---|---|---|---|"]
    for name, report in reports.items():
        p = report["paired"]
        lines.append(f"| {name} | {_won(p, 'b', 3)} | {_difference(p, 3)} | "
                     f"{p['only_b']} / {p['only_a']} | {_p_value(p['mcnemar_p'])} | "
                     f"{_p_value(family['holm'][name])} |")
    return "\n".join(lines) + "\n"
