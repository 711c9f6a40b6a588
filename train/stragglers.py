"""Live stragglers and throughput regressions, while the job runs.

One slow GPU or host slows every rank (they wait for it in the next collective), so the wall
time of a step is the same everywhere and says nothing about *who* is slow. What differs is
each rank's own compute time. Every ``training.stragglers.interval`` steps the ranks share
theirs for the interval with one small all-gather (two floats per rank); a rank whose compute
time exceeds the median (``statistics.median_low``) by more than
``training.stragglers.threshold`` is logged with its host and recorded as a ``straggler``
event; ranks flagged in more than one interval are named in the end-of-attempt summary.

Compute time is the main thread's CPU time (``time.thread_time``): on CPU/gloo a rank
waiting in a collective sleeps, so waiting does not count. On GPUs the host thread mostly
waits on the device, so this is a proxy only; nvidia-resiliency-ext's straggler package
(CUPTI kernel timing) is the GPU-side measure.

A throughput regression is the run's own step time drifting up: the baseline is the median
step time of the first ``BASELINE_INTERVALS`` intervals of the attempt; ``regression_intervals``
consecutive intervals slower than ``baseline / (1 - regression_threshold)`` are one
``regression`` event (then it re-arms once throughput recovers).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from launch.kinds import EventKind
from launch.stragglers_config import StragglersConfig

BASELINE_INTERVALS = 2


def find_stragglers(compute_s: List[float], threshold: float) -> tuple[float, list[tuple[int, float]]]:
    """(median, [(rank, ratio to the median)]) for ranks slower than median x (1 + threshold)."""
    med = statistics.median_low(compute_s) if compute_s else 0.0
    if med <= 0:
        return med, []
    return med, [(r, c / med) for r, c in enumerate(compute_s) if c > med * (1.0 + threshold)]


@dataclass
class Regression:
    """The run's own step-time baseline and the sustained-drop detector (pure)."""

    threshold: float
    intervals: int
    baseline: Optional[float] = None
    warmup: List[float] = field(default_factory=list)
    slow_run: int = 0
    active: bool = False

    def update(self, step_s: float) -> Optional[dict]:
        """Feed one interval's median step time; returns an event dict when a drop becomes sustained."""
        if self.baseline is None:
            self.warmup.append(step_s)
            if len(self.warmup) >= BASELINE_INTERVALS:
                self.baseline = statistics.median(self.warmup)
            return None
        limit = self.baseline / (1.0 - self.threshold) if self.threshold < 1 else float("inf")
        if step_s > limit:
            self.slow_run += 1
        else:
            self.slow_run = 0
            self.active = False
        if self.slow_run >= self.intervals and not self.active:
            self.active = True
            return {"baseline_s": self.baseline, "step_s": step_s, "limit_s": limit,
                    "drop": 1.0 - self.baseline / step_s, "intervals": self.slow_run}
        return None


class LiveChecks:
    """Per-rank accumulator; ``check`` is collective (every rank calls it at the same steps)."""

    def __init__(self, settings: StragglersConfig, rank: int, world: int, hosts: List[str],
                 gather: Callable[[list], list], emit: Callable[..., Any], log: Callable[[str], None]) -> None:
        self.interval = int(settings.interval)
        self.threshold = float(settings.threshold)
        self.rank, self.world, self.hosts = rank, world, hosts
        self.gather, self.emit, self.log = gather, emit, log
        self.compute = 0.0
        self.steps: List[float] = []
        self.flagged: dict[int, int] = {}
        self.regression = Regression(float(settings.regression_threshold), int(settings.regression_intervals))

    def on_step(self, iteration: int, compute_s: float, step_s: float) -> None:
        if self.interval <= 0:
            return
        self.compute += compute_s
        self.steps.append(step_s)
        if iteration % self.interval == 0:
            self.check(iteration)

    def check(self, iteration: int) -> None:
        rows = self.gather([self.compute, statistics.median(self.steps) if self.steps else 0.0])
        compute = [float(r[0]) for r in rows]
        med, slow = find_stragglers(compute, self.threshold)
        for r, ratio in slow:
            self.flagged[r] = self.flagged.get(r, 0) + 1
            msg = (f"straggler: rank {r} on {self.hosts[r]} computed {compute[r]:.3f} s over the last "
                   f"{len(self.steps)} step(s), {ratio:.2f}x the median {med:.3f} s "
                   f"(training.stragglers.threshold {self.threshold:g})")
            self.log(f"WARNING: {msg}")
            self.emit(EventKind.STRAGGLER, step=iteration, rank_slow=r, host_slow=self.hosts[r], compute_s=compute[r],
                      median_s=med, ratio=ratio, steps=len(self.steps))
        ev = self.regression.update(float(rows[0][1]))
        if ev is not None:
            self.log(f"WARNING: throughput regression: median step {ev['step_s']:.3f} s vs the run's baseline "
                     f"{ev['baseline_s']:.3f} s for {ev['intervals']} interval(s) of {self.interval} steps "
                     f"(limit {ev['limit_s']:.3f} s = baseline / (1 - {self.regression.threshold:g}))")
            self.emit(EventKind.REGRESSION, step=iteration, **ev)
        self.compute = 0.0
        self.steps = []

    def summary(self) -> list[dict]:
        """Ranks flagged in more than one interval (named at the end of the attempt)."""
        return [{"rank": r, "host": self.hosts[r], "intervals": n} for r, n in sorted(self.flagged.items()) if n > 1]
