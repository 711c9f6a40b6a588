"""How each interruption was recovered, and where the time to resume went.

For every interrupted attempt the report says whether the run was **recovered in job** (an ``in_job_restart``
event: recovery/injob.py relaunched the step on healthy nodes of the same allocation) or **requeued** (the next
attempt of the job came through Slurm's queue), and splits the time from the failed attempt's last progress to the
next attempt's first step into phases, in order:

========================  ===============================================================================
phase                     from -> to
========================  ===============================================================================
``detection_s``           the failed attempt's last progress (iteration, checkpoint, start) -> the failure's
                          first record (its ``signal``, ``stop`` or ``hang`` event); unknown for a step
                          killed without a word
``teardown_s``            the failure's record -> the end of the failed step (in job: the relaunch decision
                          begins; requeued: the allocation's end in sacct)
``queue_wait_s``          in job: 0; requeued: the next allocation's submit (the requeue) -> its start, as
                          :func:`analysis.interruptions.interruptions` has it from sacct; without
                          accounting, the attempt's end -> the next attempt's start
``health_check_s``        in job: the bounded ``srun`` health check of the candidate nodes; requeued: 0
``startup_s``             the relaunch (the ``in_job_restart`` record, or the next allocation's start) -> the
                          checkpoint load begins (launch, imports, process group, model and optimizer built)
``checkpoint_load_s``     the ``resume`` event's load time (0 when the attempt started from scratch)
``first_step_s``          the checkpoint loaded -> the next attempt's first ``iteration`` record
``time_to_resume_s``      the last progress -> the next attempt's first ``iteration`` record (the sum)
========================  ===============================================================================

In job, detection, teardown and the health check are what recovery/injob.py measured and wrote into its event
(``phases``); the rest, and everything of a requeue, comes from the events of the two attempts and the attempt
windows of :func:`analysis.interruptions.build_attempts` (sacct's when there is accounting). Pure functions of
DataFrames: no torch, no I/O.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from analysis.interruptions import job_key
from launch.kinds import EventKind

IN_JOB, REQUEUED = "recovered in job", "requeued"
PHASES = ["detection_s", "teardown_s", "queue_wait_s", "health_check_s", "startup_s", "checkpoint_load_s",
          "first_step_s"]
COLUMNS = ["recovery"] + PHASES + ["time_to_resume_s"]
_PROGRESS = (EventKind.ITERATION, EventKind.CHECKPOINT_SAVED, EventKind.JOB_START)
_FAILURE = (EventKind.STOP, EventKind.HANG, EventKind.SIGNAL)


def _keyed(events: Optional[pd.DataFrame]) -> pd.DataFrame:
    """The event rows with the report's (job, attempt) keys (the attempt is the event's restart count)."""
    if events is None or events.empty:
        return pd.DataFrame(columns=["job", "attempt", "event", "time"])
    ev = events.copy()
    keys = [job_key(j) for j in ev["job_id"]]
    ev["job"] = [k[0] if j is not None else "local" for k, j in zip(keys, ev["job_id"])]
    hint = pd.Series([k[1] for k in keys], index=ev.index, dtype="float64")
    ev["attempt"] = pd.to_numeric(ev["restart_count"], errors="coerce").fillna(hint).fillna(0).astype("int64")
    return ev


def _t(rows: pd.DataFrame, how: str) -> Optional[float]:
    t = pd.to_numeric(rows["time"], errors="coerce").dropna() if len(rows) else pd.Series(dtype="float64")
    if t.empty:
        return None
    return float(t.min() if how == "first" else t.max())


def _epoch(ts) -> Optional[float]:
    """A window time of the attempt table (naive local time, as the event log's ``ts``) in unix seconds."""
    if ts is None or pd.isna(ts):
        return None
    return float(pd.Timestamp(ts).tz_localize(_local_tz()).timestamp())


def _local_tz():
    from datetime import datetime

    return datetime.now().astimezone().tzinfo


def _phase(x: Optional[float]) -> float:
    return np.nan if x is None or pd.isna(x) else round(max(0.0, float(x)), 3)


def _number(x) -> Optional[float]:
    return None if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or pd.isna(x) else float(x)


def phases_of(ev: pd.DataFrame, att: pd.DataFrame, job: str, attempt: int) -> dict:
    """:data:`COLUMNS` of one interrupted attempt (``ev`` keyed by :func:`_keyed`; ``att`` the attempt table)."""
    out: dict = {c: np.nan for c in PHASES + ["time_to_resume_s"]}
    out["recovery"] = ""
    mine = ev[(ev["job"] == job) & (ev["attempt"] == attempt)]
    relaunch = mine[mine["event"] == EventKind.IN_JOB_RESTART]
    later = att[(att["job"] == job) & (att["attempt"] > attempt)].sort_values("attempt")
    if not relaunch.empty:
        r = relaunch.iloc[-1]
        nxt = _number(r.get("next_restart_count"))
        nxt = int(nxt) if nxt is not None else attempt + 1
        out["recovery"] = IN_JOB
    elif not later.empty:
        nxt = int(later["attempt"].iloc[0])
        out["recovery"] = REQUEUED
    else:
        return out  # not resumed (a final stop, or the run ends here)
    failed_at = _t(mine[mine["event"].isin(_FAILURE)], "first")
    progress = mine[mine["event"].isin(_PROGRESS)]
    if failed_at is not None:  # a stop checkpoint after the signal is no progress before the failure
        progress = progress[pd.to_numeric(progress["time"], errors="coerce") <= failed_at]
    last_progress = _t(progress, "last")
    if out["recovery"] == IN_JOB:
        measured = r.get("phases") if isinstance(r.get("phases"), dict) else {}
        out["detection_s"] = _phase(_number(measured.get("detection_s")))
        out["teardown_s"] = _phase(_number(measured.get("teardown_s")))
        out["queue_wait_s"] = 0.0
        out["health_check_s"] = _phase(_number(measured.get("health_check_s")))
        relaunched_at = _number(r.get("time"))
    else:
        this = att[(att["job"] == job) & (att["attempt"] == attempt)]
        nrow = att[(att["job"] == job) & (att["attempt"] == nxt)]
        end = _epoch(this["end"].iloc[0]) if len(this) else None
        relaunched_at = _epoch(nrow["start"].iloc[0]) if len(nrow) else None
        if failed_at is not None and last_progress is not None:
            out["detection_s"] = _phase(failed_at - last_progress)
        if end is not None:
            out["teardown_s"] = _phase(end - (failed_at if failed_at is not None else (last_progress or end)))
            if relaunched_at is not None:
                out["queue_wait_s"] = _phase(relaunched_at - end)
        out["health_check_s"] = 0.0
    then = ev[(ev["job"] == job) & (ev["attempt"] == nxt)]
    resume = then[then["event"] == EventKind.RESUME]
    started = _t(then[then["event"] == EventKind.JOB_START], "first")
    first_step = _t(then[then["event"] == EventKind.ITERATION], "first")
    if not resume.empty:
        loaded_at = _number(resume["time"].iloc[0])
        load_s = _number(resume["seconds"].iloc[0]) if "seconds" in resume else None
        load_s = load_s or 0.0
    else:  # started from scratch: nothing to load
        loaded_at, load_s = started, 0.0
    out["checkpoint_load_s"] = _phase(load_s)
    if relaunched_at is not None and loaded_at is not None:
        out["startup_s"] = _phase(loaded_at - load_s - relaunched_at)
    if first_step is not None and loaded_at is not None:
        out["first_step_s"] = _phase(first_step - loaded_at)
    if first_step is not None and last_progress is not None:
        out["time_to_resume_s"] = _phase(first_step - last_progress)
    return out


def add_recovery(intr: pd.DataFrame, att: pd.DataFrame, events: Optional[pd.DataFrame]) -> pd.DataFrame:
    """The interruption table with :data:`COLUMNS` added (how each was recovered and its phases); its
    ``queue_wait_s`` (the next allocation's submit to start) stays where known and is 0 for a relaunch in the job."""
    ev = _keyed(events)
    rows = [phases_of(ev, att, str(r.job), int(r.attempt)) if pd.notna(r.attempt) else
            {c: (np.nan if c != "recovery" else "") for c in COLUMNS} for r in intr.itertuples()]
    extra = pd.DataFrame(rows, columns=COLUMNS, index=intr.index)
    out = intr.copy()
    if "queue_wait_s" in out:
        known = pd.to_numeric(out["queue_wait_s"], errors="coerce")
        mine = pd.to_numeric(extra["queue_wait_s"], errors="coerce")
        extra["queue_wait_s"] = known.where(known.notna() & (extra["recovery"] != IN_JOB), mine)
        out = out.drop(columns=["queue_wait_s"])
    return pd.concat([out, extra], axis=1)


def summary(intr: pd.DataFrame) -> dict:
    """Median phases per recovery path (``recovered in job`` / ``requeued``): the report's line and the bench's."""
    out: dict = {}
    if intr.empty or "recovery" not in intr:
        return out
    for path, grp in intr[intr["recovery"].isin([IN_JOB, REQUEUED])].groupby("recovery"):
        med = grp[PHASES + ["time_to_resume_s"]].apply(pd.to_numeric, errors="coerce").median()
        out[str(path)] = {"count": int(len(grp)), **{k: (None if pd.isna(v) else round(float(v), 1))
                                                      for k, v in med.items()}}
    return out


def summary_line(s: dict) -> str:
    """``recovered in job 2 (median 31.2 s to resume: detection 0.1, ...); requeued 1 (...)``."""
    parts = []
    for path in (IN_JOB, REQUEUED):
        if path in s:
            d = s[path]
            ph = ", ".join(f"{k[:-2].replace('_', ' ')} {d[k]:.1f}" for k in PHASES if d.get(k) is not None)
            total = f"median {d['time_to_resume_s']:.1f} s to resume" if d.get("time_to_resume_s") is not None \
                else "time to resume unknown"
            parts.append(f"{path} {d['count']} ({total}" + (f": {ph} s" if ph else "") + ")")
    return "; ".join(parts) or "none resumed"
