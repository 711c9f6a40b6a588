"""Attempts, interruptions and goodput: join the training log with Slurm's records.

An *attempt* is one allocation that ran training: ``(job, attempt)`` where ``attempt`` is
Slurm's restart count (``sacct -D`` row order, ``restart_count`` in the event log) or, for
a log alone, the n-th restart seen in the file (the iteration number going back). Every
attempt that ended without finishing the run is an *interruption*; its cause is the most
specific evidence found (each :class:`launch.kinds.Cause`'s priority): the slurmstepd
cancel line, the sacct state, error signatures in any rank's output, a NaN loss in the
last logged step, and the event log's signal/stop/hang/exclude records (:data:`EVENTS_READ`). When the ranks themselves
decided who stopped the attempt (a ``stop`` event with reason ``user_cancel``, ``user_stop``,
``user_requeue``, ``preemption``, ``time_limit`` or ``node_failure``, decided from Slurm's own
answer at the stop, recovery/stop.py), that reason is the cause; the rest stays in ``evidence``.

Goodput = productive training time / allocated time. Productive is the logged step time of
steps that were kept; steps redone after a restart are *lost work*; checkpoint saves come
from the event log; everything else inside the allocations (start-up, loading, teardown,
hangs) is *restart overhead*. Queue wait (submit to start) is outside the allocation and
reported beside it. With GPU counts known the times are GPU-weighted (GPU-hours).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.parse_slurm import SACCT_STATE_CAUSE
from launch.hardware_faults import HARDWARE_FAULTS
from launch.kinds import Cause, EventKind

__all__ = ["ATTEMPT_COLUMNS", "EVENTS_READ", "INTERRUPTION_COLUMNS", "assign_attempts", "build_attempts",
           "interruptions", "goodput", "job_key"]

# The event kinds the attempt table reads: a long run's event log is mostly `iteration` rows, left out at once.
EVENTS_READ = (EventKind.STOP, EventKind.SIGNAL, EventKind.HANG, EventKind.EXIT, EventKind.TRAIN_END,
               EventKind.REQUEUE, EventKind.CHECKPOINT_SAVED, EventKind.RESUME, EventKind.EXCLUDE,
               EventKind.JOB_START, EventKind.IN_JOB_RESTART, EventKind.RESUMED_FROM, EventKind.STARTUP_FAILED)
# recovery/injob.py's cause of a relaunched step: a lost node is what Slurm said of the node (the ranks' broken
# collective is its consequence); a hang or a crash is evidence like the ranks' own
_IN_JOB_CAUSE = {"lost_node": Cause.NODE_FAILURE, "hang": Cause.HANG, "crash": Cause.CRASH}
_DECIDED = tuple(c.value for c in Cause.decided_ones())  # a stop event naming one: the ranks decided the cause
_STOPPED_BY_RANKS = (Cause.CRASH.value, Cause.HANG.value, Cause.NAN.value, Cause.OOM.value,
                     Cause.REPLAY_MISMATCH.value, Cause.BUDGET.value, Cause.ZERO_PROGRESS.value)  # a stop event naming one
_HARDWARE_BY_REASON = {f.reason: f for f in HARDWARE_FAULTS}
_US = "datetime64[us]"  # one resolution: pandas refuses to merge_asof seconds with microseconds
ATTEMPT_COLUMNS = [
    "job", "attempt", "submit", "start", "end", "state", "gpus", "first_step", "last_step",
    "first_step_time", "last_step_time", "resumed_from", "n_iterations", "step_time_s",
    "productive_s", "lost_s", "checkpoint_s", "cause", "evidence", "finished", "ended", "resumed_tier",
]
INTERRUPTION_COLUMNS = [
    "job", "attempt", "time", "slurm_state", "cause", "evidence", "last_step", "resumed_from",
    "steps_lost", "gpu_hours_lost", "queue_wait_s", "restart_latency_s", "resumed_tier",
]


def job_key(job_id, source: str | None = None) -> tuple[str, int | None]:
    """(job, attempt hint): ``local-3`` -> (``local``, 3); None -> the source file name."""
    if job_id is None or (isinstance(job_id, float) and np.isnan(job_id)):
        return (Path(str(source)).name if source else "?"), None
    j = str(job_id)
    if j.startswith("local-") and j[6:].isdigit():
        return "local", int(j[6:])
    return j, None


def _file_segments(df: pd.DataFrame) -> pd.Series:
    """Restart index inside each source file: +1 where the iteration does not increase."""
    if df.empty:
        return pd.Series(dtype="int64")
    order = df.sort_values(["source", "offset", "seq"], kind="stable")
    back = order.groupby("source")["iteration"].diff().le(0).astype("int64")
    return back.groupby(order["source"]).cumsum().reindex(df.index)


def assign_attempts(iters: pd.DataFrame, windows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Add ``job`` and ``attempt`` to iteration rows.

    With attempt start times (``windows``: job, attempt, start) and timestamped rows, a row
    belongs to the last attempt of its job that started before it. Otherwise the attempt is
    the file name's hint (local runs) or the restart index within the file.
    """
    out = iters.copy()
    keys = [job_key(j, s) for j, s in zip(out["job_id"], out["source"])]
    out["job"] = [k[0] for k in keys]
    hint = pd.Series([k[1] for k in keys], index=out.index, dtype="Int64")
    seg = _file_segments(out)
    out["attempt"] = hint.fillna(seg if len(seg) else 0).astype("Int64") if len(out) else pd.Series(dtype="Int64")
    if windows is not None and not windows.empty and out["timestamp"].notna().any():
        w = windows.dropna(subset=["start"]).sort_values("start")
        w = w.assign(start=w["start"].astype(_US))
        timed = out[out["timestamp"].notna() & out["job"].isin(w["job"])]
        timed = timed.assign(timestamp=timed["timestamp"].astype(_US))
        if not timed.empty:
            m = pd.merge_asof(
                timed.reset_index().sort_values("timestamp"),
                w[["job", "attempt", "start"]].rename(columns={"attempt": "_att"}),
                left_on="timestamp", right_on="start", by="job", direction="backward",
            ).set_index("index")
            out.loc[m.index, "attempt"] = m["_att"].fillna(out.loc[m.index, "attempt"]).astype("Int64")
    return out


