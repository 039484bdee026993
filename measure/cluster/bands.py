"""Reference bands of training success against env steps, and the check of a new curve.

Role: the arithmetic and the file format of ``rlvla3 bench band`` (``measure.cluster.bench_band``
runs the preset on its seeds and reads the runs). A ``Curve`` is one run's training success rate
against env steps (the progress rows of ``metrics.jsonl``); a ``Band`` is the curves of a few
reference seeds of one preset, read on a grid of env-step points; ``check_curve`` judges a new
curve against it under a ``Rule``. Nothing here starts a run or imports Ray.

Invariants: every success rate is judged through its Wilson interval over the episodes it was
read from, so a rate read over few episodes is never held to a narrow band; a band file holds
its reference curves, and everything else in it (grid, finals, level) is recomputed from them
when it is read and must agree, and its ``digest`` (sha256 of the rest of the file) must match,
so an edited or truncated file is refused, not trusted; a band records the resolved run config
of its runs (without the fields that only name or place a run, ``RUN_FIELDS``) and its
fingerprint; a new curve's config must agree with it on every field both have
(``config_differences``).

Example::

    band = make_band(meta, {0: curve0, 1: curve1, 2: curve2}, 60_000, points=20, rule=Rule())
    write_band(band, Path("results/bands/default.json"))
    verdict = check_curve(read_band(Path("results/bands/default.json")), curve3, Rule())
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.confidence import Z95, wilson
from rlvla3.fingerprint import flatten

FORMAT = "rlvla3 success band 1"
"""The ``format`` field of a band file: what the file is, and the version of its layout."""

ROW_FIELDS = ("env_steps", "success_rate", "success_window")
"""The fields of a progress row that a curve reads."""

RUN_FIELDS = ("seed", "name", "storage", "ray")
"""Run config fields that name a run or say where it ran: left out of a band's config."""

TOLERANCE = 1e-4
"""How far a band file's stored figures may be from the ones recomputed from its curves
(they are written rounded to 4 decimals)."""


class BandError(ValueError):
    """Input that cannot make or check a band (a run without progress rows, a corrupt band
    file, a band of another preset or config): the message is one line naming the file or
    field."""


@dataclass(frozen=True)
class Rule:
    """When a new curve is inside a band (``measure.cluster.bench_band`` states it in words)."""

    z: float = Z95
    """Normal quantile of every Wilson interval (1.96: 95%)."""
    min_inside: float = 0.9
    """Fraction of the grid points at which the new curve must be inside."""
    level_fraction: float = 0.8
    """The success level whose env steps to reach are judged, as a fraction of the reference
    seeds' median final success."""

    def describe(self) -> str:
        """The rule in words (what ``rlvla3 bench band check`` prints with its verdict)."""
        return (f"a curve is inside when its Wilson interval (z = {self.z:.3g}) meets the hull "
                f"of the reference seeds' intervals at >= {self.min_inside:g} of the band's grid "
                "points from its first row on, and at its final row, and it reaches "
                f"{self.level_fraction:g} x the "
                "reference seeds' median final success (judged by the same intervals) no later "
                "than the slowest reference seed and no earlier than the fastest")

    def validate(self) -> None:
        if not (math.isfinite(self.z) and self.z > 0):
            raise BandError(f"rule z must be > 0, got {self.z}")
        if not 0 < self.min_inside <= 1:
            raise BandError(f"rule min_inside must be in (0, 1], got {self.min_inside}")
        if not 0 < self.level_fraction <= 1:
            raise BandError(f"rule level_fraction must be in (0, 1], got {self.level_fraction}")


