"""Job-check rules for the live checks: hang watchdog, NaN guard, stragglers (part of :func:`launch.check.check`).

A step deadline only helps while it ends a hang *before* something else does: the process
group's timeout (:data:`launch.dist_env.PG_TIMEOUT_S`) turns a hang inside a collective into a
crash without stacks or suspects, and a slice whose time limit arrives first ends TIMEOUT,
which Slurm does not requeue (the hung ranks cannot save on the warning signal).
"""
from __future__ import annotations

from launch.config import Job
from launch.dist_env import PG_TIMEOUT_S
from launch.problems import Problem

def problems(job: Job) -> list[Problem]:
    t = job.training
    out: list[Problem] = []
    for name, value, low in (("hang_startup_s", t.hang_startup_s, 0.0), ("hang_step_floor_s", t.hang_step_floor_s, 0.0),
                             ("hang_save_floor_s", t.hang_save_floor_s, 0.0)):
        if not value > low:
            out.append(Problem(f"training.{name}", "must be > 0 seconds", f"{name} = {value}",
                               f"set training.{name} to a positive number of seconds"))
    if t.hang_step_factor < 1.5:
        out.append(Problem("training.hang_step_factor", "a deadline this close to the step time fires on healthy jitter",
                           f"hang_step_factor {t.hang_step_factor} < 1.5", "set training.hang_step_factor=5"))
    if t.hang_save_factor < 1.0:
        out.append(Problem("training.hang_save_factor", "the save deadline must not be shorter than a measured save",
                           f"hang_save_factor {t.hang_save_factor} < 1", "set training.hang_save_factor=3"))
    if t.hang_watchdog and t.hang_step_floor_s >= PG_TIMEOUT_S:
        out.append(Problem(
            "training.hang_step_floor_s", "the process-group timeout ends a hung collective first (a crash, no stacks)",
            f"hang_step_floor_s {t.hang_step_floor_s:g} >= process-group timeout {PG_TIMEOUT_S} s",
            f"set training.hang_step_floor_s below {PG_TIMEOUT_S}, e.g. 60"))
    if t.hang_watchdog and job.cluster.launcher == "slurm" and job.run.time_limit_min >= 1:
        usable = job.run.time_limit_min * 60 - t.signal_lead_time_s
        if t.hang_step_floor_s >= usable:
            out.append(Problem(
                "training.hang_step_floor_s", "a hang would outlast the slice: it ends TIMEOUT, never requeued",
                f"hang_step_floor_s {t.hang_step_floor_s:g} >= run.time_limit_min {job.run.time_limit_min} * 60 "
                f"- signal_lead_time_s {t.signal_lead_time_s} = {usable}",
                f"set training.hang_step_floor_s well below {usable} or raise run.time_limit_min"))
    for name, value in (("nan_skip_batches", t.nan_skip_batches), ("max_nan_rollbacks", t.max_nan_rollbacks),
                        ("straggler_interval", t.straggler_interval)):
        if value < 0:
            out.append(Problem(f"training.{name}", "must be >= 0", f"{name} = {value}", f"set training.{name}=0 or more"))
    for name, value in (("straggler_threshold", t.straggler_threshold),
                        ("regression_threshold", t.regression_threshold)):
        if not 0 < value < 10:
            out.append(Problem(f"training.{name}", "a fraction above 0", f"{name} = {value}",
                               f"set training.{name}=0.2"))
    if t.regression_intervals < 1:
        out.append(Problem("training.regression_intervals", "must be >= 1",
                           f"regression_intervals = {t.regression_intervals}", "set training.regression_intervals=3"))
    if t.memory_window < 2:  # a growth needs two samples at least (train/memory.py)
        out.append(Problem("training.memory_window", "must be >= 2 (log intervals compared for memory growth)",
                           f"memory_window = {t.memory_window}", "set training.memory_window=5"))
    return out
