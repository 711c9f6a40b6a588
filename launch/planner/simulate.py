"""Goodput at scale by simulation: what failures, saves and restarts cost a long run.

Why simulate: no test here reaches thousands of GPUs, yet the checkpoint interval of a
multi-week run decides how much of it is wasted. First-order formulas (Young 1974, Daly 2006;
``recovery/interval.py``) give the optimum interval; the simulation checks them and gives the
spread (a run is one draw, not the mean).

Model (one trial): the run needs ``work_h`` hours of training compute. It computes for
``interval_h``, then stalls ``save_h`` to write a checkpoint, and so on. Failures of the whole
job arrive as a Poisson process with mean time between failures ``node_mtbf_h / nodes`` (any
node failing stops a synchronous job), during compute and saves alike. A failure loses the
work since the last *completed* save and costs ``restart_h`` (detect, requeue, reload, warm up);
failures during a restart are not modelled (restarts are short against the MTBF). Effective
training time = ``work_h / wall_h``, as Llama 3's "effective training time"; lost GPU-hours =
``(wall_h - work_h) * gpus`` (saves, redone work and restarts).

Run ``python -m launch.planner.simulate <overrides as pretrain.py> [--trials N] [--seed S]
[--restart-min R]``; ``--case llama3`` uses the published Llama 3 405B numbers instead; ``--recovery`` compares
the requeue path with in-job restart, ``--tiers`` the global tier alone with node-local sets beside it
(:class:`Tiers`).

numpy only (no torch): vectorised over trials, one loop iteration per failure.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from launch.compose import compose_job
from launch.config import Job
from launch.planner.estimate import Estimate, estimate
from launch.planner.layouts import choose_layout
from launch.planner.tiers import local_save_time_s, local_share
from recovery.interval import daly_interval_s, two_tier_steps, young_interval_s


@dataclass(frozen=True)
class Scenario:
    """A long run's failure and checkpoint costs (hours)."""

    work_h: float  # training compute the run needs, at the estimated step time
    nodes: int
    gpus_per_node: int
    node_mtbf_h: float
    save_h: float  # one checkpoint save (blocking)
    restart_h: float  # from failure to training again (requeue, reload, warm-up)

    @property
    def job_mtbf_h(self) -> float:
        return self.node_mtbf_h / self.nodes


@dataclass(frozen=True)
class Outcome:
    """Many trials of one checkpoint interval."""

    label: str
    interval_h: float
    effective_mean: float  # work / wall, mean over trials
    effective_p05: float
    effective_p95: float
    wall_h_mean: float
    lost_gpu_hours_mean: float
    failures_mean: float
    first_order_effective: float  # 1 / (1 + waste) with Daly's first-order waste per unit of work


def simulate(s: Scenario, interval_h: float, *, trials: int = 2000, seed: int = 0, label: str = "") -> Outcome:
    """Simulate ``trials`` runs of scenario ``s`` saving every ``interval_h`` hours of compute."""
    if interval_h <= 0 or s.work_h <= 0 or s.node_mtbf_h <= 0 or s.nodes < 1:
        raise ValueError(f"interval, work, MTBF and nodes must be positive: {interval_h}, {s}")
    rng = np.random.default_rng(seed)
    mtbf, tau, c, r, w = s.job_mtbf_h, interval_h, s.save_h, s.restart_h, s.work_h
    seg = tau + c
    done = np.zeros(trials)
    wall = np.zeros(trials)
    fails = np.zeros(trials)
    active = np.ones(trials, dtype=bool)
    while active.any():
        t_fail = rng.exponential(mtbf, size=trials)
        remaining = w - done
        n_seg = np.ceil(remaining / tau - 1e-12)
        finish = remaining + n_seg * c  # every segment, the last included, ends with a save
        finishes = active & (t_fail >= finish)
        wall[finishes] += finish[finishes]
        done[finishes] = w
        failing = active & ~finishes
        kept = np.floor(t_fail / seg) * tau  # segments whose save completed before the failure
        done[failing] += kept[failing]
        wall[failing] += t_fail[failing] + r
        fails[failing] += 1
        active &= ~finishes
    eff = w / wall
    # Per unit of work: saves c/tau, and per failure (rate (1 + c/tau)/M per unit work) half a
    # segment redone plus the restart.
    per_work = c / tau + (1 + c / tau) * (seg / 2 + r) / mtbf
    return Outcome(
        label=label or f"{tau * 60:.1f} min", interval_h=tau, effective_mean=float(eff.mean()),
        effective_p05=float(np.quantile(eff, 0.05)), effective_p95=float(np.quantile(eff, 0.95)),
        wall_h_mean=float(wall.mean()), lost_gpu_hours_mean=float((wall - w).mean() * s.nodes * s.gpus_per_node),
        failures_mean=float(fails.mean()), first_order_effective=1.0 / (1.0 + per_work),
    )


