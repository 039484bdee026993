"""The arithmetic behind the benchmark reports: thresholds, paired ratios, quantiles, slopes."""

from __future__ import annotations

import pytest

from actors.observe.figures import hist_quantile, hist_summary
from measure.cluster.bench_learning import compare, reach_point, success_at
from measure.cluster.bench_soak import slope_per_hour


def _curve(points):
    return [{"time_s": t, "env_steps": s, "success": y, "window": w} for t, s, y, w in points]


def test_a_threshold_needs_a_full_window():
    # the first row's 1.0 is one lucky episode; the threshold is reached at the third row
    curve = _curve([(5, 500, 1.0, 1), (50, 5000, 0.4, 150), (90, 9000, 0.8, 400)])
    assert reach_point(curve, 0.75) == {"time_s": 90, "env_steps": 9000}
    assert reach_point(curve, 0.9) is None
    assert success_at(curve, 7000) == pytest.approx(0.6)
    assert success_at(curve, 100) != success_at(curve, 100)  # nan outside the curve


def test_ratios_are_paired_by_seed():
    runs = {
        "sync": {0: {"curve": _curve([(100, 10_000, 0.95, 500)])},
                 1: {"curve": _curve([(200, 20_000, 0.95, 500)])}},
        "full": {0: {"curve": _curve([(50, 11_000, 0.95, 500)])},
                 1: {"curve": _curve([(60, 18_000, 0.95, 500)])}},
    }
    out = compare(runs, "sync", "full", [0.9], budget=20_000)
    assert out["time_ratio_to_0.9"] == {"median": 0.4, "min": 0.3, "max": 0.5, "n": 2}
    assert out["env_steps_ratio_to_0.9"]["min"] == pytest.approx(0.9)
    assert out["env_steps_ratio_to_0.9"]["max"] == pytest.approx(1.1)


def test_histogram_quantiles_and_slope():
    hist = {0: 5, 1: 3, 4: 2}  # 10 samples
    assert hist_quantile(hist, 0.5) == 0 and hist_quantile(hist, 0.8) == 1
    assert hist_quantile(hist, 0.9) == 4
    assert hist_summary(hist) == {"count": 10, "mean": 1.1, "p50": 0.0, "p90": 4.0, "max": 4.0}
    # 10 MB over 30 minutes is 20 MB per hour
    rows = [(t, 100.0 + 10.0 * t / 1800.0, 0.0) for t in range(0, 1801, 60)]
    assert slope_per_hour(rows, 1) == pytest.approx(20.0)
