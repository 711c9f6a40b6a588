"""GPU-hours and what they cost: the one place this arithmetic lives.

The submit summary prices the planner's estimate to the target; ``status`` prices the GPU-hours
a run has used so far (from Slurm's accounting records, or from the event log where Slurm has
none). The price is ``cluster.gpu_hour_price`` (per GPU-hour, in whatever currency the site bills);
``None`` means no cost line at all. Login-node code: no torch.
"""
from __future__ import annotations

from typing import Iterable, Optional


def gpu_hours(spans: Iterable[tuple[float, float]]) -> float:
    """Sum of ``gpus x seconds`` over ``(gpus, seconds)`` spans, in hours."""
    return sum(max(0.0, float(g)) * max(0.0, float(s)) for g, s in spans) / 3600.0


def cost(hours: Optional[float], price: Optional[float]) -> Optional[float]:
    """``hours x price``, or None when either is unknown."""
    if hours is None or price is None:
        return None
    return hours * price


def unit(gpu: str) -> str:
    """What one hour of one rank is called: a CPU cluster has processes, not GPUs."""
    return "process-hours" if gpu == "cpu" else "GPU-hours"


def cost_text(hours: Optional[float], price: Optional[float], *, gpu: str = "", what: str = "") -> Optional[str]:
    """``'123.45 (49.4 GPU-hours x 2.5 per GPU-hour, estimate)'``; None without a price or hours."""
    total = cost(hours, price)
    if total is None:
        return None
    u = unit(gpu)
    digits = 0 if hours >= 100 else (1 if hours >= 1 else 3)
    return (f"{total:,.2f} ({hours:,.{digits}f} {u} x {price:g} per {u[:-1]}"
            + (f", {what}" if what else "") + ")")