def _place_by_offset(rows: pd.DataFrame, iters: pd.DataFrame) -> pd.Series:
    """Attempt of error/checkpoint rows: that of the nearest iteration row of the same file
    before it (after it, if none before); the job's last attempt if the file has none."""
    att = pd.Series(pd.NA, index=rows.index, dtype="Int64")
    if rows.empty or iters.empty:
        return att
    for src, grp in rows.groupby("source"):
        it = iters[iters["source"] == src].sort_values("offset")
        if it.empty or (it["offset"] < 0).all():
            continue
        pos = np.searchsorted(it["offset"].to_numpy(), grp["offset"].to_numpy(), side="right") - 1
        pos = np.clip(pos, 0, len(it) - 1)
        att.loc[grp.index] = it["attempt"].to_numpy()[pos]
    return att


def _place_by_marker(rows: pd.DataFrame) -> pd.DataFrame:
    """In a file with attempt banners (the batch log), a row belongs to the banner before it."""
    mk = rows[rows["kind"] == "attempt_start"]
    if mk.empty:
        return rows
    rows = rows.copy()
    for src, grp in rows.groupby("source"):
        m = mk[mk["source"] == src].sort_values("offset")
        if m.empty:
            continue
        pos = np.searchsorted(m["offset"].to_numpy(), grp["offset"].to_numpy(), side="right") - 1
        restart = pd.to_numeric(m["detail"], errors="coerce").to_numpy()
        att = [restart[p] if p >= 0 else np.nan for p in pos]
        rows.loc[grp.index, "attempt"] = pd.array(att, dtype="Float64").astype("Int64")
    return rows


