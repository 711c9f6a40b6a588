"""The budget ceiling on the ranks: the run stops itself once its spend reaches ``run.budget_gpu_hours``.

Rank 0 builds the ledger once, as the attempt starts (:func:`baseline`): Slurm's accounting of every allocation
of the run (``sacct -X -D`` through :mod:`recovery.slurm`) where there is one, else the event log
(:mod:`analysis.spend`); from then on the spend grows by ``world_size x`` the wall time of this attempt. At each
step boundary rank 0 puts the spend (and the spend projected to the target) into the all-reduce that already
agrees on a stop (:func:`train.train_loop.agree_stop`), so every rank sees the same numbers and takes the same
decision: WARNING lines (printed by the last rank) and ``budget_warning`` events (rank 0) at 50/80/95% and when
the projection passes the budget; at 100% the ranks save a verified checkpoint and stop with reason ``budget``
(final: its own exit code, never requeued or relaunched). Raising the budget and resubmitting continues the run.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from analysis import spend
from launch.kinds import EventKind
from recovery.events import read_events
from recovery.slurm import Slurm, default_runner
from train.context import RankContext

SCALE = 1e9  # hours travel through the int64 all-reduce as nano-hours


def baseline(job: Any, paths: Any, env: Any, *, runner: Optional[Callable[..., Any]] = None,
             now: float) -> tuple[float, str]:
    """(hours spent by the run up to ``now``, source): sacct when under Slurm and it answers, else the events."""
    world = job.world_size
    job_id = env.get("SLURM_JOB_ID")
    if job_id:
        ids = [str(s["job_id"]) for s in read_events(paths.submissions) if s.get("job_id")]
        ids = list(dict.fromkeys(ids + [str(job_id)]))
        r = Slurm(runner or default_runner).sacct(ids, "-X", "-D", "-n", "-P", f"--format={spend.SACCT_FORMAT}")
        spans = spend.sacct_spans(r.out, world_size=world, warn=spend.warning) if r.ok else []
        if spans:
            return spend.hours(spans), "sacct"
    return spend.hours(spend.event_spans(read_events(paths.events), now=now, world_size=world)), "events"


class BudgetGuard:
    """Every rank holds one (the same state everywhere: the numbers come from rank 0 through the all-reduce)."""

    def __init__(self, job: Any, *, base_hours: float, source: str, announced: set, iters: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.budget = job.run.budget_gpu_hours
        self.world = job.world_size
        self.unit = "process-hours" if job.cluster.gpu == "cpu" else "GPU-hours"
        self.base, self.source, self.iters, self.clock = base_hours, source, iters, clock
        self.t0 = clock()
        self.done = set(announced)
        self.step_times: list = []

    @property
    def active(self) -> bool:
        return bool(self.budget) and self.budget > 0

    def local(self, step: int) -> tuple[int, int]:
        """Rank 0's contribution to the all-reduce: (spent, projected) in nano-hours (0: none)."""
        spent = self.base + (self.clock() - self.t0) * self.world / 3600.0
        times = sorted(self.step_times[-20:])
        proj = spend.project(spent, self.iters - step, times[len(times) // 2] if times else None, self.world)
        return int(spent * SCALE), int((proj or 0.0) * SCALE)

    def ledger(self, spent_n: int, projected_n: int) -> spend.Ledger:
        return spend.Ledger(spent_n / SCALE, self.source, self.budget, projected_n / SCALE if projected_n else None,
                            self.unit)

    def review(self, ctx: RankContext, step: int, spent_n: int, projected_n: int) -> Optional[spend.Ledger]:
        """Warn for each threshold newly passed; return the ledger when the budget is spent (stop), else None."""
        if not self.active or spent_n <= 0:
            return None
        led = self.ledger(spent_n, projected_n)
        for thr in spend.crossed(led.fraction or 0.0, self.done):
            self.done.add(thr)
            ctx.log(spend.warning_text(thr, led))
            ctx.emit(EventKind.BUDGET_WARNING, threshold=thr, step=step, spent=led.spent, budget=self.budget,
                     projected=led.projected, source=self.source, unit=self.unit)
        if (led.projected is not None and led.projected > self.budget and not led.over
                and spend.PROJECTED not in self.done):
            self.done.add(spend.PROJECTED)
            ctx.log(spend.projected_text(led))
            ctx.emit(EventKind.BUDGET_WARNING, threshold=spend.PROJECTED, step=step, spent=led.spent, budget=self.budget,
                     projected=led.projected, source=self.source, unit=self.unit)
        return led if led.over else None


def build(ctx: RankContext, iters: int, *, runner: Optional[Callable[..., Any]] = None,
          clock: Callable[[], float] = time.time) -> Optional[BudgetGuard]:
    """The guard of this attempt (every rank; rank 0 reads the ledger), or None without a budget."""
    job = ctx.job
    b = job.run.budget_gpu_hours
    if not b or b <= 0:
        return None

    base, source = 0.0, "events"
    now = clock()
    if ctx.is_first:
        try:
            base, source = baseline(job, ctx.paths, ctx.env, runner=runner, now=now)
        except Exception as exc:  # the ledger is a guard; a failure to read it is said, not a crash
            print(f"WARNING: budget: the run's spend cannot be read ({type(exc).__name__}: {exc}); counting this "
                  "attempt only", flush=True)
            ctx.emit(EventKind.BUDGET_UNAVAILABLE, detail=f"{type(exc).__name__}: {exc}"[:500])
    announced = spend.announced(read_events(ctx.paths.events), b)
    return BudgetGuard(job, base_hours=base, source=source, announced=announced, iters=iters, clock=clock)
