"""Evaluation statistics and fingerprints, without a simulator: Wilson intervals against
published values, the exact McNemar test against binomial sums worked out by hand, Newcombe's
paired interval, and ``rlvla3 eval --compare`` on two results files (pairing, warnings)."""

from __future__ import annotations

import json
import math

import pytest

from actors.eval.rounds import summarise_rows
from rlvla3.confidence import (
    compare_paired,
    holm,
    mcnemar_exact,
    paired_difference_interval,
    rate,
    wilson,
)
from rlvla3.fingerprint import fingerprint, fingerprint_differences, package_versions


@pytest.mark.parametrize(
    "k,n,low,high",
    [
        # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I.
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
        # 18 of 20 (the old single-task headline): about 0.70-0.97.
        (18, 20, 0.6990, 0.9721),
    ],
)
def test_wilson_matches_published_values(k, n, low, high):
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_wilson_edges_and_rate_summary():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(5, 5)
    assert hi == 1.0 and 0.5 < lo < 0.6  # 5/5 is not "100% +- 0"
    assert wilson(3, 10) == pytest.approx(tuple(1 - x for x in reversed(wilson(7, 10))))
    with pytest.raises(ValueError):
        wilson(4, 3)
    assert rate(45, 50) == {"episodes": 50, "successes": 45, "success_rate": 0.9,
                            "ci95": [0.7864, 0.9565]}


