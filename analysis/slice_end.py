"""The one rule for a slice that ended TIMEOUT without a word, and how to continue a run that ended early.

A Slurm attempt whose final state is TIMEOUT (or DEADLINE) ended by its time limit. When the worker wrote its stop
checkpoint in the signal lead and asked for the requeue, its last ``exit`` event says ``requeue``; when it drained or
completed, ``stopped`` or ``completed``. An attempt with none of those was killed at the limit before any of it (for
instance a start-up that outlasted the slice minus the lead), and nothing requeued it: the run stops there unless
someone continues it. ``launch/status.py`` (through ``launch/run_state.py``) and the report both say so with
:func:`timeout_line`. Plain dicts and strings only: no torch, no pandas.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional

from launch.kinds import EventKind

TIMEOUT_STATES = ("TIMEOUT", "DEADLINE")
ANSWERED = ("requeue", "stopped", "completed")  # exit reasons of an attempt that handled its own end


def continue_hint(run_name: str, step: Optional[int]) -> str:
    """How to go on with a run that ended before its last step."""
    where = f"the step-{step} checkpoint" if step is not None else "its newest verified checkpoint"
    return (f"continue with: the same python launch/pretrain.py command (run.name={run_name}); it resumes "
            f"from {where}")


def _restart(e: Mapping[str, Any]) -> Optional[int]:
    v = e.get("restart_count")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return int(v)


def attempt_events(events: Iterable[Mapping[str, Any]], job_id: str,
                   attempt: Optional[int] = None) -> list[Mapping[str, Any]]:
    """The events of one attempt of job ``job_id``: restart count ``attempt``, or when it is not known (sacct
    without ``-D``) the newest restart count the job's events carry (an attempt that wrote nothing has no events)."""
    mine = [e for e in events if str(e.get("job_id")) == str(job_id)]
    if attempt is None:
        attempt = max((_restart(e) or 0 for e in mine), default=0)
    return [e for e in mine if (_restart(e) or 0) == attempt]


def unanswered_timeout(slurm_state: str, events: Iterable[Mapping[str, Any]]) -> bool:
    """True when Slurm ended the attempt by its time limit and its own events (``events``: that attempt's) hold no
    exit that handled the end (a requeue, a drain, the last step)."""
    if str(slurm_state or "").split(" ")[0].rstrip("+").upper() not in TIMEOUT_STATES:
        return False
    last_exit = next((e for e in reversed(list(events)) if e.get("event") == EventKind.EXIT), None)
    return last_exit is None or last_exit.get("reason") not in ANSWERED


def timeout_line(time_limit_min: Any, run_name: str, checkpoint_step: Optional[int]) -> str:
    """The one line status and the report print for :func:`unanswered_timeout`."""
    return (f"the slice ran out of time (run.time_limit_min={time_limit_min}) before a stop checkpoint, and nothing "
            f"requeued it; {continue_hint(run_name, checkpoint_step)}")


def report_line(sacct: Any, events: Any, config: Optional[Mapping[str, Any]], run_name: str) -> Optional[str]:
    """The report's :func:`timeout_line` for a run whose last attempt (the newest allocation row of its sacct dumps)
    ended TIMEOUT unanswered, or None. A later job of the run that started (a ``job_start`` event of a larger job id:
    Slurm numbers jobs in submission order) continued it: then None too. ``sacct``/``events``: the report's frames."""
    if sacct is None or getattr(sacct, "empty", True) or not {"is_alloc", "job", "state"} <= set(sacct):
        return None
    alloc = sacct[sacct["is_alloc"].astype(bool)]
    if alloc.empty:
        return None
    order = alloc["start"].fillna(alloc["submit"]) if {"start", "submit"} <= set(alloc) else None
    last = alloc.loc[order.sort_values(kind="stable", na_position="first").index[-1]] if order is not None \
        else alloc.iloc[-1]
    records = [] if events is None or getattr(events, "empty", True) else events.to_dict("records")
    job = str(last["job"])
    several = int((alloc["job"].astype(str) == job).sum()) > 1  # a -D dump: the row's attempt is Slurm's own
    attempt = int(last["attempt"]) if several and "attempt" in last and last["attempt"] == last["attempt"] else None
    if not unanswered_timeout(str(last["state"]), attempt_events(records, job, attempt)):
        return None
    if any(e.get("event") == EventKind.JOB_START and _later(e.get("job_id"), job) for e in records):
        return None
    cfg_run = (config or {}).get("run") or {}
    return timeout_line(cfg_run.get("time_limit_min", "?"), cfg_run.get("name") or run_name, None)


def _later(job_id: Any, than: str) -> bool:
    """``job_id`` is a later Slurm job than ``than`` (the numeric part of ``123`` or ``123_4``)."""
    def num(x: Any) -> Optional[int]:
        head = str(x).split("_")[0].split(".")[0]
        return int(head) if head.isdigit() else None
    a, b = num(job_id), num(than)
    return a is not None and b is not None and a > b


def previous_attempt(events: Iterable[Mapping[str, Any]], job_id: Optional[str],
                     restart: int) -> Optional[dict]:
    """The attempt before this one (job ``job_id``, restart ``restart``) when it was another Slurm job (a
    ``run.dependency_chain`` continuation, a resubmission) and its own events hold no exit that handled its end:
    ``{"job_id", "restart_count", "last_step", "events"}`` (``last_step``: its newest logged iteration, or None).
    None otherwise: no earlier attempt, the same job requeued (Slurm never requeues a TIMEOUT), a local run, an
    answered end. Whether Slurm ended it TIMEOUT is the caller's question to sacct (:func:`unanswered_timeout`)."""
    records = list(events)
    starts = [e for e in records if e.get("event") == EventKind.JOB_START and (e.get("rank") or 0) == 0
              and not (str(e.get("job_id")) == str(job_id) and (_restart(e) or 0) == restart)]
    if not starts or job_id is None:
        return None
    prev = starts[-1]
    prev_job, prev_restart = prev.get("job_id"), _restart(prev) or 0
    if prev_job is None or str(prev_job) == str(job_id):
        return None
    mine = attempt_events(records, str(prev_job), prev_restart)
    if not unanswered_timeout("TIMEOUT", mine):
        return None
    steps = [e.get("step") for e in mine if e.get("event") == EventKind.ITERATION]
    steps = [int(s) for s in steps if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)]
    return {"job_id": str(prev_job), "restart_count": prev_restart, "last_step": max(steps, default=None),
            "events": mine}


def previous_timeout_line(prev: Mapping[str, Any], resume_step: Optional[int], time_limit_min: Any) -> str:
    """The WARNING a slice prints when the slice before it ended TIMEOUT unanswered."""
    last, resumed = prev.get("last_step"), resume_step or 0
    lost = (f"{max(0, last - resumed)} step(s) lost (it logged step {last}; this slice resumes from step {resumed})"
            if last is not None else f"this slice resumes from step {resumed}")
    return (f"WARNING: the previous slice (job {prev['job_id']}) ran out of time (run.time_limit_min="
            f"{time_limit_min}) before a stop checkpoint and wrote no exit: {lost}; if this repeats, its start-up "
            "outlasts the slice: raise run.time_limit_min (the job check says how far)")
