"""Does one Slurm slice leave room to train? The check's warning (a note: the run may still be fine).

A slice of ``run.time_limit_min`` must hold the ranks' start-up (imports, rendezvous, checkpoint load, data),
then a few steps, then the signal lead (``training.signal_lead_time_s``: the stop checkpoint is written in it).
Start-up and step time are measured from the run's own event log when it has one (``job_start`` to the first
``iteration`` of each attempt, the slowest; the median step time), else start-up is assumed to be
:data:`ASSUMED_STARTUP_S`. A slice that still cannot train requeues itself without saving
(:mod:`recovery.startup_watch`) and the zero-progress guard ends a chain that never trains; this warning says
so before anything is submitted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from launch.kinds import EventKind
from recovery.events import read_events

ASSUMED_STARTUP_S = 120.0  # no measurement yet: a conservative start-up for a small job on a busy node
FEW_STEPS = 3


def measured(events: list[dict]) -> tuple[Optional[float], Optional[float]]:
    """(slowest start-up seconds, median step seconds) from an event log; None where it has none."""
    starts: dict = {}
    startup = []
    steps = []
    for e in events:
        key = (str(e.get("job_id")), e.get("restart_count"))
        t = e.get("time")
        if not isinstance(t, (int, float)):
            continue
        if e.get("event") == EventKind.JOB_START:
            starts[key] = float(t)
        elif e.get("event") == EventKind.ITERATION:
            if key in starts:
                startup.append(float(t) - starts.pop(key))
            if isinstance(e.get("seconds"), (int, float)):
                steps.append(float(e["seconds"]))
    steps.sort()
    return (max(startup) if startup else None), (steps[len(steps) // 2] if steps else None)


def slice_warning(time_limit_min: float, lead_s: float, events_path: Optional[Path] = None) -> Optional[str]:
    """One WARNING line when ``time_limit_min`` leaves less than start-up + a few steps + the lead, else None."""
    events: list[dict] = []
    if events_path is not None:
        try:
            events = read_events(events_path)
        except OSError:
            events = []
    startup, step = measured(events)
    src = "measured in this run" if startup is not None else "assumed, not yet measured"
    startup = startup if startup is not None else ASSUMED_STARTUP_S
    steps = FEW_STEPS * (step or 0.0)
    need = startup + steps + lead_s
    limit = time_limit_min * 60
    if limit >= need:
        return None
    step_text = f" + {FEW_STEPS} steps x {step:.1f} s" if step else ""
    return (f"WARNING: run.time_limit_min: a {time_limit_min:g}-minute slice ({limit:.0f} s) leaves no room to train: "
            f"start-up {startup:.0f} s ({src}){step_text} + training.signal_lead_time_s {lead_s:g} s = {need:.0f} s. "
            f"A slice that cannot train requeues itself without saving, and the zero-progress guard ends a chain "
            f"that never trains; set run.time_limit_min>={int(-(-need * 1.5 // 60))} (1.5 x {need:.0f} s)")
