"""Rank 0 of a new slice: did the slice before it end TIMEOUT without a word?

A slice whose start-up outlasted its time limit minus the signal lead is killed TIMEOUT before any stop or exit
event, and ``--requeue`` does not requeue a TIMEOUT. With ``run.dependency_chain`` the next pre-submitted slice
starts anyway (``afterany``); it says what happened: a ``WARNING`` line and a ``previous_slice_timeout`` event with
the steps lost (the previous slice's last logged step minus the step this one resumes from), then trains on. The
rule is :mod:`analysis.slice_end`'s (the report and ``status.py`` use it too); Slurm's word on the previous job comes
through :mod:`recovery.slurm` (``sacct``), asked only when the event log shows an unanswered end. Nothing here stops
or delays the slice beyond that one ``sacct`` call; an unreachable sacct says nothing (the event log alone cannot
tell a TIMEOUT from a kill).
"""
from __future__ import annotations

from typing import Optional

from analysis.slice_end import previous_attempt, previous_timeout_line, unanswered_timeout
from launch.kinds import EventKind
from recovery.events import read_events
from recovery.slurm import Runner, Slurm, default_runner
from train.context import RankContext


def note_previous_slice(ctx: RankContext, resume_step: Optional[int], runner: Runner = default_runner) -> Optional[dict]:
    """On rank 0 of a Slurm attempt: the ``previous_slice_timeout`` event it wrote, or None."""
    if not (ctx.is_first and ctx.job_id):
        return None
    prev = previous_attempt(read_events(ctx.paths.events), ctx.job_id, ctx.restart)
    if prev is None:
        return None
    reply = Slurm(runner).accounting_state(prev["job_id"])
    state = (reply.out.strip().splitlines() or [""])[-1] if reply.ok else ""
    if not unanswered_timeout(state, prev["events"]):
        return None
    print(previous_timeout_line(prev, resume_step, ctx.job.run.time_limit_min), flush=True)
    last, resumed = prev["last_step"], resume_step or 0
    return ctx.emit(EventKind.PREVIOUS_SLICE_TIMEOUT, job_id_previous=prev["job_id"],
                    restart_previous=prev["restart_count"], slurm_state=state, last_step=last, resume_step=resumed,
                    steps_lost=None if last is None else max(0, last - resumed))
