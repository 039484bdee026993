"""Confidence for success rates: Wilson intervals, the exact McNemar test, paired differences.

Role: the statistics behind every evaluation number (``rlvla3 eval``'s table and
``results.json``, ``--compare``, periodic evaluation in RL runs). Pure Python (``math`` and
``fractions``): no scipy, nothing to import but the standard library.

- ``wilson(k, n)``: the Wilson score interval of a binomial proportion (95% by default). It
  stays inside [0, 1] and is sensible at 0 or n successes, where the Wald interval collapses
  to a point (5 successes in 5 episodes is not "100% +- 0").
- ``mcnemar_exact(b, c)``: two-sided exact McNemar test on the discordant pairs of a paired
  comparison: under H0 each of the ``n = b + c`` discordant pairs goes either way with
  probability 1/2, so ``p = min(1, 2 * P[Binomial(n, 1/2) <= min(b, c)])``. Computed with
  exact integer arithmetic.
- ``paired_difference_interval``: Newcombe's (1998) hybrid score interval for the difference
  of two paired proportions (his method 10): the two marginal Wilson intervals combined
  "square-and-add", corrected for the correlation of the pairs.
- ``compare_paired``: the whole comparison of two policies evaluated on the same episodes.
- ``holm``: Holm's step-down adjustment of several p-values (several policies each compared
  with one baseline): the family-wise error stays at the level without Bonferroni's full cost.

Invariants: every interval lies within its parameter's range ([0, 1] for a rate, [-1, 1] for
a difference) and contains its point estimate; ``n = 0`` gives the uninformative interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

Z95 = 1.959963984540054
"""Standard normal quantile for a two-sided 95% interval."""


def tally(counts: Iterable[tuple[str, int, int]]) -> dict[str, list[int]]:
    """``{key: [episodes, successes]}`` summed over ``(key, episodes, successes)`` items."""
    total: dict[str, list[int]] = {}
    for key, episodes, successes in counts:
        entry = total.setdefault(key, [0, 0])
        entry[0] += episodes
        entry[1] += successes
    return total


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for ``successes`` out of ``n`` trials.

    centre = (p + z^2 / 2n) / (1 + z^2 / n),
    half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def rate(successes: int, n: int) -> dict[str, Any]:
    """``successes``, ``episodes``, ``success_rate`` and its Wilson 95% interval ``ci95``."""
    low, high = wilson(successes, n)
    return {
        "episodes": n,
        "successes": successes,
        "success_rate": successes / n if n else 0.0,
        "ci95": [round(low, 4), round(high, 4)],
    }


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs (1.0 when none)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = Fraction(sum(math.comb(n, i) for i in range(min(b, c) + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))


def paired_difference_interval(
    both: int, only_a: int, only_b: int, neither: int, z: float = Z95
) -> tuple[float, float]:
    """Newcombe's hybrid score interval for ``rate_b - rate_a`` from a paired 2x2 table.

    ``both``: pairs where A and B succeed; ``only_a``: A succeeds, B fails; ``only_b``: A
    fails, B succeeds; ``neither``: both fail. With ``p_a``, ``p_b`` the marginal rates and
    ``[l_a, u_a]``, ``[l_b, u_b]`` their Wilson intervals, ``d = p_b - p_a`` and

        low  = d - sqrt((p_b - l_b)^2 - 2 phi (p_b - l_b)(u_a - p_a) + (u_a - p_a)^2)
        high = d + sqrt((u_b - p_b)^2 - 2 phi (u_b - p_b)(p_a - l_a) + (p_a - l_a)^2)

    where ``phi`` is the correlation of the pairs, ``(both * neither - only_a * only_b)`` over
    the root of the product of the margins, with Newcombe's correction: a positive numerator
    shrinks by ``n / 2`` (not below 0); ``phi = 0`` when a margin is empty."""
    n = both + only_a + only_b + neither
    if min(both, only_a, only_b, neither) < 0:
        raise ValueError("table counts must be >= 0")
    if n == 0:
        return -1.0, 1.0
    a_wins, b_wins = both + only_a, both + only_b
    p_a, p_b = a_wins / n, b_wins / n
    l_a, u_a = wilson(a_wins, n, z)
    l_b, u_b = wilson(b_wins, n, z)
    margins = a_wins * (n - a_wins) * b_wins * (n - b_wins)
    cross: float = both * neither - only_a * only_b
    if cross > 0:
        cross = max(cross - n / 2, 0.0)
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = p_b - p_a
    down = (p_b - l_b) ** 2 - 2 * phi * (p_b - l_b) * (u_a - p_a) + (u_a - p_a) ** 2
    up = (u_b - p_b) ** 2 - 2 * phi * (u_b - p_b) * (p_a - l_a) + (p_a - l_a) ** 2
    return max(-1.0, d - math.sqrt(max(down, 0.0))), min(1.0, d + math.sqrt(max(up, 0.0)))


@dataclass(frozen=True)
class PairedComparison:
    """Two policies on the same episodes: the 2x2 table, the rates, the difference B - A."""

    pairs: int
    both: int
    """Episodes both policies solved."""
    only_a: int
    """Episodes only A solved (discordant)."""
    only_b: int
    """Episodes only B solved (discordant)."""
    neither: int
    rate_a: float
    rate_b: float
    difference: float
    """``rate_b - rate_a``."""
    ci95: tuple[float, float]
    """Newcombe's 95% interval for ``difference``."""
    p_value: float
    """Two-sided exact McNemar test of "A and B succeed equally often"."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "both": self.both,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "neither": self.neither,
            "rate_a": self.rate_a,
            "rate_b": self.rate_b,
            "difference": self.difference,
            "ci95": [round(self.ci95[0], 4), round(self.ci95[1], 4)],
            "mcnemar_p": self.p_value,
        }


def compare_paired(a: Sequence[bool], b: Sequence[bool]) -> PairedComparison:
    """Compare success outcomes ``a[i]`` and ``b[i]`` of the same episodes ``i``."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)} and {len(b)}")
    both = sum(1 for x, y in zip(a, b, strict=True) if x and y)
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n = len(a)
    neither = n - both - only_a - only_b
    return PairedComparison(
        pairs=n,
        both=both,
        only_a=only_a,
        only_b=only_b,
        neither=neither,
        rate_a=(both + only_a) / n if n else 0.0,
        rate_b=(both + only_b) / n if n else 0.0,
        difference=(only_b - only_a) / n if n else 0.0,
        ci95=paired_difference_interval(both, only_a, only_b, neither),
        p_value=mcnemar_exact(only_a, only_b),
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm (1979) step-down adjusted p-values, in the input's order.

    With ``p_(1) <= ... <= p_(m)`` sorted, ``adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``:
    rejecting every hypothesis with ``adj < alpha`` keeps the family-wise error rate at
    ``alpha``. One p-value is returned as it is."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