@dataclass(frozen=True)
class Reading:
    """A success rate read over a window of training episodes."""

    success: float
    """Fraction of the window's episodes that succeeded."""
    window: int
    """Episodes the rate was read over."""

    def interval(self, z: float) -> tuple[float, float]:
        """The Wilson interval of the rate ([0, 1] for an empty window)."""
        successes = min(self.window, max(0, round(self.success * self.window)))
        return wilson(successes, self.window, z)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _row(row: Any, where: str) -> tuple[int, float, int]:
    if not isinstance(row, Mapping):
        raise BandError(f"{where}: not a progress row (a JSON object)")
    missing = [name for name in ROW_FIELDS if name not in row]
    if missing:
        raise BandError(f"{where}: a progress row needs {', '.join(missing)}")
    steps, success, window = (row[name] for name in ROW_FIELDS)
    if not (_number(steps) and steps >= 0 and _number(success) and 0 <= success <= 1
            and _number(window) and window >= 0 and window == int(window)):
        raise BandError(f"{where}: env_steps {steps!r}, success_rate {success!r}, "
                        f"success_window {window!r} are not a progress row's figures")
    return int(steps), float(success), int(window)


@dataclass(frozen=True)
class Curve:
    """Training success against env steps: a run's progress rows that hold at least one
    episode, with strictly increasing env steps."""

    env_steps: tuple[int, ...]
    success: tuple[float, ...]
    window: tuple[int, ...]

    @classmethod
    def from_rows(cls, rows: Iterable[Any], source: str) -> Curve:
        """The curve of ``rows`` (``metrics.jsonl`` objects, in file order). A resumed run
        repeats the env steps after its checkpoint: the later leg's rows replace the ones they
        repeat. Rows whose window holds no episode measure nothing and are left out."""
        kept: list[tuple[int, float, int]] = []
        for i, row in enumerate(rows, 1):
            steps, success, window = _row(row, f"{source} row {i}")
            while kept and kept[-1][0] >= steps:
                kept.pop()
            kept.append((steps, success, window))
        kept = [r for r in kept if r[2] > 0]
        return cls(tuple(r[0] for r in kept), tuple(r[1] for r in kept),
                   tuple(r[2] for r in kept))

    def __len__(self) -> int:
        return len(self.env_steps)

    def at(self, env_steps: float) -> Reading | None:
        """Rate and window interpolated linearly at ``env_steps`` (None outside the curve)."""
        if not self.env_steps or not self.env_steps[0] <= env_steps <= self.env_steps[-1]:
            return None
        return Reading(float(np.interp(env_steps, self.env_steps, self.success)),
                       int(np.interp(env_steps, self.env_steps, self.window)))

    @property
    def final(self) -> Reading | None:
        """The last row's rate (None for an empty curve)."""
        return Reading(self.success[-1], self.window[-1]) if self.env_steps else None

    def reach(self, level: float, z: float) -> tuple[int | None, int | None]:
        """Env steps of the first row whose Wilson interval's upper bound is at or above
        ``level`` (reached *plausibly*) and of the first whose lower bound is (*surely*);
        None: not by the end of the curve."""
        plausibly = None
        for steps, success, window in zip(self.env_steps, self.success, self.window,
                                          strict=True):
            low, high = Reading(success, window).interval(z)
            if plausibly is None and high >= level:
                plausibly = steps
            if low >= level:
                return plausibly, steps
        return plausibly, None

    def to_json(self) -> dict[str, list]:
        return {"env_steps": list(self.env_steps), "success": list(self.success),
                "window": list(self.window)}


@dataclass(frozen=True)
class BandMeta:
    """What a band describes, besides its curves."""

    preset: str
    """The ``rlvla3 rl --preset`` the reference runs started from."""
    overrides: tuple[str, ...]
    """Their ``--set`` overrides (besides ``seed``)."""
    config: Mapping[str, Any]
    """The resolved run config without ``RUN_FIELDS`` (``run_config_data``): what a new
    run must match."""
    revision: str | None
    """The git commit of the rlvla3 that made the band (``-dirty`` with local changes)."""
    made_at: str
    """When the band was made (UTC, ISO 8601)."""
    runs: Mapping[int, str]
    """Each reference seed's run directory."""

    @property
    def fingerprint(self) -> str:
        """``config_fingerprint`` of ``config``."""
        return config_fingerprint(self.config)


