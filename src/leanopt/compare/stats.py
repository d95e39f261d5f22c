"""The comparison's statistics: picking the lr, mean ± std over seeds, the verdict against AdamW.

Pure functions on plain numbers, so that the rules the report states are the rules tested.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, TypeGuard

# Two-sided 95 % quantiles of Student's t (t_{0.975, df}); between tabulated degrees of freedom
# the next lower one is used, which only ever makes the test more cautious.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}
Z975 = 1.960

VERDICT_RULE = (
    "delta = mean val loss of the optimizer - mean val loss of AdamW (positive: worse), each at its "
    "own tuned lr over its seeds; delta_std = sqrt(s1^2/n1 + s2^2/n2), the standard error of that "
    "difference (Welch). 'within noise' when |delta| <= t * delta_std, with t the two-sided 95% "
    "Student-t quantile at Welch's degrees of freedom (4.30 for 2 seeds each, 2.78 for 3); "
    "otherwise 'worse by delta ± delta_std' or 'better by |delta| ± delta_std'"
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


def t_quantile(df: float) -> float:
    if not math.isfinite(df) or df > max(_T975):
        return Z975
    usable = [k for k in _T975 if k <= max(df, 1.0)]
    return _T975[max(usable)]


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None, float | None]:
    """(mean(a) - mean(b), standard error of that difference, Welch's degrees of freedom).

    The error and degrees of freedom are None when either side has fewer than two values.
    """
    ma, sa = mean_std(a)
    mb, sb = mean_std(b)
    if ma is None or mb is None:
        raise ValueError("welch() needs at least one finite value on each side")
    if sa is None or sb is None:
        return ma - mb, None, None
    na, nb = sum(finite(x) for x in a), sum(finite(x) for x in b)
    va, vb = sa * sa / na, sb * sb / nb
    se = math.sqrt(va + vb)
    if va + vb == 0.0:
        return ma - mb, 0.0, math.inf
    df = (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1))
    return ma - mb, se, df


def verdict(values: Sequence[float], reference: Sequence[float], *, higher_is_better: bool = False) -> dict[str, Any]:
    """The verdict of ``values`` (val losses over seeds) against the reference's; see VERDICT_RULE.

    Returns ``{"verdict", "delta", "delta_std"}``; lower is better (a loss), or higher with
    ``higher_is_better`` (an accuracy, an F1). ``delta`` is ``values`` minus ``reference`` either way.
    """
    if not any(finite(x) for x in values) or not any(finite(x) for x in reference):
        return {"verdict": "no comparison (no finite validation loss)", "delta": None, "delta_std": None}
    delta, se, df = welch(values, reference)
    if se is None:
        return {"verdict": "untested (needs 2 or more seeds on both sides)", "delta": delta, "delta_std": None}
    threshold = t_quantile(df) * se if df is not None else math.inf
    if abs(delta) <= threshold:
        word = "within noise"
    else:
        worse = delta < 0 if higher_is_better else delta > 0
        word = f"{'worse' if worse else 'better'} by {abs(delta):.3f} ± {se:.3f}"
    return {"verdict": word, "delta": delta, "delta_std": se}