@pytest.mark.parametrize(
    "b,c,p",
    [
        (1, 8, 2 * (1 + 9) / 2**9),  # P[X <= 1], X ~ Bin(9, 1/2), doubled
        (3, 12, 2 * (1 + 15 + 105 + 455) / 2**15),
        (0, 5, 2 / 2**5),
        (0, 6, 2 / 2**6),  # 6 discordant pairs all one way: p = 0.03125 < 0.05
        (10, 4, 2 * (1 + 14 + 91 + 364 + 1001) / 2**14),
        (2, 2, 1.0),  # capped at 1
        (0, 0, 1.0),
    ],
)
def test_mcnemar_exact_is_the_doubled_binomial_tail(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    assert mcnemar_exact(c, b) == mcnemar_exact(b, c)


@pytest.mark.parametrize(
    ("p", "adjusted"),
    [
        # sorted 0.005, 0.01, 0.03, 0.04 -> 4x, 3x, 2x, 1x = 0.02, 0.03, 0.06, 0.04 -> the
        # running maximum keeps the order: 0.02, 0.03, 0.06, 0.06
        ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
        ([0.5, 0.4], [0.8, 0.8]),
        ([0.3, 0.6, 0.9], [0.9, 1.0, 1.0]),  # capped at 1
        ([0.2], [0.2]),
        ([], []),
    ],
)
def test_holm_adjusts_step_down(p, adjusted):
    assert holm(p) == pytest.approx(adjusted, abs=1e-12)


def test_newcombe_interval_reduces_to_square_and_add_without_correlation():
    # both * neither - only_a * only_b = 0 -> phi = 0: the marginal Wilson errors add in
    # quadrature. A: 4/12, B: 6/12.
    lo, hi = paired_difference_interval(2, 2, 4, 4)
    la, ua = wilson(4, 12)
    lb, ub = wilson(6, 12)
    d = 6 / 12 - 4 / 12
    assert lo == pytest.approx(d - math.hypot(6 / 12 - lb, ua - 4 / 12), abs=1e-12)
    assert hi == pytest.approx(d + math.hypot(ub - 6 / 12, 4 / 12 - la), abs=1e-12)


def test_newcombe_interval_on_worked_tables():
    # Tables used as examples for paired intervals (Bentur et al. 2009, n=21; Cavo et al.
    # 2012, n=161); values of Newcombe's hybrid score interval for "second - first".
    lo, hi = paired_difference_interval(1, 1, 7, 12)
    assert (round(lo, 3), round(hi, 3)) == (0.026, 0.507)
    lo, hi = paired_difference_interval(59, 6, 16, 80)
    assert (round(lo, 3), round(hi, 3)) == (0.005, 0.119)
    # Swapping A and B negates the interval; identical policies give a symmetric one around 0.
    lo2, hi2 = paired_difference_interval(59, 16, 6, 80)
    assert (lo2, hi2) == pytest.approx((-hi, -lo))
    lo, hi = paired_difference_interval(30, 0, 0, 20)
    assert lo < 0 < hi and lo == pytest.approx(-hi)


def test_compare_paired_counts_discordant_pairs():
    a = [True] * 30 + [False] * 15 + [True] * 1 + [False] * 4
    b = [True] * 30 + [True] * 15 + [False] * 1 + [False] * 4
    cmp = compare_paired(a, b)
    assert (cmp.both, cmp.only_a, cmp.only_b, cmp.neither) == (30, 1, 15, 4)
    assert cmp.rate_a == 31 / 50 and cmp.rate_b == 45 / 50
    assert cmp.difference == pytest.approx(14 / 50)
    assert cmp.p_value == pytest.approx(2 * (1 + 16) / 2**16)
    assert cmp.ci95[0] > 0 and cmp.ci95[0] < cmp.difference < cmp.ci95[1]
    with pytest.raises(ValueError):
        compare_paired([True], [True, False])


def test_summary_rows_give_wilson_intervals_per_task_and_suite():
    rows = [
        {"task": t, "init_state": k, "success": (k % 4 != 0) if t == 3 else k < 2, "steps": 9,
         "instruction": f"task {t}"}
        for t in (3, 7) for k in range(8)
    ]
    summary = summarise_rows(rows, [3, 7])
    assert summary["tasks"]["3"]["successes"] == 6 and summary["tasks"]["7"]["successes"] == 2
    assert summary["tasks"]["3"]["ci95"] == [round(x, 4) for x in wilson(6, 8)]
    assert summary["successes"] == 8 and summary["episodes"] == 16
    assert summary["ci95"] == [round(x, 4) for x in wilson(8, 16)]
    assert summary["mean_task_success"] == 0.5 and summary["env_steps"] == 16 * 9
    assert [e["init_state"] for e in summary["tasks"]["7"]["by_init_state"]] == list(range(8))


def test_an_episode_a_fault_ended_is_counted_apart_not_as_a_failure():
    rows = [{"task": 0, "init_state": k, "success": k < 3, "steps": 9, "instruction": "x"}
            for k in range(4)]
    rows.append({"task": 0, "init_state": 4, "success": False, "steps": 0, "instruction": "",
                 "fault": "eval worker lost 3 times: ActorDiedError"})
    summary = summarise_rows(rows, [0])
    assert summary["episodes"] == 4 and summary["successes"] == 3 and summary["faults"] == 1
    assert summary["success_rate"] == 0.75 and summary["tasks"]["0"]["faults"] == 1
    assert summary["tasks"]["0"]["success_rate"] == 0.75
    assert summary["tasks"]["0"]["by_init_state"][4]["fault"].startswith("eval worker lost")


def test_fingerprint_fields_and_differences():
    versions = package_versions()
    assert {"mujoco", "robosuite", "libero", "torch", "ray", "rlvla3", "python"} <= set(versions)
    assert versions["torch"].startswith("2.") and versions["rlvla3"] != "not installed"
    settings = {"image_size": [64, 64], "fast_render": True, "control_freq": 20.0,
                "chunk_len": 5, "seeds": {"eval": 0}, "init_state_ids": [0, 1]}
    renderer = {"egl_vendor": "Mesa Project", "gl_renderer": "llvmpipe (LLVM 15.0.6, 256 bits)"}
    a = fingerprint(settings, renderer)
    assert {"packages", "renderer", "image_size", "fast_render", "control_freq", "chunk_len",
            "seeds", "init_state_ids"} <= set(a)
    b = fingerprint({**settings, "image_size": [128, 128]},
                    {**renderer, "gl_renderer": "NVIDIA 550.54"})
    b["checkpoint"] = {"sha256": "ab"}  # which policy it was is not a difference
    diffs = fingerprint_differences(a, b)
    assert len(diffs) == 2
    assert diffs[0].startswith("image_size") and diffs[1].startswith("renderer.gl_renderer")
    assert fingerprint_differences(a, dict(a)) == []


def _results(path, successes, fp):
    tasks = {
        str(t): {"instruction": "x", "by_init_state": [
            {"init_state": k, "success": s, "steps": 10} for k, s in enumerate(row)]}
        for t, row in successes.items()
    }
    data = {"policy": str(path), "placements": "bundled", "tasks": tasks, "fingerprint": fp}
    path.write_text(json.dumps(data))
    return str(path)


def test_compare_two_results_files_pairs_episodes_and_warns_on_fingerprints(tmp_path, capsys):
    from commands.eval import main

    fp = fingerprint({"image_size": [64, 64], "fast_render": True, "chunk_len": 5},
                     {"gl_renderer": "llvmpipe"})
    a = _results(tmp_path / "a.json", {0: [False] * 8 + [True] * 2, 1: [True] * 10}, fp)
    b = _results(tmp_path / "b.json", {0: [True] * 10, 1: [True] * 9 + [False] * 1}, fp)
    assert main(["--compare", a, b, "--output-dir", str(tmp_path / "cmp"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    paired = report["paired"]
    assert (paired["pairs"], paired["only_a"], paired["only_b"]) == (20, 1, 8)
    assert paired["mcnemar_p"] == pytest.approx(2 * (1 + 9) / 2**9)
    assert report["tasks"]["0"]["only_b"] == 8 and report["tasks"]["1"]["only_a"] == 1
    assert report["fingerprint_differences"] == [] and "WARNING" not in captured.err
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text()) == report
    table = (tmp_path / "cmp" / "comparison.md").read_text().splitlines()
    assert table[0] == "| task | A: a | B: b | B \u2212 A [95%] | McNemar p |"
    # each side's Wilson interval over the paired episodes (12 of 20: 0.387-0.781, 19 of 20:
    # 0.764-0.991), the paired difference with Newcombe's interval, McNemar's p
    ci = report["paired"]["ci95"]
    assert table[2].startswith("| 0 x | 2/10 = 0.20 [0.06, 0.51] | 10/10 = 1.00 [0.72, 1.00] |")
    assert table[4] == (
        "| all | **12/20 = 0.600 [0.387, 0.781]** | **19/20 = 0.950 [0.764, 0.991]** | "
        f"**+0.350 [+{ci[0]:.3f}, +{ci[1]:.3f}]** | **0.039** |")

    other = fingerprint({"image_size": [128, 128], "fast_render": True, "chunk_len": 5},
                        {"gl_renderer": "llvmpipe"})
    c = _results(tmp_path / "c.json", {0: [True] * 10, 1: [True] * 10}, other)
    assert main(["--compare", a, c, "--output-dir", str(tmp_path / "cmp2"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["fingerprint_differences"] == ["image_size: [64, 64] != [128, 128]"]
    assert "WARNING" in captured.err and "image_size" in captured.err
    # Two evaluations of the same weights (e.g. an RL run that never changed them) are flagged.
    weights = {"sha256": "f25e528cddff26b6"}
    d = _results(tmp_path / "d.json", {0: [True] * 10}, {**fp, "checkpoint": {"path": "x", **weights}})
    e = _results(tmp_path / "e.json", {0: [True] * 10}, {**fp, "checkpoint": {"path": "y", **weights}})
    assert main(["--compare", d, e, "--output-dir", str(tmp_path / "cmp3"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["fingerprint_differences"] == [
        "checkpoint: A and B hold the same weights (sha256 f25e528cddff)"]


def test_compare_refuses_an_incomplete_evaluation_unless_told_to_pair_what_both_ran(
        tmp_path, capsys):
    """An evaluation with a faulted episode, or fewer episodes than it planned, is not
    compared: one line names it and the way to finish it. ``--allow-incomplete`` compares
    the episodes both sides ran to their end, and says so."""
    from commands.eval import main

    fp = fingerprint({"image_size": [64, 64]}, {"gl_renderer": "llvmpipe"})
    a = _results(tmp_path / "a.json", {0: [False] * 5 + [True] * 5}, fp)
    b = tmp_path / "b.json"
    _results(b, {0: [True] * 10}, fp)
    data = json.loads(b.read_text())
    data["tasks"]["0"]["by_init_state"][9] = {"init_state": 9, "success": False, "steps": 0,
                                              "fault": "eval worker lost 3 times"}
    b.write_text(json.dumps({**data, "complete": False, "faults": 1, "episodes_planned": 10}))
    out = tmp_path / "cmp"
    assert main(["--compare", a, str(b), "--output-dir", str(out), "--json"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("rlvla3 eval: ") and "b is incomplete" in lines[0]
    assert "9 of 10 planned episodes ran to their end" in lines[0]
    assert "1 ended by a fault (the first: eval worker lost 3 times)" in lines[0]
    assert captured.out == "" and not (out / "comparison.json").exists()

    assert main(["--compare", a, str(b), "--allow-incomplete", "--output-dir", str(out),
                 "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert "b is incomplete" in captured.err and "--allow-incomplete" in captured.err
    assert report["paired"]["pairs"] == 9  # the faulted episode is no failure of the policy
    assert report["paired"]["only_b"] == 5 and report["unpaired_episodes"] == 1


def test_a_resummarised_evaluation_fingerprints_the_episodes_it_counts():
    from actors.eval.output_dir import planned

    first = {"image_size": [64, 64], "init_state_ids": list(range(50)), "tasks": [0, 1]}
    now = {"init_state_ids": list(range(10)), "tasks": [1], "image_size": [128, 128]}
    assert planned(first, now) == {"image_size": [64, 64], "init_state_ids": list(range(10)),
                                   "tasks": [1]}
    assert planned({}, now) == {}  # no episode ran yet: nothing to fingerprint


def test_an_interrupted_evaluation_keeps_the_time_it_ran(tmp_path):
    from actors.eval.output_dir import IDENTITY_KEYS, EvalOutput

    identity = {k: None for k in IDENTITY_KEYS}
    first = EvalOutput(tmp_path, identity)
    first.add({"task": 0, "init_state": 0, "success": True, "steps": 9}, 12.5)
    first.add({"task": 0, "init_state": 1, "success": False, "steps": 9}, 30.0)
    first.close()
    # Killed here: no final bookkeeping ran; the next invocation continues from 30 s.
    second = EvalOutput(tmp_path, identity)
    assert second.base_seconds == 30.0 and second.done() == {(0, 0), (0, 1)}
    second.add({"task": 0, "init_state": 2, "success": True, "steps": 9}, 4.0)
    second.close()
    assert EvalOutput(tmp_path, identity).base_seconds == 34.0


def test_tally_sums_episodes_and_successes_per_key():
    from rlvla3.confidence import tally

    assert tally([("1", 2, 1), ("0", 3, 0), ("1", 2, 2)]) == {"1": [4, 3], "0": [3, 0]}
    assert tally([]) == {}


def test_compare_several_against_one_baseline_adjusts_p_with_holm(tmp_path, capsys):
    from commands.eval import main

    fp = fingerprint({"image_size": [64, 64], "fast_render": True, "chunk_len": 5},
                     {"gl_renderer": "llvmpipe"})
    a = _results(tmp_path / "a.json", {0: [False] * 8 + [True] * 2, 1: [True] * 10}, fp)
    b = _results(tmp_path / "b.json", {0: [True] * 10, 1: [True] * 9 + [False] * 1}, fp)
    c = _results(tmp_path / "c.json", {0: [True] * 2 + [False] * 6 + [True] * 2,
                                       1: [True] * 10}, fp)
    out = tmp_path / "family"
    assert main(["--compare", a, b, c, "--output-dir", str(out), "--json"]) == 0
    family = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert family["baseline"] == "a" and list(family["comparisons"]) == ["b", "c"]
    p_b = family["comparisons"]["b"]["paired"]["mcnemar_p"]  # 1 against 8: 0.039
    p_c = family["comparisons"]["c"]["paired"]["mcnemar_p"]  # 0 against 2: 0.5
    assert (p_b, p_c) == pytest.approx((2 * 10 / 2**9, 0.5))
    # Holm: the smaller p times 2, the larger at least that: b alone is no longer < 0.05
    assert family["holm"] == pytest.approx({"b": 2 * p_b, "c": 0.5})
    assert json.loads((out / "comparison.json").read_text()) == family
    table = (out / "comparison.md").read_text()
    assert table.startswith("Against a (12/20 = 0.600 [0.387, 0.781]), Holm-adjusted over 2 ")
    assert "| b | 19/20 = 0.950 [0.764, 0.991] | +0.350 " in table
    assert "| 8 / 1 | 0.039 | 0.078 |" in table
    assert "### b against a" in table and "### c against a" in table
    with pytest.raises(SystemExit):  # one policy is no comparison
        main(["--compare", a])
