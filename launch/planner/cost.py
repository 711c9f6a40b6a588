"""Refusals that depend on the estimate: the GPU-hour budget and the signal lead time.

Why they live in the planner: both compare a user setting with the estimated step time. The
budget guard stops a run whose estimate already overshoots ``run.budget_gpu_hours`` before it
spends a GPU-hour (cost governance); the lead-time guard stops a job whose Slurm warning
(``--signal``, ``training.signal_lead_time_s``) arrives too late to finish the current step and
save a checkpoint before the kill, which would lose everything since the previous save at
every time limit.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import math
from typing import Optional

from launch.config import Job
from launch.planner.estimate import Estimate, estimate, save_time_s
from launch.problems import Problem


def budget_problems(job: Job, est: Optional[Estimate] = None) -> list[Problem]:
    """Refuse when the estimated GPU-hours to reach the target exceed ``run.budget_gpu_hours``."""
    budget = job.run.budget_gpu_hours
    if budget is None or budget <= 0 or job.dp < 1:
        return []
    est = est or estimate(job)
    if est.gpu_hours_total is None or est.gpu_hours_total <= budget:
        return []
    iters = est.train_iters or 0
    affordable = int(iters * budget / est.gpu_hours_total) if est.gpu_hours_total else 0
    return [Problem(
        "run.budget_gpu_hours", "the estimated cost of the run exceeds the budget",
        f"{iters:,} iterations x {est.step_time_s:.3g} s/step x {est.world_size} GPUs (+ checkpoint saves) = "
        f"{est.gpu_hours_total:,.0f} GPU-hours > budget {budget:,.0f}",
        f"raise run.budget_gpu_hours to {math.ceil(est.gpu_hours_total):,}, set training.train_iters={affordable:,}"
        " (what the budget buys), or choose a faster layout (parallelism=auto)",
    )]


def lead_time_problems(job: Job, est: Optional[Estimate] = None) -> list[Problem]:
    """Refuse when the signal lead time cannot cover one step plus one checkpoint save.

    On a CPU cluster there is no step-time estimate; the save time alone is checked.
    """
    if job.dp < 1:
        return []
    lead = job.training.signal_lead_time_s
    save_s = save_time_s(job)
    step_s = None
    if job.cluster.gpu != "cpu":
        est = est or estimate(job)
        step_s = est.step_time_s
    # asynchronous periodic saves: the stop first waits for the save in flight (its whole write, worst case)
    wait_s = save_s if getattr(job.training, "async_save", False) else 0.0
    need = save_s + wait_s + (step_s or 0.0)
    if lead >= need:
        return []
    c = job.cluster
    step_part = f"step {step_s:.3g} s + " if step_s is not None else ""
    if wait_s:
        step_part += f"the async save in flight {wait_s:.3g} s (training.async_save=true) + "
    return [Problem(
        "training.signal_lead_time_s", "the warning arrives too late to finish a step and save a checkpoint",
        f"signal_lead_time_s {lead} < {step_part}save {save_s:.3g} s (checkpoint "
        f"{save_s * c.fs_write_bandwidth_gbs:.3g} GB / cluster.fs_write_bandwidth_gbs {c.fs_write_bandwidth_gbs:g}) "
        f"= {need:.3g} s",
        f"set training.signal_lead_time_s={math.ceil(need * 1.5)} (1.5x margin)",
    )]
