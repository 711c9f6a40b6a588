"""What a run spends: the ledger arithmetic that ``status``, the report, the submit check and the ranks share.

A run's spend is ``GPUs x seconds`` summed over every attempt it made, failed and cancelled ones included,
in hours: GPU-hours on a GPU cluster, process-hours on ``cluster.gpu=cpu`` (``cluster=local`` counts its
processes). Two sources, the first that has an answer wins:

* **Slurm's accounting** (``sacct -X -D``: one row per allocation, every requeued attempt kept): ``ElapsedRaw``
  (seconds) x the GPU count of ``AllocTRES`` (``gres/gpu=16``); a row without a GPU count counts the run's world
  size. A running allocation's elapsed time grows, so the answer is "so far".
* **the run's own events** (``events.jsonl``): each attempt from its ``job_start`` to its last event (to now
  while it runs) x its ``world_size``. Start-up before ``job_start`` (imports, the process group) is not in it:
  the event ledger is a floor of what the allocation cost.

The budget (``run.budget_gpu_hours``) is compared with the spend: WARNING lines and ``budget_warning`` events at
:data:`THRESHOLDS` of it, and when the spend projected to the target at the measured step time passes it; the
ranks stop the run (reason ``budget``) once the spend reaches it. Pure functions, no torch, no pandas.
"""
from __future__ import annotations

import math
import sys
from datetime import datetime
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

from launch.kinds import EventKind

THRESHOLDS = (0.5, 0.8, 0.95)  # fractions of the budget that are a WARNING line and a budget_warning event
PROJECTED = "projected"  # the budget_warning of the spend projected to the target
_GPU_TRES = re.compile(r"gres/gpu(?::[^=,]*)?=(\d+)")


def hours(spans: Iterable[tuple[float, float]]) -> float:
    """Sum of ``units x seconds`` over ``(units, seconds)`` spans, in hours (negative parts count as 0)."""
    return sum(max(0.0, float(u)) * max(0.0, float(s)) for u, s in spans) / 3600.0


def _number(value: object) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _attempts(events: Sequence[Mapping], world_size: int) -> list[list]:
    """``[ranks, start, last event time]`` of each attempt of the event log, in order."""
    out: list[list] = []
    for e in events:
        t = _number(e.get("time"))
        if t is None:
            continue
        if e.get("event") == EventKind.JOB_START:
            ws = _number(e.get("world_size"))
            out.append([int(ws) if ws and ws >= 1 else world_size, t, t])
        elif out:
            out[-1][2] = t
    return out


def event_spans(events: Sequence[Mapping], *, now: Optional[float] = None, world_size: int = 0) -> list[tuple]:
    """``(ranks, seconds)`` of every attempt in the event log: from its ``job_start`` to its last event; the
    last attempt runs to ``now`` when given (it is still running). Every attempt counts, however it ended."""
    att = _attempts(events, world_size)
    if att and now is not None:
        att[-1][2] = max(att[-1][2], now)
    return [(w, last - start) for w, start, last in att]


def clip(events: Sequence[Mapping], since: float, *, world_size: int = 0) -> list[tuple]:
    """:func:`event_spans` counting only the time after ``since`` (a quota's period)."""
    return [(w, last - max(start, since)) for w, start, last in _attempts(events, world_size) if last > since]


def tres_gpus(alloc_tres: str) -> Optional[int]:
    """The GPU count of an ``AllocTRES`` field (``billing=8,cpu=8,gres/gpu=4,node=1`` -> 4), None without one;
    typed counts (``gres/gpu:h100=4``) are summed with the untyped one only when it is absent."""
    plain = re.findall(r"gres/gpu=(\d+)", alloc_tres or "")
    if plain:
        return sum(int(x) for x in plain)
    typed = _GPU_TRES.findall(alloc_tres or "")
    return sum(int(x) for x in typed) if typed else None


SACCT_FORMAT = "JobID,ElapsedRaw,AllocTRES,State,Start,End"  # what :func:`sacct_spans` reads (``sacct -X -D -n -P``)


def warning(line: str) -> None:
    """How the login side and the ranks say an accounting row was not taken as Slurm gave it: a WARNING line."""
    print(f"WARNING: {line}", file=sys.stderr, flush=True)


def _when(text: str) -> Optional[float]:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def sacct_spans(text: str, *, world_size: int = 0, warn: Callable[[str], None] = lambda _line: None) -> list[tuple]:
    """``(GPUs, seconds)`` of every allocation in ``sacct -X -D -n -P --format=`` :data:`SACCT_FORMAT` output
    (every attempt of a requeued job is its own row, oldest first); a pending row (no elapsed time) is no span, a
    row without a GPU count in AllocTRES counts ``world_size``. Lines that are not such rows are skipped.

    A *phantom* row: an attempt whose End is ``Unknown`` although a later attempt of the same job exists, or although
    it is not running (Slurm 22.05 leaves one when a ``--no-kill`` job that lost nodes is requeued; its elapsed time
    keeps growing after the job has ended). Its time is capped at the next attempt's start (counted to there) or,
    with nothing to cap it by, not counted; either way with one ``warn`` line."""
    rows = []
    for line in (text or "").splitlines():
        cols = line.strip().split("|")
        if len(cols) < 3 or "." in cols[0]:  # a step (123.batch), not an allocation
            continue
        try:
            seconds = float(cols[1])
        except ValueError:
            continue
        rows.append(cols + [""] * (6 - len(cols)))
    spans = []
    for i, (job, _elapsed, tres, state, start, end, *_rest) in enumerate(rows):
        seconds = float(rows[i][1])
        later = next((r for r in rows[i + 1:] if r[0] == job), None)
        if end.strip() == "Unknown" and (later is not None or not state.startswith("RUNNING")):
            t0, t1 = _when(start), _when(later[4]) if later is not None else None
            capped = t1 - t0 if t0 is not None and t1 is not None and 0 <= t1 - t0 < seconds else None
            warn(f"sacct: job {job}'s attempt that started {start or '?'} ({state}) has End=Unknown after "
                 + ("a later attempt started" if later is not None else "it stopped running")
                 + f" (its elapsed time {seconds:.0f} s keeps growing): "
                 + (f"counted up to the next attempt's start, {capped:.0f} s" if capped is not None else "not counted"))
            seconds = capped or 0.0
        if seconds <= 0:
            continue
        gpus = tres_gpus(tres)
        spans.append((gpus if gpus is not None else world_size, seconds))
    return spans


