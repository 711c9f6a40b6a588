"""The planner's answer for one job: memory, step time, MFU, and what the whole run costs.

``estimate(job)`` is what ``launch/plan.py`` prints, what the job check's budget guard reads
and what a sweep registry stores beside each submitted layout. It never raises for a layout
that does not fit (``fits`` is False and the breakdown says why) and never for a CPU cluster
(the timing fields are None: there is no peak to measure against).

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from analysis.flops import UnknownDevice, peak_flops
from launch.config import Job, ParallelismConfig
from launch.planner.memory import memory_verdict, stage_memory
from launch.planner.shapes import Shape, shape_of
from launch.planner.steptime import precision_dtype, step_time
from recovery.interval import resolve_interval


@dataclass
class Estimate:
    """Per-GPU memory and speed of one layout, and the run's cost at that speed."""

    layout: str
    world_size: int
    memory_gb_per_gpu: float  # worst stage, GiB
    fits: bool  # the estimate is within cluster.gpu_memory_gb
    memory_verdict: str  # fits | inside the error band | does not fit: launch.planner.memory.memory_verdict
    step_time_s: Optional[float]
    tflops_per_gpu: Optional[float]  # model FLOPs (no recompute) per second per GPU
    mfu: Optional[float]  # fraction of the dense peak
    hfu: Optional[float]  # with recomputed FLOPs
    train_iters: Optional[int]
    gpu_hours_total: Optional[float]  # at the estimated step time, plus checkpoint saves
    wall_time_h_total: Optional[float]
    checkpoint_gb: float  # bytes one checkpoint writes (weights + optimizer state), GB
    save_time_s: float  # checkpoint_gb / cluster.fs_write_bandwidth_gbs
    checkpoint_interval: Optional[int]  # steps (resolved when 'auto')
    breakdown: dict[str, Any] = field(default_factory=dict)  # memory (worst stage), stages, step_time, cost
    note: str = ""

    @property
    def gpu_hours(self) -> Optional[float]:
        """Alias read by the job check's budget guard."""
        return self.gpu_hours_total

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def to_json(self) -> str:
        """One JSON object (``plan.format=json``)."""
        return json.dumps(self.to_dict(), sort_keys=True, default=float)


def layout_name(par: ParallelismConfig) -> str:
    """Short label of a layout: ``tp8-pp8-vpp2-sp-sel`` (:attr:`launch.config.ParallelismConfig.label`)."""
    return par.label

def train_iterations(job: Job) -> Optional[int]:
    """Optimizer steps of the run (:attr:`launch.config.Job.iterations`: train_tokens wins over train_iters)."""
    return job.iterations

def checkpoint_bytes(job: Job, shape: Shape | None = None) -> float:
    """What one distributed checkpoint writes: weights plus fp32 main weights and Adam moments."""
    shape = shape or shape_of(job.model, job.parallelism.tp)
    per_param = 12.0 if job.training.precision == "fp32" else 14.0
    return shape.total_params * per_param


def save_time_s(job: Job, shape: Shape | None = None) -> float:
    """Seconds a save takes at the filesystem's aggregate write bandwidth."""
    return checkpoint_bytes(job, shape) / (max(job.cluster.fs_write_bandwidth_gbs, 1e-9) * 1e9)


HOST_COPY_GBS = 20.0  # device-to-host copy per GPU into pinned memory (PCIe Gen4 x16: ~25 GB/s peak)


def blocking_save_time_s(job: Job, shape: Shape | None = None) -> float:
    """Seconds a periodic save stalls training: the whole save when synchronous; with ``training.async_save``
    only each GPU's copy of its shard to host memory (Megatron's preload before the writer process forks), i.e.
    the checkpoint over the ranks writing distinct shards (every rank with the distributed optimizer, one dp
    replica without) at :data:`HOST_COPY_GBS`; the write itself overlaps training."""
    if not getattr(job.training, "async_save", False):
        return save_time_s(job, shape)
    p = job.parallelism
    writers = job.world_size if p.distributed_optimizer else max(1, p.tp * p.pp * p.cp)
    return checkpoint_bytes(job, shape) / max(1, writers) / (HOST_COPY_GBS * 1e9)