@dataclass(frozen=True)
class Tiers:
    """Two checkpoint tiers: a local save every ``local_interval_h`` hours of compute, every ``every``-th of them a
    global save instead (``every=None``: no periodic global save), and the share ``p`` of failures a local set can
    serve (:func:`launch.planner.tiers.local_share`); the others fall back to the newest global checkpoint."""

    local_interval_h: float
    local_save_h: float
    every: Optional[int]
    share: float
    label: str = ""


def simulate_two_tier(s: Scenario, t: Tiers, *, trials: int = 2000, seed: int = 0) -> Outcome:
    """Simulate ``trials`` runs of ``s`` saving as ``t`` says (``s.save_h`` is the global save).

    After each (re)start the run computes ``local_interval_h``, saves (local, or global on every ``every``-th
    save), and so on. A failure draws whether a local set can serve it (probability ``share``): then the run
    resumes from the newest completed save of either tier, else from the newest completed *global* save, which may
    be older than the previous restart."""
    if t.local_interval_h <= 0 or s.work_h <= 0 or s.node_mtbf_h <= 0 or s.nodes < 1 or not 0 <= t.share <= 1:
        raise ValueError(f"intervals, work, MTBF and nodes must be positive and the share in [0, 1]: {t}, {s}")
    if t.every is not None and t.every < 1:
        raise ValueError(f"a global save every {t.every} local ones: must be >= 1")
    rng = np.random.default_rng(seed)
    mtbf, tau, cl, cg, r, w = s.job_mtbf_h, t.local_interval_h, t.local_save_h, s.save_h, s.restart_h, s.work_h
    k = float(t.every) if t.every else 1e12  # no periodic global save: only the final one
    period = (k - 1) * (tau + cl) + tau + cg  # k segments of work, the last one ending with the global save
    done, durable, wall, fails = (np.zeros(trials) for _ in range(4))
    active = np.ones(trials, dtype=bool)
    while active.any():
        t_fail = rng.exponential(mtbf, size=trials)
        local_ok = rng.random(trials) < t.share
        remaining = w - done
        n_seg = np.ceil(remaining / tau - 1e-12)
        n_global = np.floor(n_seg / k)
        finish = remaining + (n_seg - n_global) * cl + n_global * cg
        finishes = active & (t_fail >= finish)
        wall[finishes] += finish[finishes]
        done[finishes] = w
        failing = active & ~finishes
        periods = np.floor(t_fail / period)
        in_period = np.minimum(np.floor((t_fail - periods * period) / (tau + cl)), k - 1)
        globals_done = periods * k * tau  # work made durable by this attempt's global saves
        durable = np.where(failing & (periods > 0), done + globals_done, durable)
        done = np.where(failing & local_ok, done + globals_done + in_period * tau, np.where(failing, durable, done))
        wall[failing] += t_fail[failing] + r
        fails += failing
        active &= ~finishes
    eff = w / wall
    saves = ((k - 1) * cl + cg) / (k * tau)  # save time per unit of work
    per_fail = t.share * (tau + cl) / 2 + (1 - t.share) * period / 2 + r
    per_work = saves + (1 + saves) * per_fail / mtbf
    label = t.label or f"local {tau * 60:.3g} min" + (f", global x{t.every}" if t.every else "")
    return Outcome(
        label=label, interval_h=tau, effective_mean=float(eff.mean()),
        effective_p05=float(np.quantile(eff, 0.05)), effective_p95=float(np.quantile(eff, 0.95)),
        wall_h_mean=float(wall.mean()), lost_gpu_hours_mean=float((wall - w).mean() * s.nodes * s.gpus_per_node),
        failures_mean=float(fails.mean()), first_order_effective=1.0 / (1.0 + per_work),
    )


