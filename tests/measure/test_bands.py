"""Reference bands (``measure.cluster.bands``, ``rlvla3 bench band``): the Wilson-based rule (a
curve like the reference seeds' is inside, one clearly below is not, few episodes widen the
band), the band file's checks (round trip, an edited or corrupt file refused), bad input in one
line with exit status 2, and one real ``make`` + ``check`` of the smoke preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.tiny_runs import last_json, run_rlvla3

from commands.bench import band as band_command
from measure.cluster import bench_band
from measure.cluster.bands import (
    BandError,
    BandMeta,
    Curve,
    Rule,
    check_curve,
    config_differences,
    make_band,
    read_band,
    write_band,
)
from rlvla3.config import to_dict
from rlvla3.run_config import load_run_config

STEPS = list(range(1000, 10_001, 1000))


def _curve(success: list[float], window: int | list[int] = 200) -> Curve:
    windows = window if isinstance(window, list) else [window] * len(success)
    return Curve.from_rows([{"env_steps": x, "success_rate": y, "success_window": w}
                            for x, y, w in zip(STEPS, success, windows, strict=True)], "test")


def _rising(offset: float) -> list[float]:
    return [min(1.0, 0.1 + offset + 0.08 * i) for i in range(len(STEPS))]


def _band(config: dict | None = None, preset: str = "smoke"):
    meta = BandMeta(preset, (), config or {"total_env_steps": 10_000}, None,
                    "2026-12-06T00:00:00Z", {0: "a", 1: "b", 2: "c"})
    curves = {0: _curve(_rising(0.0)), 1: _curve(_rising(0.03)), 2: _curve(_rising(-0.03))}
    return make_band(meta, curves, 10_000, 10, Rule())


def test_a_curve_like_the_references_is_inside_and_one_clearly_below_is_not():
    band = _band()
    inside = check_curve(band, _curve(_rising(0.01)), Rule())
    assert inside["inside"] and inside["points_inside"] == 1.0 and inside["left_band"] is None
    assert inside["final"]["inside"] and inside["reach"]["inside"]
    # stuck near its start: it leaves the band below, early, and never reaches the level
    stuck = check_curve(band, _curve([0.1, 0.15, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]),
                        Rule())
    assert not stuck["inside"] and stuck["points_inside"] < 0.5
    assert stuck["left_band"]["side"] == "below" and stuck["left_band"]["env_steps"] <= 5000
    assert not stuck["final"]["inside"] and stuck["reach"]["surely"] is None
    assert not stuck["reach"]["inside"]
    # a run that stopped early is missing from the rest of the grid
    short = Curve(tuple(STEPS[:3]), tuple(_rising(0.0)[:3]), (200,) * 3)
    verdict = check_curve(band, short, Rule())
    assert not verdict["inside"] and verdict["left_band"]["side"] == "missing"
    # one that logged its first row after the band's first point is judged from that row on
    late = Curve(tuple(STEPS[2:]), tuple(_rising(0.0)[2:]), (200,) * 8)
    verdict = check_curve(band, late, Rule())
    assert verdict["inside"] and verdict["left_band"] is None, verdict
    assert [p["side"] for p in verdict["points"][:2]] == ["unmeasured"] * 2


def test_few_episodes_make_the_band_wide():
    """The same low curve read over 5 episodes a row is not evidence of anything: inside."""
    band = _band()
    low = [max(0.0, y - 0.2) for y in _rising(0.0)]  # 0.2 below the references throughout
    assert not check_curve(band, _curve(low, 200), Rule())["inside"]
    verdict = check_curve(band, _curve(low, 5), Rule())
    assert verdict["inside"], verdict
    wide, narrow = (check_curve(band, _curve(low, w), Rule())["final"]["interval"]
                    for w in (5, 200))
    assert wide[1] - wide[0] > 2 * (narrow[1] - narrow[0])


def test_a_resumed_run_keeps_its_later_rows_and_empty_windows_are_left_out():
    rows = [{"env_steps": 0, "success_rate": 0.0, "success_window": 0},
            {"env_steps": 500, "success_rate": 0.2, "success_window": 10},
            {"env_steps": 900, "success_rate": 0.3, "success_window": 20},
            {"env_steps": 700, "success_rate": 0.25, "success_window": 15},  # resumed at 700
            {"env_steps": 1200, "success_rate": 0.4, "success_window": 30}]
    curve = Curve.from_rows(rows, "run")
    assert curve.env_steps == (500, 700, 1200) and curve.window == (10, 15, 30)
    with pytest.raises(BandError, match="run row 2: a progress row needs success_window"):
        Curve.from_rows([rows[1], {"env_steps": 1, "success_rate": 0.5}], "run")


def test_the_band_file_round_trips_and_an_edited_or_corrupt_one_is_refused(tmp_path):
    band = _band()
    path = tmp_path / "smoke.json"
    write_band(band, path)
    again = read_band(path)
    new = _curve(_rising(0.01))
    assert check_curve(again, new, Rule()) == check_curve(band, new, Rule())
    data = json.loads(path.read_text())
    for edit, message in [
        (lambda d: d["curves"]["1"]["success"].__setitem__(4, 0.99), "'grid' does not follow"),
        (lambda d: d.__setitem__("preset", "default"), "does not match its 'digest'"),
        (lambda d: d["config"].__setitem__("total_env_steps", 5), "'fingerprint'"),
        (lambda d: d.pop("curves"), "field 'curves' is missing"),
        (lambda d: d.__setitem__("format", "other"), "not a band file"),
    ]:
        edited = json.loads(json.dumps(data))
        edit(edited)
        path.write_text(json.dumps(edited))
        with pytest.raises(BandError, match=message):
            read_band(path)
    path.write_text(path.read_text()[:200])
    with pytest.raises(BandError, match="not JSON"):
        read_band(path)
    with pytest.raises(BandError, match="no such band file"):
        read_band(tmp_path / "missing.json")


def _fake_run(root: Path, seed: int, success: list[float], overrides: list[str] = ()) -> str:
    """A finished run directory as ``rlvla3 rl`` leaves it: config.yaml and metrics.jsonl."""
    run = root / f"run{seed}"
    run.mkdir()
    cfg = load_run_config("smoke", None, [*overrides, f"seed={seed}"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    steps = [300 * (i + 1) for i in range(len(success))]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"env_steps": x, "success_rate": y, "success_window": 100}) + "\n"
        for x, y in zip(steps, success, strict=True)))
    return str(run)


def _cli(capfd, argv: list[str]) -> tuple[int, str, list[str]]:
    status = band_command.main(argv)
    out, err = capfd.readouterr()
    return status, out, [line for line in err.splitlines() if line.strip()]


def test_from_runs_make_and_check_and_bad_input_in_one_line(tmp_path, capfd):
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.8]
    # a default spelled out in --set (seed 2's chunk_len) is the same config as one left out
    runs = [_fake_run(tmp_path, s, [min(1.0, y + 0.02 * s) for y in rising],
                      ["env.options.chunk_len=2"] if s == 2 else []) for s in (0, 1, 2)]
    band = str(tmp_path / "bands" / "smoke.json")
    status, out, err = _cli(capfd, ["make", "--preset", "smoke", "--from-runs", *runs,
                                    "--band", band])
    made = json.loads(out)
    assert status == 0 and made["seeds"] == [0, 1, 2] and made["total_env_steps"] == 3000
    assert err[-1] == f"bench band: wrote {band}" and len(err) == 4  # a line a seed, then it
    stored = json.loads(Path(band).read_text())
    assert stored["preset"] == "smoke" and stored["fingerprint"] == made["fingerprint"]

    good = _fake_run(tmp_path, 3, [y + 0.01 for y in rising])
    low = _fake_run(tmp_path, 4, [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    status, out, err = _cli(capfd, ["check", "--band", band, "--from-runs", good, low])
    verdict = json.loads(out)
    assert status == 1 and not verdict["inside"]
    assert verdict["seeds"]["3"]["inside"] and not verdict["seeds"]["4"]["inside"]
    assert verdict["seeds"]["4"]["left_band"]["side"] == "below"
    assert verdict["seeds"]["4"]["outside"][0] == {
        k: verdict["seeds"]["4"]["left_band"][k] for k in ("env_steps", "side")}
    assert verdict["seeds"]["3"]["outside"] == []
    assert err[-1].startswith("bench band: seed 4: outside the band; first left it at ")
    status, out, _ = _cli(capfd, ["check", "--band", band, "--from-runs", good])
    assert status == 0 and json.loads(out)["inside"]

    other = _fake_run(tmp_path, 5, rising, ["learner.lr=0.01"])
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for argv, line in [
        (["check", "--band", str(tmp_path / "nope.json"), "--from-runs", good],
         "nope.json: no such band file"),
        (["check", "--band", str(bad), "--from-runs", good], "bad.json: not JSON"),
        (["check", "--band", band, "--from-runs", other],
         "ran another config than the band"),
        (["check", "--band", band, "--from-runs", str(empty)], "empty: no metrics.jsonl"),
        (["check", "--band", band, "--from-runs", runs[1]],
         "seed 1 is one of the band's reference seeds"),
        (["make", "--preset", "default", "--from-runs", *runs[:2], "--band", band],
         "ran another config than --preset default"),
        (["make", "--preset", "smoke", "--set", "seed=3", "--band", band], "--set seed=..."),
        (["make", "--preset", "smoke", "--seeds", "0", "--band", band],
         "--seeds: a band needs at least 2 reference seeds"),
    ]:
        status, out, err = _cli(capfd, argv)
        assert (status, out, len(err)) == (2, "", 1), (argv, err)
        assert err[0].startswith("rlvla3 bench band: ") and line in err[0], (line, err)


def test_a_band_whose_preset_now_resolves_otherwise_is_refused_before_any_run(tmp_path):
    cfg = bench_band.config_data(load_run_config("smoke"))
    path = tmp_path / "smoke.json"
    write_band(_band({**cfg, "learner": {**cfg["learner"], "lr": 0.5}}), path)

    def run_rl(argv: list[str]) -> int:
        raise AssertionError(f"started a run: {argv}")

    with pytest.raises(BandError, match=r"now resolves to another config than the band's "
                                        r"\(learner.lr: 0.5 != 0.001\)"):
        bench_band.check(bench_band.CheckOptions(str(path), (7,), (), str(tmp_path)), run_rl)


def test_the_committed_bands_read_and_match_their_presets_as_they_resolve_now():
    """A committed band whose preset has changed since is found here, not by a user's check:
    make it again (``results/bands/README.md`` says how)."""
    files = sorted((Path(__file__).resolve().parents[2] / "results" / "bands").glob("*.json"))
    assert files
    for path in files:
        band = read_band(path)
        now = bench_band.config_data(load_run_config(band.meta.preset, None,
                                                     list(band.meta.overrides)))
        assert config_differences(band.meta.config, now) == [], path
    # a field added to the config since a band was made is no difference; a value is
    assert config_differences({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == []
    assert config_differences({"a": {"b": 1}}, {"a": {"b": 3}}) == ["a.b: 1 != 3"]


TINY = ["--set", "total_env_steps=2500", "--set", "log_every_s=0.5",
        "--set", "env_workers.num_workers=1",
        "--set", "checkpoint_every=0", "--set", "env.options.image_size=16",
        "--set", "policy.options.channels=8", "--set", "policy.options.hidden=32"]


@pytest.mark.slow
@pytest.mark.integration
def test_make_then_check_the_smoke_preset_for_real(tmp_path):
    """Two reference seeds of a shortened smoke run, then one new seed checked against them
    (each run as ``rlvla3 rl`` makes it: about 1.5 min on 2 cores)."""
    band = tmp_path / "smoke.json"
    made = last_json(run_rlvla3(["bench", "band", "make", "--preset", "smoke", "--seeds", "0",
                                 "1", *TINY, "--work-dir", str(tmp_path / "ref"),
                                 "--band", str(band)], timeout=400))
    assert made["seeds"] == [0, 1] and made["total_env_steps"] == 2500
    for seed in (0, 1):
        assert (tmp_path / "ref" / f"seed{seed}" / "metrics.jsonl").is_file()
        assert (tmp_path / "ref" / f"seed{seed}.log").is_file()
    stored = read_band(band)
    assert stored.meta.preset == "smoke" and len(stored.meta.overrides) == 7
    assert stored.meta.config["total_env_steps"] == 2500 and stored.meta.revision
    # check exits 1 when the curve is outside: run_rlvla3 asserts 0, so run it here
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "rlvla3", "bench", "band", "check", "--band",
                           str(band), "--seeds", "2", "--work-dir", str(tmp_path / "new")],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=400)
    verdict = last_json(done.stdout)
    assert done.returncode == (0 if verdict["inside"] else 1), done.stderr[-2000:]
    seed = verdict["seeds"]["2"]
    assert set(seed) >= {"run", "inside", "points_inside", "left_band", "final", "reach"}
    progress = [line for line in done.stderr.splitlines() if line.startswith("bench band: ")]
    assert progress[0].startswith("bench band: seed 2: rlvla3 rl --preset smoke --set ")
    assert progress[1].startswith("bench band: seed 2: done in ")
