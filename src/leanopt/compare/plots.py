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


# Colours far apart (every pair at least 0.25 apart in RGB, so no two rows share a hue): tab10's
# first five, then the farthest of Kelly's maximum-contrast set, picked one at a time.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#000000", "#000080", "#a1caf1", "#f99379",
           "#8db600", "#654522", "#00ced1", "#dcd300", "#b3446c", "#e377c2", "#7f7f7f", "#008856", "#c2b280",
           "#ff00ff", "#0000ff", "#800000")


def colours(names: list[str]) -> dict[str, str]:
    """A colour of :data:`PALETTE` per name, in order (more names than colours: they repeat)."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def line_style(origin: str) -> dict[str, Any]:
    """leanopt's rows wide and solid underneath, the peers' dashed and narrow on top: where a
    peer trains exactly what leanopt's row trains (torch's AdamW and leanopt's), both show."""
    if origin == "leanopt":
        return {"ls": "-", "lw": 2.6, "zorder": 2, "alpha": 0.85}
    return {"ls": "--", "lw": 1.3, "zorder": 3}


def marker_style(origin: str) -> dict[str, Any]:
    """Filled circles for leanopt, larger hollow triangles for the peers (a coinciding point shows both)."""
    if origin == "leanopt":
        return {"marker": "o", "ms": 6, "zorder": 2}
    return {"marker": "^", "ms": 9, "mfc": "none", "mew": 1.4, "zorder": 3}


def figures(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """The plots as (file name, matplotlib Figure), legends beside the axes (never over the data
    or each other). Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    def no_corner_tick(ax: Any) -> None:
        """No y tick label at the bottom corner, where it would overprint the first x tick label."""
        ax.yaxis.set_major_locator(MaxNLocator(nbins="auto", prune="lower"))

    rows = [r for r in data["results"] if r["status"] == "ok" and r.get("loss_curves")]
    colour = colours([r["optimizer"] for r in rows])
    task, steps = data["settings"]["task"], data["settings"]["steps"]
    n_seeds = len(data["settings"]["seeds"])
    at = f"at lr {data['settings']['lr']:g} (fixed)" if data["settings"].get("fixed_lr") else "at each tuned lr"
    out = []

    fig = Figure(figsize=(9, 4.4), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    window = max(1, steps // 12)
    tops, bottoms = [], []
    for r in rows:
        mean, low, high = _mean_band(r["loss_curves"], window)
        x = range(1, len(mean) + 1)
        ax.plot(x, mean, color=colour[r["optimizer"]], label=f"{r['optimizer']} (lr {_lr(r['lr'])})",
                **line_style(r["origin"]))
        ax.fill_between(x, low, high, color=colour[r["optimizer"]], alpha=0.12, lw=0)
        tail = [v for v in mean[max(1, steps // 8) :] if math.isfinite(v)]
        if tail:
            tops.append(max(tail))
            bottoms.append(min(tail))
    if tops and max(tops) > min(bottoms):  # one flat point (a 2-step run): matplotlib's own limits
        span = max(tops) - min(bottoms)
        ax.set_ylim(min(bottoms) - 0.05 * span, max(tops) + 0.05 * span)
    no_corner_tick(ax)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving mean of {window})")
    ax.set_title(f"{task}: training loss {at}, mean ± std over {n_seeds} seeds (dashed: peers)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7)
    out.append((LOSS_CURVES, fig))

    scored = [r for r in rows if _finite(r.get("val_loss_mean"))]
    if scored:
        fig = Figure(figsize=(11, 4.2), dpi=90, layout="constrained")
        axes = fig.subplots(1, 2, sharey=True)
        for ax, key, label in ((axes[0], "state_bytes", "optimizer state (MiB)"),
                               (axes[1], "peak_bytes", "peak training memory (MiB)")):
            for r in scored:
                if r.get(key) is not None:
                    ax.errorbar(r[key] / MiB, r["val_loss_mean"], yerr=r.get("val_loss_std") or 0.0,
                                color=colour[r["optimizer"]], capsize=3, lw=1, **marker_style(r["origin"]))
            ax.margins(x=0.1, y=0.12)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        no_corner_tick(axes[0])
        axes[0].set_ylabel(f"validation loss (mean ± std, {n_seeds} seeds)")
        handles = [Line2D([], [], color=colour[r["optimizer"]], ls="", label=r["optimizer"], **marker_style(r["origin"]))
                   for r in scored]
        fig.legend(handles=handles, loc="outside right upper", fontsize=7)
        fig.suptitle(f"{task}: memory vs validation loss {at} (circles: leanopt, triangles: peers)", fontsize=10)
        out.append((MEMORY_VS_LOSS, fig))

    swept = [r for r in rows if len(r.get("lr_grid") or []) > 1]
    if swept:
        fig = Figure(figsize=(9.5, 4.6), dpi=90, layout="constrained")
        ax = fig.add_subplot()
        values = [v for r in swept for v in r.get("grid_val_loss") or [] if _finite(v)]
        for r in swept:
            c = colour[r["optimizer"]]
            pts = sorted((lr, v) for lr, v in zip(r["lr_grid"], r["grid_val_loss"]) if _finite(lr) and _finite(v))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, label=r["optimizer"],
                        **line_style(r["origin"]), **{k: v for k, v in marker_style(r["origin"]).items() if k != "zorder"})
            for v in (v for lr, v in zip(r["lr_grid"], r["grid_val_loss"]) if lr == "relative" and _finite(v)):
                ax.axhline(v, color=c, ls=":", lw=1.2, label=f"{r['optimizer']}: relative step")
            if _finite(r.get("lr")) and _finite(r.get("val_loss_mean")):
                ax.errorbar([r["lr"]], [r["val_loss_mean"]], yerr=[r.get("val_loss_std") or 0.0], color=c,
                            marker="*", ms=12, capsize=4, lw=1.2, zorder=4)
        if values:
            bottom, top = min(values), max(values)  # not low/high: the loss band's arrays above
            span = (top - bottom) or 0.1
            ax.set_ylim(bottom - 0.08 * span, top + 0.12 * span)
        ax.set_xscale("log")
        no_corner_tick(ax)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("validation loss (first seed)")
        ax.set_title(f"{task}: validation loss vs lr (star: the pick, mean ± std over {n_seeds} seeds; "
                     "dotted: relative step)", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        fig.legend(loc="outside right upper", fontsize=7)
        out.append((LR_SWEEP, fig))
    return out


def write_plots(data: dict[str, Any], out_dir: Path) -> tuple[list[str], str | None]:
    """Write the plots; returns (file names, None) or ([], why there are none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return [], "matplotlib is not installed (pip install matplotlib)"
    if not any(r["status"] == "ok" and r.get("loss_curves") for r in data["results"]):
        return [], "no optimizer finished"
    files = []
    for name, fig in figures(data):
        _save(fig, out_dir / name)
        files.append(name)
    return files, None


def _save(fig: Any, path: Path) -> None:
    """A PNG whole or not at all; a failed write is one line naming it (a full disk, ...)."""
    write_atomically(path, lambda f: fig.savefig(f, format="png"))


def _lr(lr: Any) -> str:
    return f"{lr:.3g}" if isinstance(lr, (int, float)) else str(lr)
