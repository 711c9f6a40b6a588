"""A run's throughput figures, each computed once and written the same way everywhere.

One definition, used by the rank's end-of-attempt line, TensorBoard's run figures, ``launch/status.py``,
``summary.json``, ``report.md`` and the HTML report:

* **the steady steps**: every logged step of every attempt except each attempt's first :data:`WARMUP_STEPS`
  logged steps (start-up: compilation, the allocator's warm-up, the first step after a checkpoint load);
  all logged steps when no attempt has more than that. The steps a resumed attempt redoes are steps too.
* **step time**: the median of the steady steps' times (robust to a checkpoint save or a GC pause; Megatron's
  own line averages over the log interval).
* **tokens/s**: tokens per step (global batch x sequence length) / step time.
* **TFLOP/s per GPU**: :func:`analysis.flops.num_floating_point_operations` over the global batch (the one
  FLOP formula) / (step time x GPUs) / 1e12.
* **MFU**: TFLOP/s per GPU / the dense peak of the configured GPU (:func:`analysis.flops.peak_flops`);
  none on a CPU or an unknown GPU (never guessed).

Rates derive from the one step time, so they agree with it and with each other to every digit.
The step times are rank 0's, from the event log's ``iteration`` events (``seconds``); inputs without an event
log (bare Megatron logs) give the same figures from the log lines' ``elapsed time per iteration``. Attempts
are delimited by rank 0's ``job_start`` events (separate local launches all start at restart count 0).

Per-step views (TensorBoard's ``iteration-time``, Megatron's iteration line) and windows (``status.py``'s
ETA over the last logged steps, the report's per-attempt table) are other figures and say so in their labels.

No torch, no pandas, nothing of ``launch/`` but the event kinds: the ranks import this.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from analysis.flops import UnknownDevice, num_floating_point_operations, peak_flops

__all__ = ["WARMUP_STEPS", "RunFigures", "steady", "figures", "attempts_from_events", "of_events",
           "tflop_per_gpu_step", "peak_or_none", "step_time_text", "tokens_text", "tflops_text", "pct_text", "line",
           "LABEL"]

WARMUP_STEPS = 2
LABEL = (f"median over the steady logged steps of every attempt (each attempt's first {WARMUP_STEPS} are "
         "warm-up)")


@dataclass(frozen=True)
class RunFigures:
    """The run's step time, tokens/s, TFLOP/s per GPU, MFU and HFU (None where unknown), and what they are over."""

    steps: int = 0  # the steady logged steps the step time is the median of
    step_time_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    hfu: Optional[float] = None
    source: str = ""  # "event log" (rank 0's iteration events) | "log lines" (elapsed time per iteration)

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            x = float(x)
        except (TypeError, ValueError):
            return None
    x = float(x)
    return x if math.isfinite(x) else None


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def steady(attempts: Iterable[Sequence[float]], warmup: int = WARMUP_STEPS) -> list[float]:
    """The steady step times: each attempt's logged step times (in order) without its first ``warmup``; all of
    them when that leaves none."""
    attempts = [[t for t in (_finite(x) for x in a) if t is not None and t > 0] for a in attempts]
    kept = [t for a in attempts for t in a[warmup:]]
    return kept or [t for a in attempts for t in a]


