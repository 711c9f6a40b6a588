"""Throughput, MFU and HFU per step, per attempt and per layout; regression and straggler flags.

All FLOP counts come from :mod:`analysis.flops` (the one audited formula). MFU needs the
model shape, the world size and the GPU: from the run's ``config.yaml`` (read as a plain
dict). Without them a log still gives tokens/s, and the TFLOP/s and MFU that the training
job itself printed, if it did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pandas as pd

from analysis import throughput
from analysis.flops import UnknownDevice, hardware_flops, num_floating_point_operations, peak_flops
from launch.kinds import EventKind

__all__ = ["RunShape", "layout_label", "shape_from_config", "step_metrics", "attempt_summary", "layout_summary",
           "regression_flags", "straggler_flags", "run_figures", "step_work", "with_event_times"]


@dataclass
class RunShape:
    """What MFU needs from a run's configuration; any field may be unknown (None)."""

    model: dict[str, Any] | None = None
    world_size: int | None = None
    global_batch_size: int | None = None
    seq_length: int | None = None
    device: str | None = None
    dtype: str = "bf16"
    recompute: str = "none"
    tp: int = 1
    layout: str = "unknown"


_PRECISION_DTYPE = throughput.PRECISION_DTYPE


def shape_from_config(cfg: dict[str, Any] | None) -> RunShape:
    """A :class:`RunShape` from a composed slurmtron ``config.yaml`` (a dict).

    Field names are those of ``launch/config.py`` (model, parallelism, cluster, training);
    ``launch`` is not imported: analysis depends on no other slurmtron package.
    """
    if not cfg:
        return RunShape()
    model = cfg.get("model") or None
    par = cfg.get("parallelism") or {}
    cl = cfg.get("cluster") or {}
    tr = cfg.get("training") or {}
    nodes, gpn = cl.get("nodes"), cl.get("gpus_per_node")
    world = int(nodes) * int(gpn) if isinstance(nodes, int) and isinstance(gpn, int) else None
    tp, pp, cp = int(par.get("tp") or 1), int(par.get("pp") or 1), int(par.get("cp") or 1)
    dp = world // (tp * pp * cp) if world else None
    layout = f"tp{tp}-pp{pp}" + (f"-cp{cp}" if cp > 1 else "") + (f"-dp{dp}" if dp else "")
    if par.get("vpp"):
        layout += f"-vpp{par['vpp']}"
    device = cl.get("gpu")
    return RunShape(
        model=dict(model) if isinstance(model, dict) else None,
        world_size=world,
        global_batch_size=tr.get("global_batch_size"),
        seq_length=(model or {}).get("seq_length") if isinstance(model, dict) else None,
        device=None if device in (None, "", "cpu") else str(device),
        dtype=_PRECISION_DTYPE.get(str(tr.get("precision", "bf16")), "bf16"),
        recompute=str(par.get("recompute") or "none"),
        tp=tp,
        layout=layout,
    )


def step_metrics(it: pd.DataFrame, shape: RunShape) -> pd.DataFrame:
    """Per-step ``tokens_per_s``, ``tflops`` (per GPU), ``mfu`` and ``hfu`` (fractions).

    TFLOP/s is computed from the model when the shape is known (the logged figure is kept
    as ``tflops_per_gpu``); otherwise the logged figure is used. MFU/HFU are NaN when the
    GPU is unknown: never guessed.
    """
    out = it.copy()
    secs = out["elapsed_ms"] / 1000.0
    gbs = out["global_batch_size"].fillna(shape.global_batch_size if shape.global_batch_size else np.nan)
    seq = shape.seq_length if shape.seq_length else np.nan
    out["tokens_per_s"] = gbs * seq / secs
    out["tflops"] = out["tflops_per_gpu"]
    out["mfu"] = out["mfu_pct"] / 100.0
    out["hfu"] = np.nan
    peak = np.nan
    if shape.device:
        try:
            peak = peak_flops(shape.device, shape.dtype)
        except UnknownDevice:
            peak = np.nan
    if shape.model and shape.world_size:
        try:
            per_seq = num_floating_point_operations(shape.model, 1, tp=shape.tp)
            per_seq_hw = hardware_flops(shape.model, 1, recompute=shape.recompute, tp=shape.tp)
        except ValueError:
            per_seq = per_seq_hw = np.nan
        denom = secs * shape.world_size
        model_tflops = gbs * per_seq / denom / 1e12
        out["tflops"] = model_tflops.where(model_tflops.notna(), out["tflops_per_gpu"])
        out["mfu"] = out["tflops"] * 1e12 / peak if np.isfinite(peak) else out["mfu"]
        out["hfu"] = gbs * per_seq_hw / denom / peak if np.isfinite(peak) else np.nan
    elif np.isfinite(peak):
        out["mfu"] = out["mfu"].fillna(out["tflops_per_gpu"] * 1e12 / peak)
    out["layout"] = shape.layout
    return out


