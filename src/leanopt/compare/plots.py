"""PNG plots of a comparison (matplotlib, Agg backend; without it, no plots and the report says so)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from leanopt.writing import write_atomically

MiB = 1024**2
LOSS_CURVES = "loss_curves.png"
MEMORY_VS_LOSS = "memory_vs_loss.png"
LR_SWEEP = "lr_sweep.png"
PLOTS = (LOSS_CURVES, MEMORY_VS_LOSS, LR_SWEEP)


def _smooth(values: list[float | None], window: int) -> list[float]:
    """Trailing moving average; the raw per-step loss of a small batch is too noisy to compare."""
    out, acc, n = [], 0.0, 0
    finite = [v if v is not None and math.isfinite(v) else math.nan for v in values]
    for i, v in enumerate(finite):
        acc += v
        n += 1
        if n > window:
            acc -= finite[i - window]
            n -= 1
        out.append(acc / n)
    return out


def _label_groups(points: list[tuple[float, float, dict[str, Any]]]) -> list[tuple[float, float, str]]:
    """One label per cluster of points that would overprint (AdamW and torch's AdamW coincide)."""
    if not points:
        return []
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    groups: list[list[tuple[float, float, dict[str, Any]]]] = []
    for p in points:
        for g in groups:
            if abs(p[0] - g[0][0]) / dx < 0.06 and abs(p[1] - g[0][1]) / dy < 0.06:
                g.append(p)
                break
        else:
            groups.append([p])
    return [(g[0][0], g[0][1], ", ".join(q[2]["optimizer"] for q in g)) for g in groups]


def _place_labels(groups: list[tuple[float, float, str]]) -> list[tuple[float, float, str, float]]:
    """Vertical offsets (points) so that labels of nearby points don't overprint (a greedy guess)."""
    if not groups:
        return []
    xs, ys = [g[0] for g in groups], [g[1] for g in groups]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    placed: list[tuple[float, float, float]] = []  # normalized x-start, x-end, y of each label
    out = []
    for x, y, names in sorted(groups, key=lambda g: g[0]):
        nx, ny = (x - min(xs)) / dx * 0.6, (y - min(ys)) / dy * 0.75  # axes fraction, with the margins
        width = 0.02 * len(names)
        for offset in (3.0, -10.0, 12.0, -19.0, 21.0, -28.0):
            label_y = ny + offset / 200
            if all(not (nx < x1 and x0 < nx + width and abs(label_y - ly) < 0.05) for x0, x1, ly in placed):
                break
        placed.append((nx, nx + width, label_y))
        out.append((x, y, names, offset))
    return out


def _mean_band(curves: list[list[float | None]], window: int) -> tuple[list[float], list[float], list[float]]:
    """Per-step mean of the smoothed curves and mean ± std (the band) across seeds."""
    smoothed = [_smooth(c, window) for c in curves if c]
    n = min((len(c) for c in smoothed), default=0)
    mean, low, high = [], [], []
    for i in range(n):
        xs = [c[i] for c in smoothed]
        m = sum(xs) / len(xs)
        sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        mean.append(m)
        low.append(m - sd)
        high.append(m + sd)
    return mean, low, high


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def write_plots(data: dict[str, Any], out_dir: Path) -> tuple[list[str], str | None]:
    """Write the plots; returns (file names, None) or ([], why there are none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install matplotlib)"
    rows = [r for r in data["results"] if r["status"] == "ok" and r.get("loss_curves")]
    if not rows:
        return [], "no optimizer finished"
    colors = {r["optimizer"]: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(data["results"])}
    task, steps = data["settings"]["task"], data["settings"]["steps"]
    n_seeds = len(data["settings"]["seeds"])
    at = f"at lr {data['settings']['lr']:g} (fixed)" if data["settings"].get("fixed_lr") else "at each tuned lr"
    files = []

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    window = max(1, steps // 12)
    tops, bottoms = [], []
    for r in rows:
        mean, low, high = _mean_band(r["loss_curves"], window)
        x = range(1, len(mean) + 1)
        style = "--" if r["origin"] != "leanopt" else "-"
        ax.plot(x, mean, style, lw=1.4, color=colors[r["optimizer"]], label=f"{r['optimizer']} (lr {_lr(r['lr'])})")
        ax.fill_between(x, low, high, color=colors[r["optimizer"]], alpha=0.15, lw=0)
        tail = [v for v in mean[max(1, steps // 8) :] if math.isfinite(v)]
        if tail:
            tops.append(max(tail))
            bottoms.append(min(tail))
    if tops and max(tops) > min(bottoms):  # one flat point (a 2-step run): matplotlib's own limits
        span = max(tops) - min(bottoms)
        ax.set_ylim(min(bottoms) - 0.05 * span, max(tops) + 0.05 * span)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving mean of {window})")
    ax.set_title(f"{task}: training loss {at}, mean ± std over {n_seeds} seeds (dashed: peers)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save(fig, out_dir / LOSS_CURVES)
    plt.close(fig)
    files.append(LOSS_CURVES)

    scored = [r for r in rows if _finite(r.get("val_loss_mean"))]
    if scored:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4), dpi=90, sharey=True)
        for ax, key, label in ((axes[0], "state_bytes", "optimizer state (MiB)"),
                               (axes[1], "peak_bytes", "peak training memory (MiB)")):
            points = [(r[key] / MiB, r["val_loss_mean"], r) for r in scored if r.get(key) is not None]
            for x, y, r in points:
                ax.errorbar(x, y, yerr=r.get("val_loss_std") or 0.0, color=colors[r["optimizer"]], capsize=3,
                            marker="o" if r["origin"] == "leanopt" else "^", ms=6, lw=1)
            for x, y, names, dy in _place_labels(_label_groups(points)):
                ax.annotate(names, (x, y), fontsize=7, xytext=(5, dy), textcoords="offset points")
            ax.margins(x=0.3, y=0.12)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(f"validation loss (mean ± std, {n_seeds} seeds)")
        fig.suptitle(f"{task}: memory vs validation loss {at} (circles: leanopt, triangles: peers)",
                     fontsize=10)
        fig.tight_layout()
        _save(fig, out_dir / MEMORY_VS_LOSS)
        plt.close(fig)
        files.append(MEMORY_VS_LOSS)

    swept = [r for r in rows if len(r.get("lr_grid") or []) > 1]
    if swept:
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=90)
        values = [v for r in swept for v in r.get("grid_val_loss") or [] if _finite(v)]
        for r in swept:
            color = colors[r["optimizer"]]
            style = "--" if r["origin"] != "leanopt" else "-"
            pts = [(lr, v) for lr, v in zip(r["lr_grid"], r["grid_val_loss"]) if _finite(lr) and _finite(v)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", color=color, lw=1.2,
                        label=r["optimizer"])
            relative = [v for lr, v in zip(r["lr_grid"], r["grid_val_loss"]) if lr == "relative" and _finite(v)]
            for v in relative:
                ax.axhline(v, color=color, ls=":", lw=1)
                ax.annotate(f"{r['optimizer']}: relative step", (1.0, v), xycoords=("axes fraction", "data"),
                            xytext=(-4, 2), textcoords="offset points", ha="right", fontsize=6, color=color)
            if _finite(r.get("lr")) and _finite(r.get("val_loss_mean")):
                ax.errorbar([r["lr"]], [r["val_loss_mean"]], yerr=[r.get("val_loss_std") or 0.0], color=color,
                            marker="*", ms=10, capsize=4, lw=1.2)
        if values:
            low, high = min(values), max(values)
            span = (high - low) or 0.1
            ax.set_ylim(low - 0.08 * span, high + 0.12 * span)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("validation loss (first seed)")
        ax.set_title(f"{task}: validation loss vs lr (star: the pick, mean ± std over {n_seeds} seeds; "
                     "dotted: relative step)", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        _save(fig, out_dir / LR_SWEEP)
        plt.close(fig)
        files.append(LR_SWEEP)
    return files, None


def _save(fig: Any, path: Path) -> None:
    """A PNG whole or not at all; a failed write is one line naming it (a full disk, ...)."""
    write_atomically(path, lambda f: fig.savefig(f, format="png"))


def _lr(lr: Any) -> str:
    return f"{lr:.3g}" if isinstance(lr, (int, float)) else str(lr)
