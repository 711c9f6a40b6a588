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
    from launch.compose import compose_job
    from launch.planner.estimate import estimate
    from launch.planner.layouts import choose_layout

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
    args = ap.parse_args(argv)
    if args.case == "llama3":
        s, chosen = llama3_scenario(args.save_s if args.save_s is not None else 142.0, args.restart_min), None
    else:
        s, chosen = scenario_from_job(args.overrides, args.restart_min)
        if args.save_s is not None:
            s = Scenario(**{**s.__dict__, "save_h": args.save_s / 3600})
    out(format_outcomes(s, compare_intervals(s, chosen, trials=args.trials, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