def run_config_data(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved run config (``rlvla3.config.to_dict``) without ``RUN_FIELDS``."""
    return {k: v for k, v in config.items() if k not in RUN_FIELDS}


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """The first 16 hex digits of the sha256 of ``config`` as canonical JSON."""
    return hashlib.sha256(_canonical(dict(config))).hexdigest()[:16]


def config_differences(band: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """``"field: BAND != OTHER"`` for every dotted field of both run configs where they differ.
    A field only one of them has (added to the config, or removed, since the band was made)
    is not a difference: the band cannot say what its runs had there."""
    a, b = flatten(dict(band)), flatten(dict(other))
    return [f"{key}: {a[key]!r} != {b[key]!r}" for key in sorted(set(a) & set(b))
            if a[key] != b[key]]


@dataclass(frozen=True)
class Band:
    """The reference curves of a preset over a few seeds, read on ``points`` env-step points."""

    meta: BandMeta
    total_env_steps: int
    curves: Mapping[int, Curve]
    """Seed -> its reference curve."""
    points: int
    rule: Rule
    """The rule the band's stored summary (``widened``, ``level``) was computed with."""

    @property
    def grid(self) -> tuple[int, ...]:
        """``points`` env steps, evenly spaced from ``end / points`` (or the latest first row
        of the reference curves, if later) to ``end``: ``total_env_steps``, or the earliest
        last row if a reference run stopped before its budget."""
        end = min(self.total_env_steps, *(c.env_steps[-1] for c in self.curves.values()))
        start = max(math.ceil(end / self.points), *(c.env_steps[0] for c in self.curves.values()))
        return tuple(int(round(x)) for x in np.linspace(start, end, self.points))

    def readings(self, env_steps: int) -> list[Reading]:
        """Each reference curve's reading at a grid point (every curve covers the grid)."""
        out = [c.at(env_steps) for c in self.curves.values()]
        assert all(r is not None for r in out), f"{env_steps} is not on the band's grid"
        return [r for r in out if r is not None]

    def level(self, rule: Rule) -> float:
        """The success level whose env steps to reach are judged."""
        return rule.level_fraction * statistics.median(
            _final(c).success for c in self.curves.values())


def _final(curve: Curve) -> Reading:
    final = curve.final
    assert final is not None, "a band's curves are never empty"
    return final


def make_band(meta: BandMeta, curves: Mapping[int, Curve], total_env_steps: int, points: int,
              rule: Rule) -> Band:
    """A band of ``curves`` (seed -> curve); refuses fewer than two seeds, a curve of fewer
    than two rows and curves that share no env steps."""
    if len(curves) < 2:
        raise BandError(f"a band needs at least 2 reference seeds, got {len(curves)}")
    if points < 2:
        raise BandError(f"a band needs at least 2 grid points, got {points}")
    for seed, curve in curves.items():
        if len(curve) < 2:
            raise BandError(f"seed {seed} ({meta.runs.get(seed, 'its run')}): {len(curve)} "
                            "progress rows with episodes; a curve needs at least 2")
    band = Band(meta, total_env_steps, dict(sorted(curves.items())), points, rule)
    end = min(total_env_steps, *(c.env_steps[-1] for c in curves.values()))
    if max(c.env_steps[0] for c in curves.values()) > end:
        raise BandError("the reference curves share no env steps (a run ended before another "
                        "one's first episode)")
    return band


def _judge(reference: Sequence[Reading], new: Reading | None, z: float) -> dict[str, Any]:
    """A new reading against the reference readings at one point: the band is the hull of
    their Wilson intervals; the new reading is inside when its own interval meets it."""
    values = [r.success for r in reference]
    low = min(r.interval(z)[0] for r in reference)
    high = max(r.interval(z)[1] for r in reference)
    out: dict[str, Any] = {
        "band": [round(min(values), 4), round(statistics.median(values), 4),
                 round(max(values), 4)],
        "widened": [round(low, 4), round(high, 4)],
    }
    if new is None:
        return {**out, "success": None, "window": None, "interval": None, "inside": False,
                "side": "missing"}
    new_low, new_high = new.interval(z)
    side = "below" if new_high < low else "above" if new_low > high else None
    return {**out, "success": round(new.success, 4), "window": new.window,
            "interval": [round(new_low, 4), round(new_high, 4)], "inside": side is None,
            "side": side}


def _not_after(a: int | None, b: int | None) -> bool:
    """``a <= b`` where None is "not by the end of the run" (later than any env step)."""
    return b is None or (a is not None and a <= b)


def _judge_reach(band: Band, curve: Curve, rule: Rule) -> dict[str, Any]:
    level = band.level(rule)
    reference = [c.reach(level, rule.z) for c in band.curves.values()]
    fastest = min((p for p, _ in reference if p is not None), default=None)
    slowest = None if any(s is None for _, s in reference) else max(s for _, s in reference
                                                                     if s is not None)
    plausibly, surely = curve.reach(level, rule.z)
    return {"level": round(level, 4),
            "reference": {"fastest_plausibly": fastest, "slowest_surely": slowest},
            "plausibly": plausibly, "surely": surely,
            "inside": _not_after(plausibly, slowest) and _not_after(fastest, surely)}


def check_curve(band: Band, curve: Curve, rule: Rule) -> dict[str, Any]:
    """The verdict on one new curve: each grid point, the final success and the env steps to
    the band's level, judged under ``rule``; ``inside`` when at least ``rule.min_inside`` of
    the points are inside and so are the final success and the env steps to the level.
    ``left_band``: the first grid point outside (``side``: below, above, or missing where the
    curve ends before it), None when none is. Points before the curve's first row with an
    episode are not judged (``side`` unmeasured): when a run logs its first row is timing."""
    points = [{"env_steps": x, **_judge(band.readings(x), curve.at(x), rule.z)}
              for x in band.grid]
    for point in points:
        if curve.env_steps and point["env_steps"] < curve.env_steps[0]:
            point.update(inside=None, side="unmeasured")
    judged = [p for p in points if p["inside"] is not None]
    fraction = sum(p["inside"] for p in judged) / len(judged) if judged else 0.0
    final = _judge([_final(c) for c in band.curves.values()], curve.final, rule.z)
    reach = _judge_reach(band, curve, rule)
    left = next((p for p in judged if not p["inside"]), None)
    return {"inside": fraction >= rule.min_inside and final["inside"] and reach["inside"],
            "points_inside": round(fraction, 4),
            "left_band": None if left is None else {
                k: left[k] for k in ("env_steps", "side", "success", "interval", "widened")},
            "final": final, "reach": reach, "points": points}


def summary(band: Band) -> dict[str, Any]:
    """The band's figures for readers (and the check of a file against its curves): per grid
    point the seeds' min / median / max and the widened band, the finals, the level and each
    seed's env steps to it."""
    rule = band.rule
    grid = []
    for x in band.grid:
        readings = band.readings(x)
        judged = _judge(readings, None, rule.z)
        grid.append({"env_steps": x, "min": judged["band"][0], "median": judged["band"][1],
                     "max": judged["band"][2], "widened": judged["widened"],
                     "window": min(r.window for r in readings)})
    finals = _judge([_final(c) for c in band.curves.values()], None, rule.z)
    level = band.level(rule)
    return {
        "grid": grid,
        "final": {"min": finals["band"][0], "median": finals["band"][1],
                  "max": finals["band"][2], "widened": finals["widened"]},
        "level": round(level, 4),
        "reach": {str(seed): dict(zip(("plausibly", "surely"), c.reach(level, rule.z),
                                      strict=True))
                  for seed, c in band.curves.items()},
    }


def to_json(band: Band) -> dict[str, Any]:
    """The band file's content: what the band describes, its summary, its curves, and the
    ``digest`` of all that."""
    meta = band.meta
    content = {
        "format": FORMAT,
        "preset": meta.preset,
        "overrides": list(meta.overrides),
        "fingerprint": meta.fingerprint,
        "revision": meta.revision,
        "made_at": meta.made_at,
        "total_env_steps": band.total_env_steps,
        "seeds": list(band.curves),
        "points": band.points,
        "rule": asdict(band.rule),
        **summary(band),
        "runs": {str(seed): path for seed, path in meta.runs.items()},
        "config": dict(meta.config),
        "curves": {str(seed): c.to_json() for seed, c in band.curves.items()},
    }
    return {**content, "digest": _digest(content)}


def _digest(content: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in content.items() if k != "digest"})
                          ).hexdigest()


