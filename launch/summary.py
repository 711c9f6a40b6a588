"""The short table printed after a submission (and at the end of a dry run): what was asked for,
what the planner expects of it, and the exact commands to follow it.

Login-node code (no torch). The planner's numbers are estimates; the table says so.
"""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

from launch import blend, spares
from launch.check import mock_data_at_scale
from launch.config import Job
from launch.cost import cost_text
from launch.planner import tiers
from launch.planner.estimate import estimate, layout_name, train_iterations


def _hours(h: Optional[float]) -> str:
    if h is None:
        return "?"
    if h < 1:
        return f"{h * 60:.0f} min"
    if h < 72:
        return f"{h:.1f} h"
    return f"{h / 24:.1f} days"


def _count(x: Optional[float]) -> str:
    if x is None:
        return "?"
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _estimate(job: Job) -> Any:
    try:
        return estimate(job)
    except Exception:  # informative only: an estimate that cannot be made leaves '?' in the table
        return None


_FIT = {"fits": "fits", "inside the error band": "MAY NOT FIT: inside the planner's error band",
        "does not fit": "DOES NOT FIT"}


def summary(job: Job, run_dir: Path, *, job_ids: Sequence[str] = (), est: Any = None) -> str:
    """The table; ``job_ids`` empty means a dry run (nothing was submitted)."""
    est = est if est is not None else _estimate(job)
    c, t = job.cluster, job.training
    device = "processes" if c.gpu == "cpu" else f"GPUs ({c.nodes} x {c.gpus_per_node} {c.gpu})"
    rows = [("layout", f"{layout_name(job.parallelism)}-dp{job.dp} on {job.world_size} {device}; "
                       f"gbs {t.global_batch_size}, mbs {t.micro_batch_size}, seq {job.model.seq_length}")]
    if est is not None:
        rows.append(("memory/GPU", f"{est.memory_gb_per_gpu:.1f} GiB of {c.gpu_memory_gb:g} "
                                   f"({_FIT.get(getattr(est, 'memory_verdict', ''), 'fits' if est.fits else 'DOES NOT FIT')}"
                                   "; estimate)"))
        if est.step_time_s:
            tokens = t.global_batch_size * job.model.seq_length / est.step_time_s
            mfu = f"MFU {100 * est.mfu:.1f}%" if est.mfu is not None and c.gpu != "cpu" else "no MFU (cluster.gpu: cpu)"
            rows.append(("speed", f"{est.step_time_s:.3g} s/step, {mfu}, {_count(tokens)} tokens/s (estimate)"))
    iters = train_iterations(job)
    if iters:
        target = f"{iters:,} steps ({_count(iters * t.global_batch_size * job.model.seq_length)} tokens)"
        if est is not None and est.wall_time_h_total is not None:
            usable_h = (job.run.time_limit_min * 60 - t.signal_lead_time_s) / 3600
            slices = math.ceil(est.wall_time_h_total / usable_h) if usable_h > 0 and c.launcher == "slurm" else None
            target += f": {_hours(est.wall_time_h_total)} wall"
            if est.gpu_hours_total is not None and c.gpu != "cpu":
                target += f", {est.gpu_hours_total:,.0f} GPU-hours"
            if slices:
                target += f", {slices:,} slice{'s' if slices > 1 else ''} of {job.run.time_limit_min} min"
            if job.run.budget_gpu_hours:
                target += f" (budget {job.run.budget_gpu_hours:,.0f} GPU-hours)"
        rows.append(("to target", target))
        if est is not None and est.gpu_hours_total is not None:
            priced = cost_text(est.gpu_hours_total, c.gpu_hour_price, gpu=c.gpu, what="estimate to the target")
            if priced:
                rows.append(("cost", priced))
    if est is not None:
        every = f", every {est.checkpoint_interval} steps" if est.checkpoint_interval else ""
        size = f"{est.checkpoint_gb:,.3g} GB" if est.checkpoint_gb >= 1 else f"{est.checkpoint_gb * 1e3:.3g} MB"
        rows.append(("checkpoint", f"{size}, save {est.save_time_s:.3g} s at "
                                   f"{c.fs_write_bandwidth_gbs:g} GB/s{every}; keep {t.keep_checkpoints}"))
    tier_line = tiers.summary_text(job, est)
    if tier_line:
        rows.append(("local tier", tier_line))
    spare_line = spares.summary_text(job, est)
    if spare_line:
        rows.append(("spares", spare_line))
    rows.append(("data", _data_text(job)))
    rows.append(("job", ", ".join(job_ids) + f"; run dir {run_dir}" if job_ids else
                 f"dry run: nothing written or submitted; run dir would be {run_dir}"))
    q = shlex.quote(str(run_dir))
    if job_ids:
        last_rank = job.world_size - 1
        rows.append(("next", f"python launch/status.py {q} --watch 60"))
        if c.launcher == "slurm":
            rows.append(("", f"tail -F {q}/logs/{job_ids[0]}_{last_rank}.out   (the last rank's iteration lines)"))
        rows.append(("", f"python analysis/report.py {q} --out {q}/report"))
    else:
        verb = "trains it on this machine" if c.launcher == "local" else "submits it"
        rows.append(("next", f"the same command without dry_run=true {verb}; then "
                             f"python launch/status.py {q} --watch 60"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _data_text(job: Job) -> str:
    """``indexed 0.3 web + 0.7 code (split 99,1,0), tokenizer byte``; the blend as the ranks resolve it."""
    d = job.data
    if d.kind != "indexed":
        loud = f"WARNING: {job.cluster.nodes} nodes on synthetic tokens, a benchmark; " if mock_data_at_scale(job) else ""
        return f"mock: synthetic tokens ({loud}set data=indexed data.path=<prefix> for real text)"
    try:
        train = blend.train_sources(d, job.cluster.data_root)
        valid = blend.valid_sources(d, job.cluster.data_root)
    except blend.BlendError:
        train, valid = [], []
    what = " + ".join(f"{w:.3g} {s.path}" for s, w in zip(train, blend.normalized(train))) if len(train) > 1 else \
        (train[0].path if train else d.path)
    split = f"validation {' + '.join(s.path for s in valid)}" if valid else f"split {d.split}"
    return f"indexed {what} ({split}), tokenizer {d.tokenizer}, seed {d.seed}"
