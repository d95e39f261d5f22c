"""The comparison's statistics: picking the lr, mean ± std over seeds, the verdict against AdamW.

Pure functions on plain numbers, so that the rules the report states are the rules tested.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

ALPHA = 0.05  # two-sided: a difference with p < ALPHA is called better or worse
# Equal, not just "not shown different": the 95 % confidence interval of the difference lies within
# this share of the reference's mean (2 % of a loss of 0.64 is 0.013).
MARGIN = 0.02
# A run too short to rank optimizers by their loss: the reference's accuracy closes under this share
# of the gap between always answering the most common label and a perfect score, or its training
# loss still fell, over the last third of the steps, by more than this share (a least-squares line
# through the mean over seeds, its slope below zero at p < ALPHA).
NEAR_CHANCE = 0.25
STILL_FALLING = 0.05

VERDICT_RULE = (
    "delta = mean val loss of the optimizer - mean val loss of AdamW (positive: worse), each at its own tuned lr "
    "over its seeds. A seed fixes the initial weights and the batch order for every optimizer, so where both ran "
    "the same seeds the test is the paired t-test of the per-seed differences (se = their std / sqrt(n), df = n - 1: "
    "the seed-to-seed spread both share cancels); otherwise Welch's t-test (se = sqrt(s1^2/n1 + s2^2/n2), "
    "Welch-Satterthwaite df). t = delta / se (se: delta_std), p two-sided from Student's t distribution, 95% CI = "
    "delta ± t(0.975, df) * se. 'better by' / 'worse by' |delta| when p < 0.05, with ', within 2%' when the 95% "
    "CI lies within ±2% of AdamW's mean (a real but negligible difference); 'equal within 2%' when p >= 0.05 and the "
    "CI lies within ±2%; otherwise 'cannot decide' (the CI reaches past ±2%: more seeds or steps would tell); "
    "'untested' with fewer than 2 seeds on a side"
)
REFERENCE = "reference"


def finite(x: Any) -> TypeGuard[float]:
    """Whether ``x`` is a finite real number (an int or a float, not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); std is None for fewer than two values."""
    xs = [float(x) for x in values if finite(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def quartiles(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """(first quartile, median, third quartile); a single value is all three."""
    xs = sorted(float(x) for x in values if finite(x))
    if not xs:
        return None, None, None
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def pick(points: Sequence[tuple[Any, float | None]]) -> int | None:
    """Index of the grid point with the lowest finite validation loss (the first on a tie).

    ``points`` are ``(lr, val_loss)``; a diverged run (None, NaN) is never picked. None when
    every point diverged.
    """
    best: int | None = None
    best_loss = math.inf
    for i, (_, loss) in enumerate(points):
        if finite(loss) and (best is None or loss < best_loss):
            best, best_loss = i, loss
    return best


def macro_f1(predicted: Sequence[int], truth: Sequence[int]) -> float:
    """The unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN), over every class that
    occurs in ``truth`` or ``predicted`` (scikit-learn's ``f1_score(average="macro")``; a
    class with no true or predicted example scores 0)."""
    if len(predicted) != len(truth):
        raise ValueError(f"macro_f1: {len(predicted)} predictions for {len(truth)} labels")
    classes = sorted(set(truth) | set(predicted))
    if not classes:
        return 0.0
    scores = []
    for c in classes:
        tp = sum(p == c and t == c for p, t in zip(predicted, truth))
        wrong = sum((p == c) != (t == c) for p, t in zip(predicted, truth))  # FP + FN
        scores.append(2 * tp / (2 * tp + wrong) if tp or wrong else 0.0)
    return statistics.fmean(scores)


def at_edge(grid: Sequence[Any], chosen: Any) -> bool:
    """Whether the pick is the smallest or the largest numeric lr of a grid of 3 or more.

    The best lr may then lie outside the grid; the report says so.
    """
    numeric = sorted(x for x in grid if finite(x))
    return len(numeric) >= 3 and finite(chosen) and chosen in (numeric[0], numeric[-1])


# ---- Student's t distribution (no scipy: the runtime needs only torch and rich) ----------------------
def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; converges fast for
    x < (a + 1) / (a + b + 2))."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (not necessarily whole: Welch's);
    the normal distribution for an infinite ``df``."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(df: float, p: float = 0.975) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must lie in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(df, 1.0 - p)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2.0 * high
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return 0.5 * (low + high)


@dataclass(frozen=True)
class TTest:
    """A t-test of mean(a) - mean(b) (``test``: ``"welch"`` or ``"paired"``): the difference, its
    standard error, the degrees of freedom, t, the two-sided p and the 95 % confidence interval.
    ``se``, ``df``, ``t``, ``p`` and the interval are None when a side has fewer than two values."""

    test: str
    delta: float
    se: float | None = None
    df: float | None = None
    t: float | None = None
    p: float | None = None
    low: float | None = None
    high: float | None = None


def _t_test(test: str, delta: float, se: float, df: float) -> TTest:
    if se == 0.0:  # no spread: only an exact tie is no difference
        return TTest(test, delta, 0.0, df, 0.0 if delta == 0.0 else math.copysign(math.inf, delta),
                     1.0 if delta == 0.0 else 0.0, delta, delta)  # fmt: skip
    t = delta / se
    p = regularized_beta(df / (df + t * t), df / 2.0, 0.5)  # 2 P(T > |t|)
    half = t_quantile(df) * se
    return TTest(test, delta, se, df, t, p, delta - half, delta + half)


def welch(a: Sequence[float], b: Sequence[float]) -> TTest:
    """Welch's t-test for the finite values of ``a`` and ``b`` (``ValueError`` if a side has none)."""
    ma, sa = mean_std(a)
    mb, sb = mean_std(b)
    if ma is None or mb is None:
        raise ValueError("welch() needs at least one finite value on each side")
    if sa is None or sb is None:
        return TTest("welch", ma - mb)
    na, nb = sum(finite(x) for x in a), sum(finite(x) for x in b)
    va, vb = sa * sa / na, sb * sb / nb
    df = (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1)) if va + vb else math.inf
    return _t_test("welch", ma - mb, math.sqrt(va + vb), df)