def write_band(band: Band, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(band), indent=1, allow_nan=False) + "\n")


def _close(stored: Any, computed: Any) -> bool:
    if isinstance(computed, dict):
        return (isinstance(stored, dict) and stored.keys() == computed.keys()
                and all(_close(stored[k], computed[k]) for k in computed))
    if isinstance(computed, list):
        return (isinstance(stored, list) and len(stored) == len(computed)
                and all(_close(a, b) for a, b in zip(stored, computed, strict=True)))
    if _number(computed) and not isinstance(computed, int):
        return _number(stored) and abs(stored - computed) <= TOLERANCE
    return stored == computed


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], source: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BandError(f"{source}: field '{name}' is missing or not "
                        f"{getattr(kind, '__name__', 'of its type')} (a corrupt band file)")
    return value


def from_json(data: Any, source: str) -> Band:
    """The band a band file's content describes; refuses another format, a missing or
    mistyped field, a curve that is not one, and figures that do not follow from the curves."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise BandError(f"{source}: not a band file (format {found!r}, expected {FORMAT!r})")
    curves_data = _field(data, "curves", dict, source)
    rule_data = _field(data, "rule", dict, source)
    runs = _field(data, "runs", dict, source)
    meta_fields = {"preset": _field(data, "preset", str, source),
                   "overrides": tuple(str(o) for o in _field(data, "overrides", list, source)),
                   "config": _field(data, "config", dict, source),
                   "revision": data.get("revision"), "made_at": str(data.get("made_at", ""))}
    total = _field(data, "total_env_steps", int, source)
    points = _field(data, "points", int, source)
    try:
        rule = Rule(**rule_data)
        rule.validate()
        curves = {int(seed): Curve.from_rows(
            [{"env_steps": x, "success_rate": y, "success_window": w} for x, y, w in
             zip(c["env_steps"], c["success"], c["window"], strict=True)],
            f"curve of seed {seed}") for seed, c in curves_data.items()}
        meta = BandMeta(**meta_fields, runs={int(seed): str(path) for seed, path in runs.items()})
        band = make_band(meta, curves, total, points, rule)
    except (TypeError, ValueError, KeyError) as exc:
        raise BandError(f"{source}: {exc} (a corrupt band file)") from None
    for name, value in summary(band).items():
        if not _close(data.get(name), value):
            raise BandError(f"{source}: its '{name}' does not follow from its reference curves "
                            "(an edited or corrupt band file)")
    if data.get("fingerprint") != meta.fingerprint or data.get("seeds") != list(band.curves):
        raise BandError(f"{source}: its 'fingerprint' or 'seeds' does not follow from its "
                        "config and curves (an edited or corrupt band file)")
    if data.get("digest") != _digest(data):
        raise BandError(f"{source}: its content does not match its 'digest' (an edited band "
                        "file: make the band again)")
    return band


def read_band(path: Path) -> Band:
    """The band in ``path``, checked (``from_json``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BandError(f"{path}: no such band file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BandError(f"{path}: cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BandError(f"{path}: not JSON ({exc})") from None
    return from_json(data, str(path))