def figures(attempts: Iterable[Sequence[float]], *, tokens_per_step: Optional[float] = None,
            tflop_per_gpu_step: Optional[float] = None, peak: Optional[float] = None,
            mfu_seconds: Optional[float] = None, hfu_seconds: Optional[float] = None, source: str = "",
            warmup: int = WARMUP_STEPS) -> RunFigures:
    """The figures from each attempt's logged step times (seconds, in order); every rate is the work of one step
    over the step time: ``tokens_per_step``, ``tflop_per_gpu_step`` (TFLOP one GPU does in one step: the FLOPs of
    the global batch / GPUs / 1e12), MFU from ``peak`` (FLOP/s) or, where only the job's own MFU is known, from
    ``mfu_seconds`` (MFU x step time, the same for every step); HFU from ``hfu_seconds``. ``warmup=0`` for
    step times already without their warm-up."""
    times = steady(attempts, warmup)
    st = _median(times)
    if st is None:
        return RunFigures(source=source)
    tokens = tokens_per_step / st if tokens_per_step else None
    tflops = tflop_per_gpu_step / st if tflop_per_gpu_step else None
    mfu = mfu_seconds / st if mfu_seconds else tflops * 1e12 / peak if tflops is not None and peak else None
    hfu = hfu_seconds / st if hfu_seconds else None
    return RunFigures(len(times), st, tokens, tflops, mfu, hfu, source)


def _rank0(rank: Any) -> bool:
    r = _finite(rank)
    return r is None or int(r) == 0


def attempts_from_events(events: Iterable[Mapping[str, Any]]) -> list[list[float]]:
    """Each attempt's logged step times (``seconds`` of rank 0's ``iteration`` events, in order); an attempt
    begins at each ``job_start`` of rank 0."""
    attempts: list[list[float]] = [[]]
    for e in events:
        kind = e.get("event")
        if kind == "job_start" and _rank0(e.get("rank")):
            if attempts[-1]:
                attempts.append([])
        elif kind == "iteration" and _rank0(e.get("rank")):
            t = _finite(e.get("seconds"))
            if t is not None:
                attempts[-1].append(t)
    return [a for a in attempts if a]


def tflop_per_gpu_step(model: Any, global_batch_size: Optional[int], world_size: Optional[int],
                       tp: int = 1) -> Optional[float]:
    """TFLOP one GPU does in one step: :func:`analysis.flops.num_floating_point_operations` over the global batch
    / GPUs / 1e12; None without a model shape the formula takes."""
    if not model or not global_batch_size or not world_size:
        return None
    try:
        return num_floating_point_operations(model, int(global_batch_size), tp=int(tp or 1)) / int(world_size) / 1e12
    except (ValueError, TypeError, KeyError):
        return None


PRECISION_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "tf32", "fp8": "fp8"}  # training.precision -> peak


def peak_or_none(device: Optional[str], precision: str) -> Optional[float]:
    """The dense peak of ``device`` for ``training.precision`` (fp32 runs on TF32 tensor cores); None for no
    device, ``cpu`` or one the table lacks (MFU is never guessed)."""
    if not device or device == "cpu":
        return None
    try:
        return peak_flops(device, PRECISION_DTYPE.get(str(precision), str(precision)))
    except UnknownDevice:
        return None


def of_events(events: Iterable[Mapping[str, Any]], **kw: Any) -> RunFigures:
    """:func:`figures` over the event log's iteration events (``kw`` as for :func:`figures`)."""
    return figures(attempts_from_events(events), source="event log", **kw)


# -- how each figure is written: one function per quantity, so every view shows the same digits --------------

def _sig(v: float, sig: int = 3) -> str:
    if v == 0:
        return "0"
    digits = max(0, sig - 1 - int(math.floor(math.log10(abs(v)))))
    return f"{v:,.{digits}f}"


def step_time_text(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{_sig(v)} s"


def tokens_text(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:,.0f} tokens/s"


def tflops_text(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{_sig(v)} TFLOP/s/GPU"


def pct_text(v: Optional[float]) -> str:
    """MFU or goodput (a fraction) as a percentage with one decimal."""
    return "n/a" if v is None else f"{100 * v:.1f}%"


def line(f: RunFigures) -> str:
    """``step time 0.266 s, 1,968 tokens/s, 0.00334 TFLOP/s/GPU, MFU n/a``: the figures in one line."""
    return (f"step time {step_time_text(f.step_time_s)}, {tokens_text(f.tokens_per_s)}, "
            f"{tflops_text(f.tflops_per_gpu)}, MFU {pct_text(f.mfu)}")
