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
[--restart-min R]``; ``--case llama3`` uses the published Llama 3 405B numbers instead.

numpy only (no torch): vectorised over trials, one loop iteration per failure.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from launch.compose import compose_job
from launch.planner.estimate import estimate
from launch.planner.layouts import choose_layout
from recovery.interval import daly_interval_s, young_interval_s


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
    lines = [
        f"{s.nodes} nodes x {s.gpus_per_node} GPUs, node MTBF {s.node_mtbf_h:,.0f} h -> job MTBF "
        f"{s.job_mtbf_h:.3g} h; work {s.work_h:,.1f} h; save {s.save_h * 3600:.3g} s; restart {s.restart_h * 60:.3g} min",
        f"{'interval':<16} {'minutes':>8} {'effective':>9} {'p05-p95':>13} {'1st-order':>9} {'wall days':>9} "
        f"{'failures':>8} {'lost GPU-h':>12}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.label:<16} {o.interval_h * 60:8.1f} {100 * o.effective_mean:8.1f}% "
            f"{100 * o.effective_p05:5.1f}-{100 * o.effective_p95:5.1f}% {100 * o.first_order_effective:8.1f}% "
            f"{o.wall_h_mean / 24:9.1f} {o.failures_mean:8.0f} {o.lost_gpu_hours_mean:12,.0f}")
    return "\n".join(lines)


def scenario_from_job(overrides: Sequence[str], restart_min: float) -> tuple[Scenario, Optional[float]]:
    """Compose the job, estimate it, and build its scenario and configured interval (hours)."""
    job = compose_job(list(overrides))
    if job.parallelism.name == "auto":
        job, _ = choose_layout(job)
    est = estimate(job)
    if est.step_time_s is None or est.train_iters is None:
        raise SystemExit(f"no step-time estimate for this job ({est.note}); use a GPU cluster config")
    chosen = est.checkpoint_interval * est.step_time_s / 3600 if est.checkpoint_interval else None
    s = Scenario(work_h=est.train_iters * est.step_time_s / 3600, nodes=job.cluster.nodes,
                 gpus_per_node=job.cluster.gpus_per_node, node_mtbf_h=job.cluster.node_mtbf_hours,
                 save_h=est.save_time_s / 3600, restart_h=restart_min / 60)
    return s, chosen


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
    args = ap.parse_args(argv)
    if args.case == "llama3":
        s, chosen = llama3_scenario(args.save_s if args.save_s is not None else 142.0, args.restart_min), None
    else:
        s, chosen = scenario_from_job(args.overrides, args.restart_min)
        if args.save_s is not None:
            s = Scenario(**{**s.__dict__, "save_h": args.save_s / 3600})
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