def resolve_checkpoint_interval(job: Job, step_s: Optional[float], save_s: float,
                                write_s: Optional[float] = None) -> Optional[int]:
    """Steps between saves: as configured, or Young/Daly via ``recovery.interval`` for 'auto' (``save_s``: what a
    save stalls training; ``write_s``: until it is durable, asynchronous saves)."""
    return checkpoint_interval_and_why(job, step_s, save_s, write_s)[0]


def checkpoint_interval_and_why(job: Job, step_s: Optional[float], save_s: float,
                                write_s: Optional[float] = None) -> tuple[Optional[int], str]:
    """(steps between saves, the arithmetic): for 'auto', Young/Daly, never shorter than an asynchronous save
    takes to become durable (``recovery.interval.min_async_steps``)."""
    ci = job.training.checkpoint_interval
    if isinstance(ci, int) and not isinstance(ci, bool):
        return (ci if ci > 0 else None), f"configured: every {ci} step(s)"
    if step_s is None or step_s <= 0:
        return None, ""
    try:
        return resolve_interval(ci, save_s=max(save_s, 1e-6), step_s=step_s,
                                node_mtbf_hours=job.cluster.node_mtbf_hours, nodes=max(1, job.cluster.nodes),
                                write_s=write_s)
    except ValueError:
        return None, ""


def estimate(job: Job, *, shape: Shape | None = None, flops: dict | None = None,
             attention: str | None = None) -> Estimate:
    """Memory, step time, MFU and run cost of ``job`` as composed (see the package docstring)."""
    par, c = job.parallelism, job.cluster
    shape = shape or shape_of(job.model, par.tp)
    stages = stage_memory(job, shape, attention)
    worst = max(stages, key=lambda s: s.total)
    fits = c.gpu == "cpu" or worst.total <= c.gpu_memory_gb  # the ranking's test (launch/planner/layouts.py)
    verdict = "fits" if c.gpu == "cpu" else memory_verdict(worst.total, c.gpu_memory_gb)  # what the tables say
    save_s = save_time_s(job, shape)
    iters = train_iterations(job)
    breakdown: dict[str, Any] = {"memory": worst.to_dict(), "stages": [s.to_dict() for s in stages]}
    note = ""
    step = tflops = mfu = hfu = None
    if c.gpu == "cpu":
        note = "cluster.gpu=cpu: no peak FLOP/s, so no step time or MFU"
    elif job.dp < 1:
        note = f"no data-parallel rank: world {job.world_size} < tp*pp*cp"
    else:
        try:
            st = step_time(job, shape, flops, attention)
            peak = peak_flops(c.gpu, precision_dtype(job.training.precision))
        except UnknownDevice as exc:
            note = str(exc)
        else:
            step = st.step_time_s
            tflops = st.model_flops / step / job.world_size / 1e12
            mfu = tflops * 1e12 / peak
            hfu = st.hardware_flops / step / job.world_size / peak
            breakdown["step_time"] = st.to_dict()
    block_s = blocking_save_time_s(job, shape)  # = save_s unless training.async_save
    asynchronous = block_s != save_s
    interval, interval_why = checkpoint_interval_and_why(job, step, block_s, save_s if asynchronous else None)
    breakdown["checkpoint_interval"] = interval_why
    gpu_hours = wall_h = None
    if step is not None and iters is not None:
        saves = iters // interval if interval else 0
        wall_s = iters * step + saves * block_s
        wall_h = wall_s / 3600
        gpu_hours = wall_h * job.world_size
        breakdown["cost"] = {"iterations": iters, "saves": saves, "compute_h": iters * step / 3600,
                             "saving_h": saves * block_s / 3600, "save_blocking_s": block_s,
                             "save_write_s": save_s}
    return Estimate(
        layout=layout_name(par), world_size=job.world_size, memory_gb_per_gpu=worst.total, fits=fits,
        memory_verdict=verdict,
        step_time_s=step, tflops_per_gpu=tflops, mfu=mfu, hfu=hfu, train_iters=iters,
        gpu_hours_total=gpu_hours, wall_time_h_total=wall_h, checkpoint_gb=checkpoint_bytes(job, shape) / 1e9,
        save_time_s=save_s, checkpoint_interval=interval, breakdown=breakdown, note=note,
    )


__all__ = ["Estimate", "estimate", "layout_name", "train_iterations", "checkpoint_bytes", "save_time_s",
           "blocking_save_time_s"]