@dataclass(frozen=True)
class Ledger:
    """A run's spend against its budget: ``spent`` hours so far (from ``source``: sacct | events), the
    ``budget`` (None: none), and ``projected``, the spend at the target at the measured step time."""

    spent: float
    source: str
    budget: Optional[float] = None
    projected: Optional[float] = None
    unit: str = "GPU-hours"

    @property
    def fraction(self) -> Optional[float]:
        return self.spent / self.budget if self.budget else None

    @property
    def over(self) -> bool:
        return self.budget is not None and self.budget > 0 and self.spent >= self.budget

    def line(self) -> str:
        """``0.42 of 1 GPU-hours budget (42.0%); projected 0.9 at the target`` (no budget: the spend alone)."""
        u = self.unit
        text = f"{fmt(self.spent)} {u}"
        if self.budget:
            text += f" of a {fmt(self.budget)} {u} budget ({100 * self.spent / self.budget:.1f}%)"
        if self.projected is not None:
            text += f"; projected {fmt(self.projected)} {u} at the target"
            if self.budget and self.projected > self.budget:
                text += " (over the budget)"
        return text


def fmt(h: float) -> str:
    """Hours with the digits that matter: 1,234 / 12.3 / 0.0421."""
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


def project(spent: float, steps_left: int, step_s: Optional[float], units: int) -> Optional[float]:
    """The spend at the target: ``spent + steps_left x step_s x units / 3600``; None without a step time."""
    if not step_s or step_s <= 0 or units <= 0:
        return None
    return spent + max(0, steps_left) * step_s * units / 3600.0


def crossed(fraction: float, done: Iterable[float], thresholds: Sequence[float] = THRESHOLDS) -> list[float]:
    """The thresholds ``fraction`` (spent / budget) has reached that are not in ``done`` (already announced,
    in this attempt or an earlier one), lowest first."""
    seen = {round(float(d), 6) for d in done if _number(d) is not None}
    return [t for t in thresholds if fraction >= t and round(t, 6) not in seen]


def announced(events: Iterable[Mapping], budget: float) -> set:
    """The thresholds already announced for this budget (``budget_warning`` events with the same budget): a
    raised budget starts its own warnings."""
    out: set = set()
    for e in events:
        if e.get("event") == EventKind.BUDGET_WARNING and _number(e.get("budget")) == float(budget):
            thr = e.get("threshold")
            out.add(thr if thr == PROJECTED else _number(thr))
    return out


def warning_text(threshold: float, ledger: Ledger) -> str:
    """The WARNING line of a crossed threshold."""
    return (f"WARNING: budget: {int(round(threshold * 100))}% of run.budget_gpu_hours spent ({ledger.line()}); the "
            "run stops itself with a checkpoint at 100% (raise run.budget_gpu_hours and resubmit to go on)")


def projected_text(ledger: Ledger) -> str:
    return (f"WARNING: budget: the spend projected to the target passes run.budget_gpu_hours ({ledger.line()}); "
            f"the run will stop itself at the budget unless run.budget_gpu_hours is raised to "
            f"{math.ceil((ledger.projected or 0) * 1000) / 1000:g}")


def stop_text(ledger: Ledger, step: int, run_name: str) -> str:
    """The one line of a budget stop."""
    return (f"budget: {ledger.line()} at iteration {step}: stopped with a verified checkpoint, not requeued; "
            f"to go on, resubmit the same python launch/pretrain.py command (run.name={run_name}, with its "
            f"cluster= and every other override) adding run.budget_gpu_hours=<more>")


def of_run(config: Optional[Mapping], events: Sequence[Mapping], allocations: Sequence[tuple] = ()) -> dict:
    """The report's ledger of one run: ``{"spent", "source", "budget", "unit", "line"}``. ``allocations`` are
    Slurm's ``(GPUs or None, elapsed seconds)`` rows (one per attempt); without them, the event log."""
    cfg = config if isinstance(config, Mapping) else {}
    cluster = cfg.get("cluster") if isinstance(cfg.get("cluster"), Mapping) else {}
    run = cfg.get("run") if isinstance(cfg.get("run"), Mapping) else {}
    world = 0
    try:
        world = int(cluster.get("nodes") or 1) * int(cluster.get("gpus_per_node") or 0)
    except (TypeError, ValueError):
        pass
    budget = _number(run.get("budget_gpu_hours"))
    u = "process-hours" if cluster.get("gpu") == "cpu" else "GPU-hours"
    spans = [(g if _number(g) is not None else world, e) for g, e in allocations if _number(e) is not None]
    source = "sacct"
    if not spans:
        spans, source = event_spans(events, world_size=world), "events"
    led = Ledger(hours(spans), source, budget if budget and budget > 0 else None, None, u)
    return {"spent": led.spent, "source": source, "budget": led.budget, "unit": u,
            "line": led.line() + (" (Slurm accounting, every attempt)" if source == "sacct" else
                                  " (event log: each attempt from its start to its last event)")}