def _place_by_time(rows: pd.DataFrame, win: pd.DataFrame) -> pd.DataFrame:
    """Attempt of timed rows (a stamped error line, Slurm's cancel time) from the windows.

    A glog time has no year: it takes the year of the job's first attempt.
    """
    if win.empty or "at" not in rows or win["start"].isna().all():
        return rows
    rows = rows.copy()
    rows["at"] = pd.to_datetime(rows["at"], errors="coerce")
    if "at_md" in rows and rows["at_md"].notna().any():
        year = win.dropna(subset=["start"]).groupby("job")["start"].min().dt.year
        y = rows["job"].map(year)
        md = rows["at_md"]
        guess = pd.to_datetime(y.astype("Int64").astype(str) + md.fillna(""), format="%Y%m%d %H:%M:%S", errors="coerce")
        rows["at"] = rows["at"].fillna(guess)
    timed = rows[rows["at"].notna() & rows["job"].isin(win["job"])]
    if timed.empty:
        return rows
    w = win.dropna(subset=["start"]).sort_values("start")[["job", "attempt", "start"]].rename(columns={"attempt": "_att"})
    w["start"] = w["start"].astype(_US)
    timed = timed.assign(at=timed["at"].astype(_US))
    m = pd.merge_asof(timed.reset_index().sort_values("at"), w, left_on="at", right_on="start", by="job",
                      direction="backward").set_index("index")
    rows.loc[m.index, "attempt"] = m["_att"].astype("Int64").fillna(rows.loc[m.index, "attempt"])
    return rows