def compare_tiers(s: Scenario, local_save_h: float, share: float, *, configured: Optional[Tiers] = None,
                  trials: int = 2000, seed: int = 0) -> list[Outcome]:
    """The global tier alone at Daly's interval, then both tiers at the intervals
    :func:`recovery.interval.two_tier_steps` recommends (in hours, one step = one second of compute), then the
    configured tiers if given."""
    save_s, mtbf_s = max(s.save_h, 1e-9) * 3600, s.job_mtbf_h * 3600
    daly = daly_interval_s(save_s, mtbf_s) / 3600
    out = [simulate(s, max(daly, 1e-6), trials=trials, seed=seed, label="global only, Daly")]
    local_steps, global_steps, _ = two_tier_steps(max(local_save_h, 1e-9) * 3600, save_s, 1.0, mtbf_s, share)
    if local_steps:
        every = max(1, round(global_steps / local_steps)) if global_steps else None
        best = Tiers(local_steps / 3600, local_save_h, every, share, label="two tiers, recommended")
        out.append(simulate_two_tier(s, best, trials=trials, seed=seed))
    if configured is not None:
        out.append(simulate_two_tier(s, configured, trials=trials, seed=seed))
    return out


@dataclass(frozen=True)
class Recovery:
    """How a failure is recovered: through the queue (``requeue``) or inside the allocation (``in_job``).

    Requeue path: every failure costs ``requeue_h + queue_wait_h`` (Slurm's requeue, the queue, the
    prologue, start-up, checkpoint load) and gives the job a new allocation. In-job restart
    (``recovery/injob.py``): the job holds ``spares`` extra nodes; a failure costs ``in_job_h`` (detection,
    teardown, health check, start-up, checkpoint load: no queue) while the allocation's budget of
    ``in_job_restarts`` lasts and, when the failure lost a node (probability ``node_loss``), a spare is
    left; otherwise it takes the requeue path, whose new allocation brings the spares and the budget back.
    The spares are GPUs held and idle: they count in ``gpu_hours`` but do no work."""

    label: str
    queue_wait_h: float = 0.0
    requeue_h: float = 10 / 60
    in_job_h: float = 0.0
    spares: int = 0
    in_job_restarts: int = 0  # 0: every failure goes through the queue
    node_loss: float = 0.78  # Llama 3: 78% of unexpected interruptions were (suspected) hardware


@dataclass(frozen=True)
class RecoveryOutcome:
    """Many trials of one recovery path at one checkpoint interval."""

    label: str
    effective_mean: float  # work / wall
    effective_p05: float
    effective_p95: float
    wall_h_mean: float
    failures_mean: float
    in_job_mean: float  # failures recovered in the allocation
    requeues_mean: float  # failures that went through the queue
    gpu_hours_mean: float  # (nodes + spares) x GPUs x wall: what the run pays for
    work_per_gpu_hour: float  # work GPU-hours (nodes only) / GPU-hours paid