def with_event_times(it: pd.DataFrame, events: Optional[list]) -> pd.DataFrame:
    """The log's iteration rows with ``elapsed_ms`` replaced by rank 0's time of the same step from the event log
    (``seconds`` of its ``iteration`` events): the step times every figure is computed from
    (:mod:`analysis.throughput`). Megatron's line is the last rank's time, which a pipeline stage's place in the
    schedule moves by a few percent. A step is matched by its number and its occurrence (a step redone after a
    restart occurs once per attempt that ran it, in time order); a step the two sources do not hold equally often
    (several ranks' logs, a truncated log) keeps its log time."""
    times: dict[int, list] = {}
    for e in events or []:
        if e.get("event") != EventKind.ITERATION:
            continue
        step, sec, rank = e.get("step"), e.get("seconds"), e.get("rank")
        if isinstance(rank, (int, float)) and rank == rank and int(rank) != 0:
            continue
        if isinstance(step, (int, float)) and not isinstance(step, bool) and np.isfinite(step) \
                and isinstance(sec, (int, float)) and not isinstance(sec, bool) and np.isfinite(sec) and sec > 0:
            times.setdefault(int(step), []).append(float(sec))
    if not times or it.empty or "iteration" not in it or "elapsed_ms" not in it:
        return it
    order = it.sort_values("timestamp", kind="stable", na_position="last") if "timestamp" in it else it
    nth = order.groupby("iteration").cumcount()
    count = order.groupby("iteration")["iteration"].transform("size")
    ms = [times[k][n] * 1000.0 if k in times and len(times[k]) == c else np.nan
          for k, n, c in zip(order["iteration"].astype(int), nth, count)]
    out = it.copy()
    out["elapsed_ms"] = pd.Series(ms, index=order.index, dtype=float).reindex(it.index).fillna(it["elapsed_ms"])
    return out


def layout_label(layout: dict[str, Any] | None) -> str | None:
    """``tp2-pp4-dp8`` style label from an event log ``layout`` dict (job_start event)."""
    if not isinstance(layout, dict):
        return None
    parts = [f"{k}{layout[k]}" for k in ("tp", "pp", "cp", "ep", "dp", "vpp")
             if layout.get(k) not in (None, 1) or k in ("tp", "pp")]
    return "-".join(parts) if parts else None


def _steady(df: pd.DataFrame, warmup: int) -> pd.DataFrame:
    """Drop each attempt's first ``warmup`` logged steps (compilation, allocator warm-up)."""
    n = df.groupby(["job", "attempt"]).cumcount()
    return df[n >= warmup]


def step_work(m: pd.DataFrame) -> dict:
    """The work of one step, from the per-step rates x step times (the same for every step of a run): the keyword
    arguments :func:`analysis.throughput.figures` derives the rates from its one step time with."""
    secs = m["elapsed_ms"] / 1000.0

    def med(col: str):
        v = (m[col] * secs).median() if col in m and len(m) else np.nan
        return None if v != v else float(v)

    return {"tokens_per_step": med("tokens_per_s"), "tflop_per_gpu_step": med("tflops"),
            "mfu_seconds": med("mfu"), "hfu_seconds": med("hfu")}


def _attempt_times(m: pd.DataFrame) -> list:
    """Each attempt's logged step times (seconds), in the order logged."""
    return [list(g["elapsed_ms"] / 1000.0) for _, g in m.groupby(["job", "attempt"], sort=False)]


def run_figures(m: pd.DataFrame, events: Optional[list] = None) -> throughput.RunFigures:
    """The run's figures (:mod:`analysis.throughput`): rank 0's step times from the event log's ``iteration``
    events where it has them, else the log lines'; the work of a step from the log lines."""
    work = step_work(m) if len(m) else {}
    ev = throughput.attempts_from_events(events or [])
    if ev:
        return throughput.figures(ev, source="event log", **work)
    return throughput.figures(_attempt_times(m) if len(m) else [], source="log lines", **work)


_FIGURES = ["step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu"]


def _figure_columns(s: pd.DataFrame) -> pd.Series:
    f = throughput.figures([list(s["elapsed_ms"] / 1000.0)], warmup=0, **step_work(s))
    return pd.Series({"step_time_s": f.step_time_s, "tokens_per_s": f.tokens_per_s, "tflops_per_gpu": f.tflops_per_gpu,
                      "mfu": f.mfu, "hfu": f.hfu}, dtype=float)


