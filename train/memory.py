"""Memory health on the ranks: what each log interval says about memory, fragmentation, and out-of-memory forensics.

Every ``training.log_interval`` steps a rank samples its memory (:func:`sample`): on a GPU from
``torch.cuda.memory_stats()`` (allocated, reserved, peak allocated, the reserved-minus-allocated gap, and the
allocator's ``num_alloc_retries``), on the CPU the process's resident set size and "n/a" for the rest. The last rank
prints Megatron-LM's ``report_memory`` line with our fields appended (:func:`log_line`); rank 0 adds the numbers to
its ``iteration`` event; the tracking rank writes them to TensorBoard beside the planner's estimate of the same
layout (``<run_dir>/memory_plan.json``, written at submit). :class:`FragmentationWatch` (pure) raises a
``memory_fragmentation`` event when the gap grows, or the retries rise, over ``training.memory_window`` samples:
reserved-vs-allocated growing across steps is fragmentation, and ``num_alloc_retries`` rising is the same symptom.

A CUDA out-of-memory on any rank is caught (:func:`oom_stop`): the rank writes ``torch.cuda.memory_summary()`` (and,
with ``training.oom_snapshot=true``, the allocator snapshot recorded since the start) under ``<run_dir>/oom/``,
records a ``stop`` with reason ``oom`` (exit 18, final: a deterministic OOM does not fix itself on a requeue) with
the planner's estimate beside the measured peak and the planner's fixes.

Torch is imported only inside the functions that need it: the pure parts are unit-tested without a GPU.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

MIB = 2**20
GIB = 2**30
NA = "n/a"


@dataclass(frozen=True)
class MemorySample:
    """One rank's memory at a log interval, in bytes; None where the device cannot say (the CPU)."""

    allocated: Optional[float] = None
    reserved: Optional[float] = None
    peak: Optional[float] = None  # the peak allocated since the start (or the last reset)
    retries: Optional[int] = None  # the caching allocator's num_alloc_retries (cudaMalloc failed, cache flushed)
    rss: Optional[float] = None  # the process's resident set (CPU)

    @property
    def gap(self) -> Optional[float]:
        """Reserved minus allocated: memory the caching allocator holds that no tensor uses."""
        if self.allocated is None or self.reserved is None:
            return None
        return self.reserved - self.allocated

    def fields(self) -> dict:
        """For the ``iteration`` event and the report: the known values only."""
        out = {"mem_allocated": self.allocated, "mem_reserved": self.reserved, "mem_peak": self.peak,
               "mem_gap": self.gap, "mem_alloc_retries": self.retries, "mem_rss": self.rss}
        return {k: v for k, v in out.items() if v is not None}


def from_stats(stats: Mapping[str, Any]) -> MemorySample:
    """A sample from ``torch.cuda.memory_stats()`` (its keys: ``allocated_bytes.all.current`` ...)."""
    def get(key: str) -> Optional[float]:
        v = stats.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    retries = stats.get("num_alloc_retries")
    return MemorySample(allocated=get("allocated_bytes.all.current"), reserved=get("reserved_bytes.all.current"),
                        peak=get("allocated_bytes.all.peak"),
                        retries=int(retries) if isinstance(retries, (int, float)) else None)


def rss_bytes() -> Optional[float]:
    """This process's resident set size (psutil), or None without it."""
    try:
        import psutil

        return float(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or the process table unreadable: the field says n/a
        return None


def sample(cuda: bool, *, stats: Optional[Callable[[], Mapping]] = None,
           rss: Callable[[], Optional[float]] = rss_bytes) -> MemorySample:
    """This rank's memory now: CUDA's allocator statistics on a GPU, the resident set on the CPU."""
    if cuda:
        if stats is None:
            import torch

            stats = torch.cuda.memory_stats
        return from_stats(stats())
    return MemorySample(rss=rss())


def _mb(v: Optional[float]) -> str:
    return NA if v is None else f"{v / MIB:.2f}"


def log_line(rank: int, iteration: int, s: MemorySample) -> str:
    """Megatron-LM's ``report_memory`` line (MB), with the gap, the retries and the RSS after its fields."""
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {_mb(s.allocated)} | "
            f"max allocated: {_mb(s.peak)} | reserved: {_mb(s.reserved)} | gap: {_mb(s.gap)} | "
            f"alloc retries: {NA if s.retries is None else s.retries} | rss: {_mb(s.rss)}")


def scalars(s: MemorySample, plan_bytes: Optional[float] = None) -> dict:
    """TensorBoard scalars (train/tracking.py names them): measured memory and the planner's estimate."""
    out = {"mem_allocated": s.allocated, "mem_reserved": s.reserved, "mem_max_allocated": s.peak,
           "mem_gap": s.gap, "mem_alloc_retries": s.retries, "mem_rss": s.rss, "mem_planner_estimate": plan_bytes}
    return {k: float(v) for k, v in out.items() if v is not None}