def simulate_recovery(s: Scenario, interval_h: float, rec: Recovery, *, trials: int = 2000,
                      seed: int = 0) -> RecoveryOutcome:
    """Simulate ``trials`` runs of ``s`` (saving every ``interval_h`` hours) recovering as ``rec`` says.

    The same draws of failure times for every ``rec`` at one seed (only the restart costs differ), so two
    paths compare on the same failures. A spare's own failures are not modelled (it runs nothing)."""
    if interval_h <= 0 or s.work_h <= 0 or s.node_mtbf_h <= 0 or s.nodes < 1:
        raise ValueError(f"interval, work, MTBF and nodes must be positive: {interval_h}, {s}")
    if rec.spares < 0 or rec.in_job_restarts < 0 or not 0 <= rec.node_loss <= 1:
        raise ValueError(f"spares and in-job restarts must be >= 0 and node_loss in [0, 1]: {rec}")
    rng = np.random.default_rng(seed)
    mtbf, tau, c, w = s.job_mtbf_h, interval_h, s.save_h, s.work_h
    seg = tau + c
    done, wall, fails, in_job, requeues = (np.zeros(trials) for _ in range(5))
    spares = np.full(trials, rec.spares)
    budget = np.full(trials, rec.in_job_restarts)
    active = np.ones(trials, dtype=bool)
    while active.any():
        t_fail = rng.exponential(mtbf, size=trials)
        lost_node = rng.random(trials) < rec.node_loss
        remaining = w - done
        finish = remaining + np.ceil(remaining / tau - 1e-12) * c
        finishes = active & (t_fail >= finish)
        wall[finishes] += finish[finishes]
        done[finishes] = w
        failing = active & ~finishes
        done[failing] += (np.floor(t_fail / seg) * tau)[failing]
        inside = failing & (budget > 0) & (~lost_node | (spares > 0))
        queued = failing & ~inside
        wall[failing] += t_fail[failing]
        wall[inside] += rec.in_job_h
        wall[queued] += rec.requeue_h + rec.queue_wait_h
        budget[inside] -= 1
        spares[inside & lost_node] -= 1
        budget[queued], spares[queued] = rec.in_job_restarts, rec.spares  # a new allocation
        fails += failing
        in_job += inside
        requeues += queued
        active &= ~finishes
    eff = w / wall
    gpus = s.nodes * s.gpus_per_node
    paid = wall * (s.nodes + rec.spares) * s.gpus_per_node
    return RecoveryOutcome(
        label=rec.label, effective_mean=float(eff.mean()), effective_p05=float(np.quantile(eff, 0.05)),
        effective_p95=float(np.quantile(eff, 0.95)), wall_h_mean=float(wall.mean()), failures_mean=float(fails.mean()),
        in_job_mean=float(in_job.mean()), requeues_mean=float(requeues.mean()), gpu_hours_mean=float(paid.mean()),
        work_per_gpu_hour=float((w * gpus / paid).mean()))


def spares_per_thousand(nodes: int, per_thousand: float) -> int:
    """Spare nodes for ``per_thousand`` per 1,000 nodes (rounded up: 1 per 1,000 of 2,048 nodes is 3)."""
    return int(np.ceil(nodes * per_thousand / 1000 - 1e-9))


def compare_recovery(s: Scenario, interval_h: float, *, queue_waits_min: Sequence[float] = (0, 10, 60),
                     spares_per_1000: Sequence[float] = (0, 1, 2, 4), requeue_min: float = 10.0,
                     in_job_min: float = 5.0, in_job_restarts: int = 3, node_loss: float = 0.78,
                     queue_wait_for_in_job_min: float = 10.0, trials: int = 2000,
                     seed: int = 0) -> list[RecoveryOutcome]:
    """The requeue path at each queue wait, then in-job restart with each spare count (its fallback requeues
    wait ``queue_wait_for_in_job_min``)."""
    out = [simulate_recovery(s, interval_h, Recovery(f"requeue, queue {q:g} min", queue_wait_h=q / 60,
                                                     requeue_h=requeue_min / 60, node_loss=node_loss),
                             trials=trials, seed=seed) for q in queue_waits_min]
    for k in spares_per_1000:
        n = spares_per_thousand(s.nodes, k)
        rec = Recovery(f"in-job, {k:g}/1000 spares ({n})", queue_wait_h=queue_wait_for_in_job_min / 60,
                       requeue_h=requeue_min / 60, in_job_h=in_job_min / 60, spares=n,
                       in_job_restarts=in_job_restarts, node_loss=node_loss)
        out.append(simulate_recovery(s, interval_h, rec, trials=trials, seed=seed))
    return out


def format_recovery(s: Scenario, interval_h: float, outcomes: Sequence[RecoveryOutcome]) -> str:
    """A table: path, effective training time (mean, 5th-95th percentile), wall, failures in job / requeued."""
    lines = [
        f"{s.nodes} nodes x {s.gpus_per_node} GPUs, job MTBF {s.job_mtbf_h:.3g} h, work {s.work_h:,.1f} h, "
        f"checkpoint every {interval_h * 60:.1f} min (save {s.save_h * 3600:.3g} s)",
        f"{'recovery':<28} {'effective':>9} {'p05-p95':>13} {'wall days':>9} {'in job':>7} {'requeued':>8} "
        f"{'work/GPU-h':>10}",
    ]
    for o in outcomes:
        lines.append(f"{o.label:<28} {100 * o.effective_mean:8.1f}% {100 * o.effective_p05:5.1f}-"
                     f"{100 * o.effective_p95:5.1f}% {o.wall_h_mean / 24:9.2f} {o.in_job_mean:7.0f} "
                     f"{o.requeues_mean:8.0f} {100 * o.work_per_gpu_hour:9.1f}%")
    return "\n".join(lines)