def paired(a: Sequence[float], b: Sequence[float]) -> TTest:
    """The paired t-test of ``a[i] - b[i]`` over the pairs where both are finite (``ValueError``
    for sequences of different lengths or no such pair)."""
    if len(a) != len(b):
        raise ValueError(f"paired() needs pairs: {len(a)} values against {len(b)}")
    differences = [float(x) - float(y) for x, y in zip(a, b) if finite(x) and finite(y)]
    mean, std = mean_std(differences)
    if mean is None:
        raise ValueError("paired() needs at least one pair of finite values")
    if std is None:
        return TTest("paired", mean)
    return _t_test("paired", mean, std / math.sqrt(len(differences)), len(differences) - 1.0)


def p_text(p: float) -> str:
    """``p = 0.041``, ``p < 0.001``."""
    return "p < 0.001" if p < 0.001 else f"p = {p:.2g}" if p < 0.1 else f"p = {p:.2f}"


def verdict(values: Sequence[float], reference: Sequence[float], *, higher_is_better: bool = False,
            paired_seeds: bool = False) -> dict[str, Any]:
    """The verdict of ``values`` (val losses over seeds) against the reference's; see VERDICT_RULE.

    ``paired_seeds``: ``values[i]`` and ``reference[i]`` were trained from the same seed (the paired
    test), else Welch's. Returns ``{"verdict", "verdict_kind", "delta", "delta_std", "p", "df",
    "ci", "test"}``: the words, one of ``better``, ``worse``, ``equal``, ``undecided``,
    ``untested``, ``none``; lower is better (a loss), or higher with ``higher_is_better`` (an
    accuracy, an F1). ``delta`` is ``values`` minus ``reference`` either way.
    """
    if not any(finite(x) for x in values) or not any(finite(x) for x in reference):
        return {"verdict": "no comparison (no finite validation loss)", "verdict_kind": "none", "delta": None,
                "delta_std": None, "p": None, "df": None, "ci": None, "test": None}
    pairs = paired_seeds and len(values) == len(reference) and sum(finite(x) and finite(y) for x, y in zip(values, reference)) >= 2
    test = paired(values, reference) if pairs else welch(values, reference)
    out: dict[str, Any] = {"delta": test.delta, "delta_std": test.se, "p": test.p, "df": test.df, "test": test.test,
                           "ci": None if test.low is None else [test.low, test.high]}
    if test.p is None or test.low is None or test.high is None:
        return out | {"verdict": "untested (needs 2 or more seeds on both sides)", "verdict_kind": "untested"}
    margin = MARGIN * abs(statistics.fmean(float(x) for x in reference if finite(x)))
    within = -margin <= test.low and test.high <= margin  # equal for any practical purpose
    if test.p < ALPHA:  # a difference, perhaps a negligible one
        direction = "worse" if (test.delta < 0 if higher_is_better else test.delta > 0) else "better"
        kind = "equal" if within else direction
        words = f"{direction} by {abs(test.delta):.3f}{f', within {100 * MARGIN:.0f}%' if within else ''} ({p_text(test.p)})"
    elif within:
        kind, words = "equal", f"equal within {100 * MARGIN:.0f}% ({p_text(test.p)})"
    else:
        kind, words = "undecided", f"cannot decide ({p_text(test.p)})"
    return out | {"verdict": words, "verdict_kind": kind}