def build_attempts(
    iters: pd.DataFrame,
    sigs: pd.DataFrame | None = None,
    ckpts: pd.DataFrame | None = None,
    events: pd.DataFrame | None = None,
    sacct: pd.DataFrame | None = None,
    *,
    gpus: int | None = None,
    train_iters: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One row per attempt (:data:`ATTEMPT_COLUMNS`) and the iteration rows with
    ``job``/``attempt``/``kept`` added. ``gpus`` is used where sacct does not say.
    """
    sigs = sigs if sigs is not None else pd.DataFrame(columns=["source", "job_id", "offset", "kind", "cause", "at"])
    ckpts = ckpts if ckpts is not None else pd.DataFrame(columns=["source", "job_id", "offset", "kind", "iteration"])
    events = events if events is not None else pd.DataFrame(columns=["time", "ts", "event", "job_id", "restart_count"])

    # --- attempt windows: sacct allocation rows, else the event log ---------------------
    win = pd.DataFrame(columns=["job", "attempt", "submit", "start", "end", "state", "gpus"])
    if sacct is not None and not sacct.empty and "is_alloc" in sacct:
        a = sacct[sacct["is_alloc"]]
        win = pd.DataFrame({
            "job": a["job"].astype(str), "attempt": a["attempt"].astype("Int64"),
            "submit": a.get("submit"), "start": a.get("start"), "end": a.get("end"),
            "state": a.get("state"), "gpus": a.get("gpus"),
        })
    ev = events.copy()
    if not ev.empty:
        keys = [job_key(j) for j in ev["job_id"]]
        ev["job"] = [k[0] if j is not None else "local" for k, j in zip(keys, ev["job_id"])]
        # the attempt's number in the run where the event has one (local launches: launch/attempts.py)
        numbered = pd.to_numeric(ev["attempt"], errors="coerce") if "attempt" in ev else None
        ev["attempt"] = pd.to_numeric(ev["restart_count"], errors="coerce")
        if numbered is not None:
            ev["attempt"] = numbered.fillna(ev["attempt"])
        ev["attempt"] = ev["attempt"].fillna(
            pd.Series([k[1] for k in keys], index=ev.index, dtype="float64")).fillna(0).astype("Int64")
        g = ev.groupby(["job", "attempt"])
        ev_win = pd.DataFrame({"ev_start": g["ts"].min(), "ev_end": g["ts"].max()}).reset_index()
        win = win.merge(ev_win, on=["job", "attempt"], how="outer")
        win["start"] = win["start"].fillna(win["ev_start"]) if "start" in win else win["ev_start"]
        win["end"] = win["end"].fillna(win["ev_end"])
        win = win.drop(columns=["ev_start", "ev_end"])
        win = _in_job_windows(win, ev)
    win["attempt"] = win["attempt"].astype("Int64")
    for c in ("submit", "start", "end"):
        win[c] = pd.to_datetime(win[c], errors="coerce").astype(_US)

    it = assign_attempts(iters, win)
    # --- productive vs redone steps ----------------------------------------------------
    it = it.sort_values(["job", "attempt", "iteration", "seq"], kind="stable")
    span = it.groupby(["job", "attempt"])["iteration"].diff()
    # the first logged line of an attempt covers one log interval: the attempt's usual span
    usual = span.groupby([it["job"], it["attempt"]]).transform("median")
    it["span"] = span.fillna(usual).fillna(1).clip(lower=1)
    it["step_s"] = it["elapsed_ms"].fillna(0) / 1000.0 * it["span"]
    # a step is kept if no later attempt of the job logged it again
    later_min = (
        it.groupby(["job", "attempt"])["iteration"].min().groupby(level="job")
        .transform(lambda s: s[::-1].cummin()[::-1].shift(-1))
    )
    nxt = later_min.rename("next_first").reset_index()
    if it.empty:  # no iteration logged yet (a job that has not trained): the empty groupby loses its keys
        it = it.astype({"job": object, "attempt": "Int64"})
        nxt = pd.DataFrame({"job": pd.Series(dtype=object), "attempt": pd.Series(dtype="Int64"),
                            "next_first": pd.Series(dtype="float64")})
    it = it.merge(nxt, on=["job", "attempt"], how="left")
    it["kept"] = it["next_first"].isna() | (it["iteration"] < it["next_first"])

    sg = sigs.copy()
    if not sg.empty:
        sg["job"] = [job_key(j, s)[0] for j, s in zip(sg["job_id"], sg["source"])]
        sg["attempt"] = _place_by_offset(sg, it)
        sg = _place_by_marker(sg)
        sg = _place_by_time(sg, win)
    ck = ckpts.copy()
    if not ck.empty:
        ck["job"] = [job_key(j, s)[0] for j, s in zip(ck["job_id"], ck["source"])]
        ck["attempt"] = _place_by_offset(ck, it)

    # --- one row per attempt ------------------------------------------------------------
    g = it.groupby(["job", "attempt"])
    per = pd.DataFrame({
        "first_step": g["iteration"].min(), "last_step": g["iteration"].max(),
        "first_step_time": g["timestamp"].min(), "last_step_time": g["timestamp"].max(),
        "n_iterations": g.size(), "step_time_s": g["elapsed_ms"].median() / 1000.0,
        "productive_s": it[it["kept"]].groupby(["job", "attempt"])["step_s"].sum(),
        "lost_s": it[~it["kept"]].groupby(["job", "attempt"])["step_s"].sum(),
        # printed nan/inf in the last logged step (groupby.last() would skip a NaN)
        "last_nonfinite": g["nonfinite"].nth(-1).set_axis(g.size().index).astype(bool),
        "max_train_iters": g["train_iters"].max(),
    }).reset_index()
    att = win.merge(per, on=["job", "attempt"], how="outer") if not win.empty else per
    for c in ("submit", "start", "end", "state", "gpus"):
        if c not in att:
            att[c] = pd.NA
    for c in ("submit", "start", "end", "first_step_time", "last_step_time"):
        att[c] = pd.to_datetime(att[c], errors="coerce").astype(_US)
    if not sg.empty and "at" in sg and sg["at"].notna().any():
        # a bare log: Slurm's cancel time is the best end time there is
        at = sg[sg["at"].notna()].groupby(["job", "attempt"])["at"].max().rename("_at").reset_index()
        at["attempt"] = at["attempt"].astype("Int64")
        att = att.merge(at, on=["job", "attempt"], how="left")
        att["end"] = att["end"].fillna(att.pop("_at"))
    if gpus is not None:
        att["gpus"] = pd.to_numeric(att["gpus"], errors="coerce").fillna(gpus)
    att = att.sort_values(["job", "attempt"], kind="stable").reset_index(drop=True)
    att["productive_s"] = att["productive_s"].fillna(0.0)
    att["lost_s"] = att["lost_s"].fillna(0.0)

    # --- evidence per attempt -------------------------------------------------------------
    evidence: dict[tuple, list[tuple[str, str]]] = {}

    def add(job, attempt, cause, what):
        if cause:
            evidence.setdefault((job, attempt), []).append((cause, what))

    for r in att.itertuples():
        c = SACCT_STATE_CAUSE.get(str(r.state)) if isinstance(r.state, str) else None
        add(r.job, r.attempt, c, f"sacct {r.state}")
        if r.last_nonfinite is True:
            add(r.job, r.attempt, Cause.NAN, "non-finite loss/grad norm in the last logged step")
    for r in sg.itertuples() if not sg.empty else []:
        if isinstance(r.cause, str):
            attempt = r.attempt if not pd.isna(r.attempt) else _last_attempt(att, r.job)
            add(r.job, attempt, r.cause, r.kind)
    decided: dict[tuple, tuple[str, str]] = {}  # the ranks' own stop decision (recovery/stop.py)
    # only these kinds are read below; a long run's event log is mostly `iteration` rows (3x faster for 100k)
    ev = ev[ev["event"].isin(EVENTS_READ)] if not ev.empty else ev
    if not ev.empty:
        first = ev["event"] == EventKind.JOB_START
        started = set(zip(ev.loc[first, "job"], ev.loc[first, "attempt"]))
        rq = ev[(ev["event"] == EventKind.REQUEUE) & (ev["method"] == "scontrol")] if "method" in ev else ev.iloc[0:0]
        own_requeue = set(zip(rq["job"], rq["attempt"]))
        for r in ev.itertuples():
            # an attempt that landed on a recorded failed node and requeued away before training (recovery/exclusion)
            if (r.event == EventKind.EXCLUDE and (r.job, r.attempt) not in started
                    and getattr(r, "ok", None) in (True,) and getattr(r, "bad_here", None)):
                hosts = ",".join(str(h) for h in (r.bad_here if isinstance(r.bad_here, list) else [r.bad_here]))
                decided[(r.job, r.attempt)] = (Cause.NODE_EXCLUSION, f"event exclude: on recorded failed node(s) "
                                                                     f"{hosts}, requeued away before training")
            if r.event == EventKind.IN_JOB_RESTART and getattr(r, "cause", None) == "lost_node":
                decided[(r.job, r.attempt)] = (Cause.NODE_FAILURE, "event in_job_restart lost_node: "
                                                                   + str(getattr(r, "detail", "") or "")[:160])
            if r.event == EventKind.STOP and str(getattr(r, "reason", "")) in _DECIDED:
                why = str(getattr(r, "evidence", "") or "")
                decided[(r.job, r.attempt)] = (str(r.reason), f"event stop {r.reason}" + (f": {why[:200]}" if why else ""))
        for r in ev.itertuples():
            if (r.job, r.attempt) in decided:
                continue
            if r.event == EventKind.SIGNAL:
                sig = str(getattr(r, "signal", "") or "")
                if "USR2" in sig:  # slurmtron's --signal=USR2@lead warning (recovery/signals.py)
                    add(r.job, r.attempt, Cause.TIME_LIMIT,
                        f"event signal {sig} (time-limit warning, or a graceful scancel --signal=USR2)")
                elif sig == "SIGTERM" and _requeued(att, r.job, r.attempt):
                    # SIGTERM is preemption, scancel or `scontrol requeue` (recovery/policy.py); a scancelled job
                    # is not requeued (sacct CANCELLED), a preempted one comes back with its attempt PREEMPTED in
                    # sacct -D, one requeued by a user or an admin with it REQUEUED and no requeue of the ranks'
                    # own (ranks that save in a preemption's grace time and requeue also leave it REQUEUED)
                    if (_sacct_state(att, r.job, r.attempt) == "REQUEUED"
                            and (r.job, r.attempt) not in own_requeue):
                        add(r.job, r.attempt, Cause.USER_REQUEUE, "event signal SIGTERM, then sacct REQUEUED, not "
                                                                  "PREEMPTED (scontrol requeue by a user or an admin)")
                    else:
                        add(r.job, r.attempt, Cause.PREEMPTION, "event signal SIGTERM, then requeued (preemption)")
            elif r.event == EventKind.STOP and str(getattr(r, "reason", "")) in _STOPPED_BY_RANKS:
                why = str(getattr(r, "detail", "") or "") if r.reason == Cause.OOM else ""  # the ranks' OOM line
                add(r.job, r.attempt, Cause(r.reason), f"event stop {r.reason}" + (f": {why[:400]}" if why else ""))
            elif r.event == EventKind.HANG:
                add(r.job, r.attempt, Cause.HANG, "event hang")
            elif r.event == EventKind.STARTUP_FAILED:  # before the first step: an import, the process group join
                add(r.job, r.attempt, Cause.CRASH, f"event startup_failed on {getattr(r, 'host', '?')}: "
                                                   f"{str(getattr(r, 'error', '') or '')[:200]}")
            elif r.event == EventKind.IN_JOB_RESTART and getattr(r, "cause", None) in _IN_JOB_CAUSE:
                add(r.job, r.attempt, _IN_JOB_CAUSE[r.cause], f"event in_job_restart {r.cause}")
            elif r.event == EventKind.EXIT and str(getattr(r, "reason", "")) == "error":
                add(r.job, r.attempt, Cause.CRASH, "event exit error")
            elif r.event == EventKind.EXCLUDE and isinstance(getattr(r, "reason", None), str) \
                    and (fault := _HARDWARE_BY_REASON.get(r.reason)) is not None:
                # a rank's crash named a hardware fault of its node: recorded, and the job requeued without it
                hosts = ",".join(str(h) for h in (r.hosts if isinstance(r.hosts, list) else [r.hosts]))
                add(r.job, r.attempt, fault.cause, f"event exclude: {r.reason} on {hosts}")

    finished_ev = set()
    ckpt_s: dict[tuple, float] = {}
    resume_step: dict[tuple, int] = {}
    resume_tier: dict[tuple, str] = {}  # the resumed_from event: global | local (node-local set) | none
    ended_ev = set()
    if not ev.empty:
        for r in ev.itertuples():
            key = (r.job, r.attempt)
            if r.event == EventKind.TRAIN_END or (r.event == EventKind.EXIT
                                                  and str(getattr(r, "reason", "")) == "completed"):
                finished_ev.add(key)
            if r.event in (EventKind.EXIT, EventKind.STOP, EventKind.REQUEUE):
                ended_ev.add(key)
            if r.event == EventKind.CHECKPOINT_SAVED:
                ckpt_s[key] = ckpt_s.get(key, 0.0) + float(pd.to_numeric(getattr(r, "seconds", 0), errors="coerce") or 0.0)
            if r.event == EventKind.RESUME and not pd.isna(r.step):
                resume_step[key] = int(r.step)
            if r.event == EventKind.RESUMED_FROM and isinstance(getattr(r, "tier", None), str):
                resume_tier[key] = r.tier
    if not ck.empty:
        trained = set(zip(att.loc[att["first_step"].notna(), "job"], att.loc[att["first_step"].notna(), "attempt"]))
        for r in ck[ck["kind"] == "loaded"].itertuples():
            key = (r.job, r.attempt if not pd.isna(r.attempt) else _last_attempt(att, r.job))
            # a log line is placed by its offset among iteration lines: only an attempt that trained places it
            # for sure (an attempt that requeued away before training must not take its successor's resume)
            if pd.notna(r.iteration) and key in trained:
                resume_step.setdefault(key, int(r.iteration))

    causes, evid, finished, ended, resumed, ckpt_col = [], [], [], [], [], []
    for r in att.itertuples():
        key = (r.job, r.attempt)
        items = evidence.get(key, [])
        cause = min((c for c, _ in items), key=lambda c: Cause(c).priority, default=None)
        slurm_said = SACCT_STATE_CAUSE.get(str(r.state)) if isinstance(r.state, str) else None
        if cause in KILL_WINDOW_CAUSES and slurm_said in SLURM_FINAL_CAUSES:
            cause = slurm_said  # a crash in the kill window of a cancel/time limit/preemption is its consequence
        if key in decided:  # who stopped the attempt, as Slurm told the ranks; other evidence stays listed
            cause = decided[key][0]
            items = items + [decided[key]]
        causes.append(None if cause is None else str(Cause(cause).value))
        evid.append("; ".join(sorted({w for _, w in items})))
        target = train_iters or (r.max_train_iters if pd.notna(r.max_train_iters) else None)
        fin = (key in finished_ev or (str(r.state) == "COMPLETED" and key not in decided)  # a drain ends COMPLETED
               or (target is not None and pd.notna(r.last_step) and r.last_step >= target))
        finished.append(bool(fin))
        ended.append(bool(items) or key in ended_ev or (pd.notna(r.end) and str(r.state) not in ("RUNNING", "PENDING", "<NA>", "nan")))
        resumed.append(resume_step.get(key, (int(r.first_step) - 1) if pd.notna(r.first_step) else pd.NA))
        ckpt_col.append(ckpt_s.get(key, 0.0))
    att["cause"] = causes
    att["evidence"] = evid
    att["finished"] = finished
    att["ended"] = ended
    att["resumed_from"] = pd.array(resumed, dtype="Int64")
    att["checkpoint_s"] = ckpt_col
    att["resumed_tier"] = [resume_tier.get((r.job, r.attempt)) for r in att.itertuples()]
    return att[ATTEMPT_COLUMNS], it


# Slurm's own final state of an attempt (sacct: CANCELLED by a user, TIMEOUT, NODE_FAIL, PREEMPTED) outranks
# what the ranks logged while Slurm was killing them: a collective that broke in the kill window records a crash.
SLURM_FINAL_CAUSES = (Cause.USER_CANCEL, Cause.TIME_LIMIT, Cause.NODE_FAILURE, Cause.PREEMPTION)
KILL_WINDOW_CAUSES = (Cause.CRASH, Cause.NCCL_TIMEOUT, Cause.UNKNOWN)


def _in_job_windows(win: pd.DataFrame, ev: pd.DataFrame) -> pd.DataFrame:
    """Steps relaunched inside one allocation (``in_job_restart``, recovery/injob.py) are attempts of their own,
    but sacct has one row for the allocation: a relaunched step ends at its relaunch (the event's time), the next
    step starts there, and the allocation's sacct state and end pass on to its last step (a relaunched step did
    not end COMPLETED because the allocation did)."""
    rel = ev[ev["event"] == EventKind.IN_JOB_RESTART] if "event" in ev else ev.iloc[0:0]
    if rel.empty:
        return win
    win = win.copy()
    for c in ("start", "end"):
        win[c] = pd.to_datetime(win[c], errors="coerce")
    win["state"] = win["state"].astype(object)
    for r in rel.sort_values(["job", "attempt", "ts"]).itertuples():
        nxt = pd.to_numeric(getattr(r, "next_restart_count", None), errors="coerce")
        nxt = int(nxt) if pd.notna(nxt) else int(r.attempt) + 1
        here = (win["job"] == r.job) & (win["attempt"] == r.attempt)
        there = (win["job"] == r.job) & (win["attempt"] == nxt)
        if not here.any():
            continue
        state, end, gpus = (win.loc[here, c].iloc[0] for c in ("state", "end", "gpus"))
        win.loc[here, "end"] = _at_resolution(r.ts, win["end"])
        win.loc[here, "state"] = pd.NA
        if not there.any():
            continue
        if pd.isna(win.loc[there, "state"].iloc[0]) and isinstance(state, str):
            win.loc[there, "state"] = state
            if pd.notna(end):
                win.loc[there, "end"] = end
        win.loc[there, "start"] = _at_resolution(r.ts, win["start"])
        if pd.isna(win.loc[there, "gpus"].iloc[0]):
            win.loc[there, "gpus"] = gpus
    return win


def _at_resolution(ts, column: pd.Series):
    """``ts`` (an event's time: nanoseconds from a float epoch) at the resolution of a datetime ``column`` (sacct's
    microseconds under pandas 3, whatever it is): pandas refuses to store a finer time in a coarser column."""
    if ts is None or pd.isna(ts):
        return pd.NaT
    unit = np.datetime_data(column.dtype)[0] if column.dtype.kind == "M" else "ns"
    return pd.Timestamp(ts).as_unit(unit, round_ok=True)


def _requeued(att: pd.DataFrame, job: str, attempt) -> bool:
    """The attempt was followed by another one of the same job and Slurm did not record a cancel."""
    a = att[att["job"] == job]
    row = a[a["attempt"] == attempt]
    if row.empty or str(row["state"].iloc[0]) == "CANCELLED":
        return False
    return bool((a["attempt"] > attempt).any()) or str(row["state"].iloc[0]) in ("REQUEUED", "PREEMPTED")


def _sacct_state(att: pd.DataFrame, job: str, attempt) -> str:
    """The attempt's sacct -D state ('' without accounting)."""
    row = att[(att["job"] == job) & (att["attempt"] == attempt)]
    v = row["state"].iloc[0] if len(row) else None
    return v.split()[0] if isinstance(v, str) else ""


def _last_attempt(att: pd.DataFrame, job: str):
    a = att.loc[att["job"] == job, "attempt"]
    return a.max() if len(a) else 0


def _resubmission_resume(firsts: pd.DataFrame, job: str, start) -> object:
    """Where the run went on after the last attempt of ``job``: the step the next job (a resubmission, a
    dependency-chain continuation) resumed from, so steps lost are counted across resubmissions too."""
    later = firsts[firsts["job"] != job]
    if pd.notna(start):
        later = later[later["start"] > start]
    else:
        return pd.NA
    return later["resumed_from"].iloc[0] if len(later) else pd.NA


def interruptions(att: pd.DataFrame) -> pd.DataFrame:
    """One row per interrupted attempt (:data:`INTERRUPTION_COLUMNS`).

    An attempt is interrupted if it ended (any evidence, an end time or a later attempt)
    without finishing the run. ``steps_lost`` = last step reached - step the next attempt
    resumed from; ``gpu_hours_lost`` prices them at the logged step times;
    ``restart_latency_s`` = end of this attempt (the requeue) to the next attempt's first
    logged step; ``queue_wait_s`` = the next attempt's submit (requeue) to start.
    """
    rows = []
    firsts = att.sort_values(["start", "attempt"], kind="stable").drop_duplicates("job")  # each job's first attempt
    for job, grp in att.groupby("job", sort=False):
        grp = grp.sort_values("attempt")
        recs = list(grp.itertuples())
        for i, r in enumerate(recs):
            nxt = recs[i + 1] if i + 1 < len(recs) else None
            if r.finished or not (r.ended or nxt is not None):
                continue
            cause = r.cause if isinstance(r.cause, str) else Cause.UNKNOWN.value
            when = r.end if pd.notna(r.end) else r.last_step_time
            resumed = nxt.resumed_from if nxt is not None else _resubmission_resume(firsts, job, r.start)
            lost = (int(r.last_step) - int(resumed)) if pd.notna(r.last_step) and pd.notna(resumed) else pd.NA
            lost = max(lost, 0) if lost is not pd.NA else pd.NA
            gpus = r.gpus if pd.notna(r.gpus) else np.nan
            gh = (lost * r.step_time_s * gpus / 3600.0) if lost is not pd.NA and pd.notna(r.step_time_s) else np.nan
            qw = ((nxt.start - nxt.submit).total_seconds()
                  if nxt is not None and pd.notna(nxt.start) and pd.notna(nxt.submit) else np.nan)
            lat = ((nxt.first_step_time - r.end).total_seconds()
                   if nxt is not None and pd.notna(nxt.first_step_time) and pd.notna(r.end) else np.nan)
            tier = nxt.resumed_tier if nxt is not None else None
            rows.append((job, r.attempt, when, r.state if isinstance(r.state, str) else None, cause, r.evidence,
                         r.last_step, resumed, lost, gh, qw, lat, tier))
    df = pd.DataFrame(rows, columns=INTERRUPTION_COLUMNS)
    for c in ("last_step", "resumed_from", "steps_lost"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    return df


def goodput(att: pd.DataFrame) -> dict:
    """Goodput and its breakdown over all attempts.

    ``allocated_s`` sums (end - start) of attempts that have both (GPU-weighted as
    ``allocated_gpu_h`` when GPU counts are known). Without sacct an attempt spans its
    first to last event-log record, which leaves out the start-up before the worker's
    ``job_start``: goodput is then an upper bound. ``restart_overhead_s`` is what is left
    of the allocation after productive, lost and checkpoint time. ``goodput`` is None when
    no allocation window is known (a bare log file): then only step times are reported.
    """
    timed = att[att["start"].notna() & att["end"].notna()]
    wall = (timed["end"] - timed["start"]).dt.total_seconds().clip(lower=0)
    allocated = float(wall.sum())
    prod = float(timed["productive_s"].sum())
    lost = float(timed["lost_s"].sum())
    ckpt = float(timed["checkpoint_s"].sum())
    overhead = max(allocated - prod - lost - ckpt, 0.0)
    qw = (att["start"] - att["submit"]).dt.total_seconds().clip(lower=0)
    gpus = pd.to_numeric(timed["gpus"], errors="coerce")
    out = {
        "allocated_s": allocated,
        "productive_s": prod,
        "lost_work_s": lost,
        "checkpoint_s": ckpt,
        "restart_overhead_s": overhead,
        "queue_wait_s": float(qw.sum()) if qw.notna().any() else None,
        "goodput": (prod / allocated) if allocated > 0 else None,
        "productive_s_all_attempts": float(att["productive_s"].sum()),
        "lost_work_s_all_attempts": float(att["lost_s"].sum()),
    }
    if gpus.notna().all() and len(gpus):
        out["allocated_gpu_h"] = float((wall * gpus).sum() / 3600.0)
        out["productive_gpu_h"] = float((timed["productive_s"] * gpus).sum() / 3600.0)
    return out