def compare_intervals(s: Scenario, chosen_h: Optional[float] = None, *, trials: int = 2000,
                      seed: int = 0) -> list[Outcome]:
    """The chosen interval against Young's and Daly's optima and 1/4x, 1/2x, 2x, 4x Daly."""
    save_s, mtbf_s = max(s.save_h, 1e-9) * 3600, s.job_mtbf_h * 3600
    daly = daly_interval_s(save_s, mtbf_s) / 3600
    young = young_interval_s(save_s, mtbf_s) / 3600
    cases = [("Young sqrt(2CM)", young), ("Daly", daly)]
    cases += [(f"{f:g} x Daly", f * daly) for f in (0.25, 0.5, 2.0, 4.0)]
    if chosen_h:
        cases.insert(0, ("chosen", chosen_h))
    return [simulate(s, max(h, 1e-6), trials=trials, seed=seed, label=name) for name, h in cases]


def llama3_scenario(save_s: float, restart_min: float, days: float = 54.0) -> Scenario:
    """Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4): 419
    unexpected interruptions in a 54-day snapshot on 16,384 H100s (2,048 nodes of 8), i.e. one
    every 3.09 h, a node MTBF of 2,048 * 54 * 24 / 419 = 6,335 h. ``work_h`` is the snapshot's
    length, so the effective fraction is comparable with the paper's "> 90%"."""
    nodes = 2048
    return Scenario(work_h=days * 24 * 0.9, nodes=nodes, gpus_per_node=8,
                    node_mtbf_h=nodes * days * 24 / 419, save_h=save_s / 3600, restart_h=restart_min / 60)


def format_outcomes(s: Scenario, outcomes: Sequence[Outcome]) -> str:
    """A table: interval, effective training time (mean, 5th-95th percentile), wall, lost GPU-hours."""
    width = max([16, *(len(o.label) for o in outcomes)])
    lines = [
        f"{s.nodes} nodes x {s.gpus_per_node} GPUs, node MTBF {s.node_mtbf_h:,.0f} h -> job MTBF "
        f"{s.job_mtbf_h:.3g} h; work {s.work_h:,.1f} h; save {s.save_h * 3600:.3g} s; restart {s.restart_h * 60:.3g} min",
        f"{'interval':<{width}} {'minutes':>8} {'effective':>9} {'p05-p95':>13} {'1st-order':>9} {'wall days':>9} "
        f"{'failures':>8} {'lost GPU-h':>12}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.label:<{width}} {o.interval_h * 60:8.1f} {100 * o.effective_mean:8.1f}% "
            f"{100 * o.effective_p05:5.1f}-{100 * o.effective_p95:5.1f}% {100 * o.first_order_effective:8.1f}% "
            f"{o.wall_h_mean / 24:9.1f} {o.failures_mean:8.0f} {o.lost_gpu_hours_mean:12,.0f}")
    return "\n".join(lines)


def job_of(overrides: Sequence[str]) -> tuple[Job, Estimate]:
    """Compose the job (choosing the layout for ``parallelism=auto``) and estimate it."""
    job = compose_job(list(overrides))
    if job.parallelism.name == "auto":
        job, _ = choose_layout(job)
    est = estimate(job)
    if est.step_time_s is None or est.train_iters is None:
        raise SystemExit(f"no step-time estimate for this job ({est.note}); use a GPU cluster config")
    return job, est


def scenario_from_job(job: Job, est: Estimate, restart_min: float) -> tuple[Scenario, Optional[float]]:
    """The job's scenario and configured interval (hours)."""
    chosen = est.checkpoint_interval * est.step_time_s / 3600 if est.checkpoint_interval else None
    s = Scenario(work_h=est.train_iters * est.step_time_s / 3600, nodes=job.cluster.nodes,
                 gpus_per_node=job.cluster.gpus_per_node, node_mtbf_h=job.cluster.node_mtbf_hours,
                 save_h=est.save_time_s / 3600, restart_h=restart_min / 60)
    return s, chosen


