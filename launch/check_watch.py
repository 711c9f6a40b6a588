"""Job-check rules for the live checks: hang watchdog, NaN guard, stragglers (part of :func:`launch.check.check`).

A step deadline only helps while it ends a hang *before* something else does: the process
group's timeout (:data:`launch.dist_env.PG_TIMEOUT_S`) turns a hang inside a collective into a
crash without stacks or suspects, and a slice whose time limit arrives first ends TIMEOUT,
which Slurm does not requeue (the hung ranks cannot save on the warning signal).
"""
from __future__ import annotations

from launch.config import Job, TrainingConfig
from launch.dist_env import PG_TIMEOUT_S
from launch.nan_guard_config import NanGuardConfig
from launch.problems import Problem
from launch.stragglers_config import StragglersConfig


def problems(job: Job) -> list[Problem]:
    t = job.training
    return _watchdog(job) + _nan_guard(t.nan_guard) + _stragglers(t.stragglers) + _memory(t)


def _watchdog(job: Job) -> list[Problem]:
    w = job.training.watchdog
    f = "training.watchdog."
    out: list[Problem] = []
    for name, value, low in (("startup_s", w.startup_s, 0.0), ("step_floor_s", w.step_floor_s, 0.0),
                             ("save_floor_s", w.save_floor_s, 0.0)):
        if not value > low:
            out.append(Problem(f"{f}{name}", "must be > 0 seconds", f"{name} = {value}",
                               f"set {f}{name} to a positive number of seconds"))
    if w.step_factor < 1.5:
        out.append(Problem(f"{f}step_factor", "a deadline this close to the step time fires on healthy jitter",
                           f"step_factor {w.step_factor} < 1.5", f"set {f}step_factor=5"))
    if w.save_factor < 1.0:
        out.append(Problem(f"{f}save_factor", "the save deadline must not be shorter than a measured save",
                           f"save_factor {w.save_factor} < 1", f"set {f}save_factor=3"))
    if w.enabled and w.step_floor_s >= PG_TIMEOUT_S:
        out.append(Problem(
            f"{f}step_floor_s", "the process-group timeout ends a hung collective first (a crash, no stacks)",
            f"step_floor_s {w.step_floor_s:g} >= process-group timeout {PG_TIMEOUT_S} s",
            f"set {f}step_floor_s below {PG_TIMEOUT_S}, e.g. 60"))
    if w.enabled and job.cluster.launcher == "slurm" and job.run.time_limit_min >= 1:
        usable = job.run.time_limit_min * 60 - job.training.signal_lead_time_s
        if w.step_floor_s >= usable:
            out.append(Problem(
                f"{f}step_floor_s", "a hang would outlast the slice: it ends TIMEOUT, never requeued",
                f"step_floor_s {w.step_floor_s:g} >= run.time_limit_min {job.run.time_limit_min} * 60 "
                f"- signal_lead_time_s {job.training.signal_lead_time_s} = {usable}",
                f"set {f}step_floor_s well below {usable} or raise run.time_limit_min"))
    return out


def _nan_guard(n: NanGuardConfig) -> list[Problem]:
    f = "training.nan_guard."
    return [Problem(f"{f}{name}", "must be >= 0", f"{name} = {value}", f"set {f}{name}=0 or more")
            for name, value in (("skip_batches", n.skip_batches), ("max_rollbacks", n.max_rollbacks)) if value < 0]


def _stragglers(s: StragglersConfig) -> list[Problem]:
    f = "training.stragglers."
    out: list[Problem] = []
    if s.interval < 0:
        out.append(Problem(f"{f}interval", "must be >= 0", f"interval = {s.interval}", f"set {f}interval=0 or more"))
    for name, value in (("threshold", s.threshold), ("regression_threshold", s.regression_threshold)):
        if not 0 < value < 10:
            out.append(Problem(f"{f}{name}", "a fraction above 0", f"{name} = {value}", f"set {f}{name}=0.2"))
    if s.regression_intervals < 1:
        out.append(Problem(f"{f}regression_intervals", "must be >= 1",
                           f"regression_intervals = {s.regression_intervals}", f"set {f}regression_intervals=3"))
    return out


def _memory(t: TrainingConfig) -> list[Problem]:
    if t.memory_window < 2:  # a growth needs two samples at least (train/memory.py)
        return [Problem("training.memory_window", "must be >= 2 (log intervals compared for memory growth)",
                        f"memory_window = {t.memory_window}", "set training.memory_window=5")]
    return []