@dataclass
class FragmentationWatch:
    """Raises a ``memory_fragmentation`` finding when, over the last ``window`` samples, the allocator's retries rose
    or the reserved-minus-allocated gap grew at every sample by ``min_growth`` bytes or ``min_fraction`` of reserved
    in all (whichever is larger). After a finding the window starts again, so one episode is one event."""

    window: int = 5
    min_growth: float = 256 * MIB
    min_fraction: float = 0.05
    history: list = field(default_factory=list)

    def add(self, step: int, s: MemorySample) -> Optional[dict]:
        if s.reserved is None or s.allocated is None:
            return None  # the CPU: nothing to say
        self.history = (self.history + [(step, s)])[-self.window:]
        if len(self.history) < self.window:
            return None
        (first_step, first), (_, last) = self.history[0], self.history[-1]
        finding = None
        if first.retries is not None and last.retries is not None and last.retries > first.retries:
            finding = {"symptom": "alloc_retries", "detail": f"num_alloc_retries rose {first.retries} -> "
                                                             f"{last.retries} over steps {first_step}..{step}"}
        else:
            gaps = [x.gap for _, x in self.history]
            need = max(self.min_growth, self.min_fraction * (last.reserved or 0.0))
            if all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] - gaps[0] >= need:
                finding = {"symptom": "gap", "detail": f"reserved - allocated grew {gaps[0] / GIB:.2f} -> "
                                                       f"{gaps[-1] / GIB:.2f} GiB over steps {first_step}..{step} "
                                                       f"(threshold {need / GIB:.2f} GiB)"}
        if finding is None:
            return None
        self.history = []
        return {**finding, "step": step, "first_step": first_step, "window": self.window, **last.fields()}


def read_plan(path: Path) -> Optional[dict]:
    """The planner's ``memory_plan.json`` (JSON, never a pickle), or None when absent or unreadable."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("total_gib"), (int, float)) else None


def is_oom(exc: BaseException) -> bool:
    """A CUDA out-of-memory (``torch.cuda.OutOfMemoryError``, or an older torch's RuntimeError saying so)."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


def forensics_line(error: str, s: MemorySample, plan: Optional[dict]) -> str:
    """The one line of an ``oom`` stop: the error, the measured peak beside the planner's estimate, the fixes."""
    first = (error.strip().splitlines() or [""])[0][:300]
    peak = f"measured peak allocated {s.peak / GIB:.2f} GiB" if s.peak is not None else "no measured peak (no CUDA)"
    if plan is None:
        est = "no planner estimate (memory_plan.json missing)"
        fix = "parallelism.recompute=selective, more pipeline stages, or training.micro_batch_size=1"
    else:
        est = f"planner estimate {plan['total_gib']:.2f} GiB per GPU for {plan.get('layout')}: {plan.get('breakdown')}"
        fix = ", or ".join(plan.get("fixes") or []) or "parallelism=auto"
    return f"out of GPU memory ({first}); {peak}; {est}; fix: {fix}"


def oom_files(paths: Any, job_id: Optional[str], attempt: int, rank: int, *, cuda: bool, snapshot: bool,
              summary: Optional[Callable[[], str]] = None, dump: Optional[Callable[[str], None]] = None,
              s: Optional[MemorySample] = None) -> list[Path]:
    """Write this rank's forensics under ``<run_dir>/oom/``: the allocator summary (on the CPU: what is known), and
    the snapshot when asked for; returns the files written."""
    out = paths.oom(job_id, attempt, rank, "memory_summary.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    if cuda and summary is None:
        import torch

        summary = torch.cuda.memory_summary
    text = summary() if summary is not None else (
        "torch.cuda.memory_summary(): n/a (no CUDA device on this rank)\n"
        + (log_line(rank, -1, s) + "\n" if s is not None else ""))
    out.write_text(text)
    written = [out]
    if snapshot and cuda:
        snap = paths.oom(job_id, attempt, rank, "snapshot.pickle")
        if dump is None:
            import torch

            dump = torch.cuda.memory._dump_snapshot
        dump(str(snap))  # view it at https://pytorch.org/memory_viz (it is never loaded here)
        written.append(snap)
    return written


def start_history(cuda: bool, snapshot: bool) -> bool:
    """``training.oom_snapshot=true`` on a GPU: record the allocator's history from the start, so the snapshot at an
    OOM shows what led to it. Returns whether it records."""
    if not (cuda and snapshot):
        return False
    import torch

    torch.cuda.memory._record_memory_history(max_entries=100000)
    return True