def tiers_of(job: Job, est: Estimate, local_save_s: Optional[float],
             share: Optional[float]) -> tuple[float, float, Optional[Tiers]]:
    """(local save hours, share, the configured tiers or None) of a job; the arguments override the first two."""
    save_s = local_save_s if local_save_s is not None else local_save_time_s(job)
    p = share if share is not None else local_share(job)[0]
    lc, step = job.training.local_checkpoint, est.step_time_s or 0.0
    configured = None
    if lc.enabled and step > 0:
        every = max(1, est.checkpoint_interval // lc.interval) if est.checkpoint_interval else None
        configured = Tiers(lc.interval * step / 3600, save_s / 3600, every, p,
                           label=f"configured: local {lc.interval}, global {est.checkpoint_interval or '-'}")
    return save_s / 3600, p, configured


def _non_negative(text: str) -> float:
    """An argparse type: seconds >= 0 (a bad value is one usage line and exit 2, never a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _share(text: str) -> float:
    """An argparse type: a share of failures, in [0, 1]."""
    value = _non_negative(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a share of failures is in [0, 1], got {text}")
    return value


def main(argv: Sequence[str] | None = None, out=print) -> int:
    """CLI: simulate the composed job (Hydra overrides) or ``--case llama3``."""
    ap = argparse.ArgumentParser(prog="python -m launch.planner.simulate", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch/pretrain.py")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-min", type=float, default=10.0, help="minutes from failure to training again")
    ap.add_argument("--case", choices=["llama3"], help="the published Llama 3 405B case instead of a job")
    ap.add_argument("--save-s", type=float, default=None, help="override the save time (seconds)")
    ap.add_argument("--recovery", action="store_true",
                    help="compare the requeue path (queue wait 0, 10, 60 min) with in-job restart (0, 1, 2, 4 spare "
                         "nodes per 1,000) at Daly's interval instead of comparing intervals")
    ap.add_argument("--in-job-restart-min", type=float, default=5.0,
                    help="minutes from failure to training again inside the allocation (--recovery)")
    ap.add_argument("--in-job-restarts", type=int, default=3,
                    help="in-job restarts per allocation before the requeue path (--recovery)")
    ap.add_argument("--tiers", action="store_true",
                    help="compare the global tier alone (Daly) with node-local sets plus global checkpoints at the "
                         "recommended intervals (and at the configured ones) instead of comparing intervals")
    ap.add_argument("--local-save-s", type=_non_negative, default=None,
                    help="seconds a local save stalls training (--tiers; default: the job's estimate, 5 s for "
                         "--case llama3)")
    ap.add_argument("--local-share", type=_share, default=None,
                    help="share of failures a local set can serve (--tiers; default: the job's, from in-job restart "
                         "and replication; 1 for --case llama3)")
    args = ap.parse_args(argv)
    configured: Optional[Tiers] = None
    if args.case == "llama3":
        s, chosen = llama3_scenario(args.save_s if args.save_s is not None else 142.0, args.restart_min), None
        local_h = (args.local_save_s if args.local_save_s is not None else 5.0) / 3600
        share = args.local_share if args.local_share is not None else 1.0
    else:
        job, est = job_of(args.overrides)
        s, chosen = scenario_from_job(job, est, args.restart_min)
        if args.save_s is not None:
            s = Scenario(**{**s.__dict__, "save_h": args.save_s / 3600})
        local_h, share, configured = tiers_of(job, est, args.local_save_s, args.local_share)
    if args.tiers:
        out(format_outcomes(s, compare_tiers(s, local_h, share, configured=configured, trials=args.trials,
                                             seed=args.seed)))
        out(f"local save {local_h * 3600:.3g} s; share of failures a local set serves p = {share:.2f}")
        return 0
    if args.recovery:
        interval = chosen or daly_interval_s(max(s.save_h, 1e-9) * 3600, s.job_mtbf_h * 3600) / 3600
        out(format_recovery(s, interval, compare_recovery(s, interval, requeue_min=args.restart_min,
                                                          in_job_min=args.in_job_restart_min,
                                                          in_job_restarts=args.in_job_restarts,
                                                          trials=args.trials, seed=args.seed)))
        return 0
    out(format_outcomes(s, compare_intervals(s, chosen, trials=args.trials, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
