"""The spend of a run on the login node: what ``status`` shows and what a (re)submission is checked against.

The arithmetic lives in :mod:`analysis.spend` (shared with the report and the ranks); this module finds the
numbers: Slurm's accounting of the run's jobs (``submissions.jsonl``; ``sacct -X -D`` through
:mod:`recovery.slurm`) where it answers, else the run's own events. A run whose spend already reached
``run.budget_gpu_hours`` is refused at submit (it would stop at its first step boundary): one problem with the
arithmetic and the fix (raise the budget). Login-node code: no torch.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Optional

import yaml

from analysis import spend
from launch.config import Job
from launch.paths import RunPaths
from launch.planner import estimate
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
        spans = spend.sacct_spans(r.out, world_size=job.world_size, warn=spend.warning) if r.ok else []
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


# ---- per-team quotas ----------------------------------------------------------------------------------------------

PERIODS = ("day", "week", "month", "year", "all")


@dataclass(frozen=True)
class Quota:
    """One account's allowance: ``hours`` per ``period`` (from the site's quota file)."""

    account: str
    hours: float
    period: str
    path: str


def period_start(period: str, now: float) -> Optional[float]:
    """Unix time the current ``period`` began (local calendar); None for ``all``."""
    t = datetime.fromtimestamp(now)
    if period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    elif period == "week":
        start = (t - timedelta(days=t.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)
    elif period == "month":
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    elif period == "year":
        start = t.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
    else:
        return None
    return start.timestamp()


QUOTA_FILE_MAX_BYTES = 1 << 20  # one MiB: tens of thousands of accounts


def read_quota(path: str, account: str) -> tuple[Optional[Quota], Optional[Problem]]:
    """The quota of ``account`` in the quota file (YAML or JSON: ``period: month`` and ``quotas: {account: hours}``),
    or the one problem with the file or the account (never a traceback)."""
    fix_file = "fix the file, or set cluster.quota_file='' (no quotas)"
    try:
        with open(path, "rb") as f:  # a quota file is a few lines: /dev/zero or a huge file is refused, not read
            raw = f.read(QUOTA_FILE_MAX_BYTES + 1)
        if len(raw) > QUOTA_FILE_MAX_BYTES:
            return None, Problem("cluster.quota_file", "the quota file is too large to be a quota file",
                                 f"{path}: more than {QUOTA_FILE_MAX_BYTES} bytes; read no further", fix_file)
        doc = yaml.safe_load(raw.decode("utf-8"))
    except FileNotFoundError:
        return None, Problem("cluster.quota_file", "the quota file does not exist", f"quota_file = {path}", fix_file)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        why = str(getattr(exc, "strerror", None) or exc).splitlines()[0][:160]
        return None, Problem("cluster.quota_file", "the quota file cannot be read", f"{path}: {why}", fix_file)
    quotas = doc.get("quotas") if isinstance(doc, dict) else None
    period = str(doc.get("period", "month")) if isinstance(doc, dict) else ""
    if not isinstance(quotas, dict) or period not in PERIODS:
        return None, Problem("cluster.quota_file", "not a quota file",
                             f"{path}: needs 'period: {' | '.join(PERIODS)}' and 'quotas: {{account: GPU-hours}}'",
                             fix_file)
    if account not in quotas:
        known = ", ".join(sorted(str(k) for k in quotas)[:10])
        return None, Problem("cluster.account", "the account has no quota in the site's quota file",
                             f"account {account!r} not in {path} (accounts: {known})",
                             "set cluster.account to your team's account")
    hours = quotas[account]
    if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not math.isfinite(hours) or hours < 0:
        return None, Problem("cluster.quota_file", "a quota must be GPU-hours >= 0",
                             f"{path}: quotas.{account} = {hours!r}", fix_file)
    return Quota(account, float(hours), period, path), None


def team_spend(run_root: Path, account: str, since: Optional[float], *,
               exclude: Optional[Path] = None) -> tuple[float, int]:
    """(hours, runs): the spend since ``since`` of the runs under ``run_root`` whose ``config.yaml`` names
    ``account``, from their event logs (each attempt clipped to the period); ``exclude`` is the run being submitted."""
    total, runs = 0.0, 0
    try:
        dirs = sorted(p for p in Path(run_root).iterdir() if RunPaths.of(p).config.is_file())
    except OSError:
        return 0.0, 0
    for d in dirs:
        if exclude is not None and d.resolve() == Path(exclude).resolve():
            continue
        try:
            cfg = yaml.safe_load(RunPaths.of(d).config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        cluster = cfg.get("cluster") if isinstance(cfg, dict) else None
        if not isinstance(cluster, dict) or str(cluster.get("account") or "") != account:
            continue
        world = int(cluster.get("nodes") or 1) * int(cluster.get("gpus_per_node") or 1)
        events = read_events(RunPaths.of(d).events)
        h = spend.hours(spend.clip(events, since, world_size=world) if since is not None
                        else spend.event_spans(events, world_size=world))
        if h > 0:
            total, runs = total + h, runs + 1
    return total, runs


def quota_problems(job: Job, run_dir: Path, *, now: Optional[float] = None) -> list[Problem]:
    """Refuse a job whose estimate exceeds what is left of its account's quota this period (the site's quota file,
    ``cluster.quota_file``): one problem with the arithmetic."""
    path = job.cluster.quota_file
    if not path:
        return []
    quota, problem = read_quota(path, job.cluster.account)
    if problem is not None:
        return [problem]
    now = time.time() if now is None else now
    since = period_start(quota.period, now)
    used, runs = team_spend(Path(job.cluster.run_root), quota.account, since, exclude=run_dir)
    mine, _ = spent(job, run_dir) if job.paths_at(run_dir).events.exists() else (0.0, "events")
    est = _estimate_hours(job)
    u = unit(job)
    left = quota.hours - used
    when = "" if since is None else f" since {datetime.fromtimestamp(since):%Y-%m-%d}"
    if est is None:
        need, what = 0.0, "no estimate (the planner has no step time for this cluster)"
    else:
        need, what = max(0.0, est - mine), f"this job's estimate {spend.fmt(est)}" + (
            f" - its spend so far {spend.fmt(mine)}" if mine else "")
    if need <= left and left > 0:
        return []
    arithmetic = (f"account {quota.account}: quota {spend.fmt(quota.hours)} {u} per {quota.period} - spent "
                  f"{spend.fmt(used)} by {runs} run(s) under {job.cluster.run_root}{when} = {spend.fmt(left)} left "
                  f"{'<' if need > left else '<='} {what}" + (f" = {spend.fmt(need)}" if mine and est is not None else ""))
    iters = job.iterations or 0
    buys = int(iters * max(0.0, left) / est) if est else 0
    nxt = "" if since is None else f", or wait for the next {quota.period}"
    return [Problem("cluster.quota_file", f"the job would exceed what is left of account {quota.account}'s quota",
                    arithmetic, (f"set training.train_iters={buys:,} (what is left buys)" if buys > 0 else
                                 "ask for more quota") + nxt)]


def _estimate_hours(job: Job) -> Optional[float]:
    try:
        return estimate(job).gpu_hours_total
    except Exception:  # an estimate that cannot be made: the quota check says so in its arithmetic
        return None


# ---- a sweep's budget ---------------------------------------------------------------------------------------------

def sweep_budget_problems(job: Job, accepted_hours: list[float]) -> list[Problem]:
    """A sweep member whose estimate would take the sweep past ``run.sweep_budget_gpu_hours`` (``accepted_hours``:
    the estimates of the members accepted before it, in order)."""
    budget = job.run.sweep_budget_gpu_hours
    if not budget or budget <= 0:
        return []
    est = _estimate_hours(job)
    committed = sum(accepted_hours)
    u = unit(job)
    if est is None:
        return [Problem("run.sweep_budget_gpu_hours", "this member has no estimate to count against the sweep's budget",
                        f"the planner has no step time for cluster.gpu {job.cluster.gpu}",
                        "set run.sweep_budget_gpu_hours=null for this cluster")]
    if committed + est <= budget:
        return []
    return [Problem("run.sweep_budget_gpu_hours", "this member would exceed the sweep's remaining budget",
                    f"{len(accepted_hours)} member(s) accepted {spend.fmt(committed)} + this member "
                    f"{spend.fmt(est)} = {spend.fmt(committed + est)} {u} > sweep budget {spend.fmt(budget)} "
                    f"({spend.fmt(max(0.0, budget - committed))} left)",
                    "raise run.sweep_budget_gpu_hours, sweep fewer members, or lower training.train_iters")]
