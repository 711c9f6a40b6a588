"""PNG plots for the report (matplotlib, Agg backend: no display needed on a login node)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from launch.kinds import Cause  # noqa: E402

__all__ = ["plot_timeline", "plot_loss_by_step", "plot_goodput", "plot_mfu_by_layout", "plot_memory"]


def _colour(cause) -> str:
    """The cause's colour (launch/kinds.py); black for a value that is no cause."""
    try:
        return Cause(cause).colour
    except ValueError:
        return "black"


def _x(m: pd.DataFrame) -> tuple[pd.Series, str]:
    """Wall-clock time if every row has a timestamp, else a running step index."""
    if len(m) and m["timestamp"].notna().all():
        return m["timestamp"], "time"
    return pd.Series(np.arange(len(m)), index=m.index), "logged step (in log order; no timestamps)"


def plain(text: str) -> str:
    """``text`` shown as it is: a ``$`` (a run name, a GPU name from a config) would start matplotlib's math
    mode, and a malformed formula there ends the whole report with a parse error."""
    return str(text or "").replace("$", r"\$")


def plot_timeline(m: pd.DataFrame, intr: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Loss and throughput over time, one vertical line per interruption (colour = cause)."""
    m = m.sort_values(["timestamp", "job", "attempt", "seq"], kind="stable", na_position="last").reset_index(drop=True)
    x, xlabel = _x(m)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if m["tflops"].notna().any() and m["mfu"].notna().any():
        tput, ylabel = m["tflops"], "TFLOP/s/GPU"
    elif m["tokens_per_s"].notna().any():  # no accelerator peak (a CPU run): tokens/s reads better
        tput, ylabel = m["tokens_per_s"], "tokens/s"
    elif m["tflops"].notna().any():
        tput, ylabel = m["tflops"], "TFLOP/s/GPU"
    elif m["tokens_per_s"].notna().any():
        tput, ylabel = m["tokens_per_s"], "tokens/s"
    else:  # a bare log: no model shape, so only the step time is known
        tput, ylabel = m["elapsed_ms"] / 1000.0, "step time (s)"
    for _, idx in m.groupby(["job", "attempt"], sort=False).groups.items():  # no line across a restart
        a1.plot(x[idx], m.loc[idx, "lm_loss"], ".-", ms=2, lw=0.8, color="tab:blue")
        a2.plot(x[idx], tput[idx], ".-", ms=2, lw=0.8, color="tab:green")
    a1.set_ylabel("lm loss")
    a2.set_ylabel(ylabel)
    if "regressed" in m and m["regressed"].any():
        r = m["regressed"].fillna(False).astype(bool)
        a2.plot(x[r], tput[r], "x", color="red", ms=4, label="throughput regression")
    seen = set()
    for r in intr.itertuples():
        if xlabel == "time" and pd.notna(r.time):
            xv = r.time
        else:
            hit = m.index[(m["job"] == r.job) & (m["attempt"] == r.attempt)]
            if not len(hit):
                continue
            xv = x[hit[-1]]
        for ax in (a1, a2):
            ax.axvline(xv, color=_colour(r.cause), ls="--", lw=1,
                       label=r.cause if (ax is a2 and r.cause not in seen) else None)
        seen.add(r.cause)
    if seen or ("regressed" in m and m["regressed"].any()):
        a2.legend(fontsize=8, loc="best")
    a2.set_xlabel(xlabel)
    if xlabel != "time":  # a running step index
        _integer_ticks(a2)
    a1.set_title(plain(title) or "loss and throughput; dashed lines: interruptions")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss_by_step(m: pd.DataFrame, intr: pd.DataFrame, path: Path, title: str = "",
                      validation: pd.DataFrame | None = None) -> Path:
    """lm loss against the step, one colour per attempt (a resumed attempt overlaps the redone steps);
    validation loss as markers when the run logged it."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((job, attempt), g) in enumerate(m.groupby(["job", "attempt"], sort=False)):
        g = g.sort_values("iteration")
        ax.plot(g["iteration"], g["lm_loss"], ".-", ms=3, lw=0.9, color=colors[i % len(colors)],
                label=plain(f"job {job} attempt {attempt}"))
    if validation is not None and len(validation):
        ax.plot(validation["iteration"], validation["val_loss"], "s", color="black", ms=5, label="validation loss")
    ax.set_xlabel("iteration")
    _integer_ticks(ax)
    ax.set_ylabel("lm loss")
    ax.set_title(plain(title) or "lm loss by step")
    if len(m):
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


MEMORY_SERIES = (("mem_allocated", "allocated"), ("mem_reserved", "reserved"), ("mem_peak", "peak allocated"),
                 ("mem_gap", "reserved - allocated"), ("mem_rss", "resident set (CPU)"))


def plot_memory(mem: pd.DataFrame, path: Path, plan_gib: float | None = None, title: str = "") -> Path:
    """Rank 0's memory at each logged step (the ``iteration`` events' ``mem_*`` fields, GiB) with the planner's
    per-GPU estimate of the layout as a dashed line (GPU runs: the estimate is of the device's memory)."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    gpu = "mem_allocated" in mem and mem["mem_allocated"].notna().any()
    for col, label in MEMORY_SERIES:
        if col in mem and mem[col].notna().any():
            ax.plot(mem["step"], mem[col] / 2**30, ".-", ms=3, lw=0.9, label=label)
    if plan_gib is not None and gpu:
        ax.axhline(plan_gib, color="black", ls="--", lw=1, label=f"planner estimate {plan_gib:.1f} GiB")
    ax.set_xlabel("iteration")
    _integer_ticks(ax)
    ax.set_ylabel("GiB")
    ax.set_title(plain(title) or "memory by step")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_goodput(gp: dict, path: Path, title: str = "") -> Path:
    """One stacked bar of the allocated time (hours), plus queue wait beside it."""
    parts = [("productive", gp.get("productive_s") or 0.0, "tab:green"),
             ("lost work", gp.get("lost_work_s") or 0.0, "tab:red"),
             ("checkpoint", gp.get("checkpoint_s") or 0.0, "tab:blue"),
             ("restart overhead", gp.get("restart_overhead_s") or 0.0, "tab:orange")]
    qw = gp.get("queue_wait_s") or 0.0
    unit, div = time_unit(max(sum(sec for _, sec, _ in parts), qw))
    fig, ax = plt.subplots(figsize=(10, 2.8))
    left = 0.0
    for name, sec, color in parts:
        ax.barh(["allocation"], [sec / div], left=[left], color=color, label=f"{name} {_amount(sec / div)} {unit}")
        left += sec / div
    ax.barh(["queue wait"], [qw / div], color="tab:gray", label=f"queue wait {_amount(qw / div)} {unit}")
    g = gp.get("goodput")
    ax.set_xlabel({"s": "seconds", "min": "minutes", "h": "hours"}[unit])
    ax.set_title(plain(title) or (f"goodput {g:.1%}" if g is not None else "goodput unknown (no allocation times)"))
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def time_unit(total_s: float) -> tuple[str, float]:
    """The unit a duration of ``total_s`` reads best in: seconds up to 2 minutes, minutes up to 2 hours, else
    hours (a one-minute run's legend in hours would say 0.00 h for everything)."""
    if total_s < 120:
        return "s", 1.0
    if total_s < 7200:
        return "min", 60.0
    return "h", 3600.0


def _amount(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _integer_ticks(ax) -> None:
    """Steps are whole numbers: no 2.5 / 7.5 ticks on a short run's step axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_mfu_by_layout(layouts: pd.DataFrame, path: Path, reason: str = "") -> Path:
    """MFU (and HFU) per layout; tokens/s (or TFLOP/s/GPU) where MFU is unknown, titled with ``reason``."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    if layouts.empty:
        ax.text(0.5, 0.5, "no iterations", ha="center", va="center")
    elif layouts["mfu"].notna().any():
        xs = np.arange(len(layouts))
        ax.bar(xs - 0.2, layouts["mfu"] * 100, 0.4, label="MFU")
        ax.bar(xs + 0.2, layouts["hfu"] * 100, 0.4, label="HFU")
        ax.set_xticks(xs, layouts["layout"])
        ax.set_ylabel("% of dense peak")
        ax.legend(fontsize=8)
    else:
        col = "tokens_per_s" if layouts["tokens_per_s"].notna().any() else "tflops_per_gpu"
        ax.bar(layouts["layout"], layouts[col])
        ax.set_ylabel("TFLOP/s/GPU" if col == "tflops_per_gpu" else "tokens/s")
        ax.set_title(f"no MFU: {plain(reason) or 'unknown model shape or GPU'}; {'tokens/s' if col == 'tokens_per_s' else 'TFLOP/s/GPU'}"
                     " shown", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
