"""The spend of a run on the login node: what ``status`` shows and what a (re)submission is checked against.

The arithmetic lives in :mod:`analysis.spend` (shared with the report and the ranks); this module finds the
numbers: Slurm's accounting of the run's jobs (``submissions.jsonl``; ``sacct -X -D`` through
:mod:`recovery.slurm`) where it answers, else the run's own events. A run whose spend already reached
``run.budget_gpu_hours`` is refused at submit (it would stop at its first step boundary): one problem with the
arithmetic and the fix (raise the budget). Login-node code: no torch.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from analysis import spend
from launch.config import Job
from launch.problems import Problem
from recovery.events import read_events
from recovery.slurm import Runner, Slurm, default_runner


def unit(job: Job) -> str:
    return "process-hours" if job.cluster.gpu == "cpu" else "GPU-hours"


def spent(job: Job, run_dir: Path, *, runner: Runner = default_runner, now: Optional[float] = None,
          running: bool = False) -> tuple[float, str]:
    """(hours the run in ``run_dir`` has spent, source: sacct | events); 0 for a run that never started.
    ``running``: the last attempt is still going (its event span runs to ``now``)."""
    paths = job.paths_at(run_dir)
    ids = [str(s["job_id"]) for s in read_events(paths.submissions) if s.get("job_id")]
    if ids and job.cluster.launcher == "slurm":
        r = Slurm(runner).sacct(list(dict.fromkeys(ids)), "-X", "-D", "-n", "-P", f"--format={spend.SACCT_FORMAT}")
        spans = spend.sacct_spans(r.out, world_size=job.world_size) if r.ok else []
        if spans:
            return spend.hours(spans), "sacct"
    at = (now if now is not None else time.time()) if running else None
    return spend.hours(spend.event_spans(read_events(paths.events), now=at, world_size=job.world_size)), "events"


def budget_problems(job: Job, run_dir: Path, *, runner: Runner = default_runner) -> list[Problem]:
    """A run (re)submitted with ``run.budget_gpu_hours`` at or below what it has already spent."""
    budget = job.run.budget_gpu_hours
    if not budget or budget <= 0 or not job.paths_at(run_dir).events.exists():
        return []
    hours, source = spent(job, run_dir, runner=runner)
    if hours < budget:
        return []
    u = unit(job)
    more = spend.fmt(hours * 1.5 if hours > 0 else budget * 2)
    return [Problem("run.budget_gpu_hours", "the run has already spent its budget",
                    f"spent {spend.fmt(hours)} {u} ({'Slurm accounting' if source == 'sacct' else 'event log'}) >= "
                    f"budget {spend.fmt(budget)} {u}",
                    f"raise it to continue the run: run.budget_gpu_hours={more} (or more)")]


def ledger(job: Job, run_dir: Path, *, hours: float, source: str, step: Optional[int],
           step_time_s: Optional[float], target: Optional[int]) -> spend.Ledger:
    """The run's ledger for ``status`` and the report: spent, budget, and projected at the measured step time."""
    proj = None
    if target and step is not None:
        proj = spend.project(hours, target - step, step_time_s, job.world_size)
    return spend.Ledger(hours, source, job.run.budget_gpu_hours, proj, unit(job))