# ---- is the run long enough to rank by loss ------------------------------------------------------
def chance_accuracy(labels: Sequence[Any]) -> float | None:
    """The accuracy of always answering the most common label (None for no labels)."""
    if not labels:
        return None
    counts: dict[Any, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return max(counts.values()) / len(labels)


def near_chance(accuracy: Any, chance: Any) -> bool:
    """Whether ``accuracy`` closes under :data:`NEAR_CHANCE` of the gap from ``chance`` to 1."""
    return finite(accuracy) and finite(chance) and chance < 1.0 and (accuracy - chance) / (1.0 - chance) < NEAR_CHANCE


@dataclass(frozen=True)
class Trend:
    """A least-squares line through the last ``steps`` points of a loss curve: how much it fell over
    them (its slope times the span, positive: fell), that drop relative to the line's last value,
    and the two-sided p of the slope (Student's t, steps - 2 degrees of freedom)."""

    steps: int
    drop: float
    relative: float
    p: float

    @property
    def falling(self) -> bool:
        return self.drop > 0 and self.p < ALPHA and self.relative > STILL_FALLING


def trend(curves: Sequence[Sequence[float]], share: float = 1 / 3) -> Trend | None:
    """:class:`Trend` of the last ``share`` of the steps of the mean of ``curves`` (one per seed, the
    per-step training loss); None with fewer than 4 finite points there."""
    lengths = {len(c) for c in curves if c}
    if len(lengths) != 1:
        return None
    n = lengths.pop()
    means = [statistics.fmean(v) if len(v := [c[i] for c in curves if finite(c[i])]) == len(curves) else None
             for i in range(n)]
    tail = [(i, m) for i, m in enumerate(means[n - max(4, round(n * share)):], start=0) if m is not None]
    if len(tail) < 4:
        return None
    xs, ys = [float(i) for i, _ in tail], [m for _, m in tail]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    df = len(xs) - 2
    se = math.sqrt(residual / df / sxx)
    end = my + slope * (xs[-1] - mx)
    p = 1.0 if se == 0.0 and slope == 0.0 else 0.0 if se == 0.0 else regularized_beta(df / (df + (slope / se) ** 2), df / 2.0, 0.5)
    drop = -slope * (xs[-1] - xs[0])
    return Trend(len(xs), drop, drop / end if end > 0 else math.inf, p)