def attempt_summary(m: pd.DataFrame, warmup: int = throughput.WARMUP_STEPS) -> pd.DataFrame:
    """Per attempt (job segment), over its steady steps: the median step time and the rates at it
    (:mod:`analysis.throughput`'s definition, per attempt)."""
    s = _steady(m, warmup)
    if s.empty:
        s = m
    if s.empty:
        return pd.DataFrame(columns=["job", "attempt", "layout", "steps", *_FIGURES, "first_step", "last_step"])
    g = s.groupby(["job", "attempt"])
    head = g.agg(layout=("layout", "first"), steps=("iteration", "size")).reset_index()
    figs = g.apply(_figure_columns, include_groups=False).reset_index(drop=True)
    tail = g.agg(first_step=("iteration", "min"), last_step=("iteration", "max")).reset_index(drop=True)
    return pd.concat([head, figs, tail], axis=1)


def layout_summary(m: pd.DataFrame, warmup: int = throughput.WARMUP_STEPS) -> pd.DataFrame:
    """Per layout (across runs of a sweep, or across attempts), over the steady steps: the median step time and the
    rates at it."""
    s = _steady(m, warmup)
    if s.empty:
        s = m
    if s.empty:
        return pd.DataFrame(columns=["layout", "steps", *_FIGURES[1:]])
    g = s.groupby("layout")
    head = g.agg(steps=("iteration", "size")).reset_index()
    figs = g.apply(_figure_columns, include_groups=False).reset_index(drop=True)
    return pd.concat([head, figs.drop(columns=["step_time_s"])], axis=1)


def regression_flags(m: pd.DataFrame, *, window: int = 20, baseline_steps: int = 50,
                     threshold: float = 0.10, warmup: int = 2) -> pd.DataFrame:
    """Flag steps whose rolling median step time is ``threshold`` above the run's baseline.

    Baseline: the median step time of the first ``baseline_steps`` steady-state steps of
    the run (per layout: a new layout is a new baseline; per job where the layout is unknown). The rolling median over
    ``window`` logged steps ignores single slow steps (a checkpoint save, a GC pause) and
    catches sustained slow-downs (a degraded node, thermal throttling, a noisy neighbour).
    Adds ``rolling_ms``, ``baseline_ms`` and ``regressed``.
    """
    s = _steady(m, warmup).sort_values(["timestamp", "job", "attempt", "iteration"], kind="stable", na_position="last")
    if s.empty:
        return s.assign(rolling_ms=pd.Series(dtype=float), baseline_ms=pd.Series(dtype=float),
                        regressed=pd.Series(dtype=bool))
    # one baseline per layout; where the layout is unknown (bare logs), one per job
    key = s["layout"].where(s["layout"] != "unknown", "job:" + s["job"].astype(str))
    base = s.groupby(key)["elapsed_ms"].transform(lambda x: x.head(baseline_steps).median())
    roll = s.groupby(key)["elapsed_ms"].transform(
        lambda x: x.rolling(window, min_periods=max(1, window // 2)).median())
    s = s.assign(rolling_ms=roll, baseline_ms=base)
    s["regressed"] = (s["rolling_ms"] > s["baseline_ms"] * (1 + threshold)).fillna(False)
    return s


def straggler_flags(m: pd.DataFrame, *, threshold: float = 0.10) -> pd.DataFrame:
    """Per-rank timing outliers, where several ranks log the same steps.

    For each step logged by more than one rank, each rank's time is divided by the median
    across ranks; a rank whose median ratio exceeds ``1 + threshold`` is a straggler.
    Returns one row per (job, attempt, rank) with ``ratio`` and ``straggler``; empty when
    only one rank logs (Megatron prints iteration lines from the last rank only).
    """
    r = m.dropna(subset=["rank", "elapsed_ms"])
    cols = ["job", "attempt", "rank", "steps", "ratio", "straggler"]
    if r.empty:
        return pd.DataFrame(columns=cols)
    n = r.groupby(["job", "attempt", "iteration"])["rank"].transform("nunique")
    r = r[n > 1]
    if r.empty:
        return pd.DataFrame(columns=cols)
    med = r.groupby(["job", "attempt", "iteration"])["elapsed_ms"].transform("median")
    r = r.assign(ratio=r["elapsed_ms"] / med)
    out = r.groupby(["job", "attempt", "rank"]).agg(steps=("iteration", "size"), ratio=("ratio", "median")).reset_index()
    out["straggler"] = out["ratio"] > 1 + threshold
    return out[cols]
