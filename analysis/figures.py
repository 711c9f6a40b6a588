"""The figures a run is reported by, each computed once: ``launch/status.py``, the report (``report.md``,
``report.html``, its text) and ``summary.json`` all read them from here, so the same run shows the same number
everywhere.

* :func:`layout_of`: the layout label of an attempt, from its ``job_start`` event: the worker writes the job's own
  label there (``layout_label``, e.g. ``tp2-pp1-nodo-dp2``); event logs written before it carry only the sizes,
  labelled by :func:`analysis.mfu.layout_label`.
* :func:`attempt_count`: the run's attempts as :func:`launch.attempts.attempt_keys` defines them (the one
  definition the launcher and ``status`` use too): every ``(job, attempt)`` its events know, an attempt that
  failed before its first step included.
* The run's step time, tokens/s, TFLOP/s and MFU are :mod:`analysis.throughput`'s (no pandas: the ranks show
  them too).

No torch; ``launch/`` (status) imports this on the login node.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional

from analysis.mfu import layout_label
from launch.kinds import EventKind
from launch import attempts


def layout_of(event: Mapping[str, Any]) -> Optional[str]:
    """``tp2-pp1-nodo-dp2``: the attempt's layout label from its ``job_start`` event (None without one)."""
    label = event.get("layout_label")
    if isinstance(label, str) and label:
        return label
    return layout_label(event.get("layout"))


def _starts(events: Iterable[Mapping[str, Any]]) -> list:
    return [e for e in events if e.get("event") == EventKind.JOB_START and _rank0(e.get("rank"))]


def _rank0(rank: Any) -> bool:
    try:
        return rank is None or (isinstance(rank, float) and math.isnan(rank)) or int(rank) == 0
    except (TypeError, ValueError):
        return False


def attempt_count(events: Iterable[Mapping[str, Any]], log_names: Iterable[str] = ()) -> int:
    """Attempts of the run (:func:`launch.attempts.attempt_count`)."""
    return attempts.attempt_count(events, log_names)


def run_layout(events: Iterable[Mapping[str, Any]], default: Optional[str] = None) -> Optional[str]:
    """The layout of the run's latest attempt (``default``, the config's label, before any attempt started)."""
    starts = _starts(events)
    return (layout_of(starts[-1]) if starts else None) or default


def _median(xs: list) -> Optional[float]:
    xs = sorted(float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def save_figures(events: Iterable[Mapping[str, Any]]) -> dict:
    """The checkpoint figures of a run from its events: committed saves with the three numbers of each
    (``checkpoint_cost``: training blocked, durable, step-time dip while the writer ran; medians), failed saves
    (``save_failed``, by cause), abandoned writes (``checkpoint_abandoned``) and the replay checks
    (``replay_match`` / ``replay_mismatch``)."""
    ev = [e for e in events if _rank0(e.get("rank"))]
    cost = [e for e in ev if e.get("event") == EventKind.CHECKPOINT_COST]
    failed = [e for e in ev if e.get("event") == EventKind.SAVE_FAILED]
    by_cause: dict = {}
    for e in failed:
        by_cause[str(e.get("cause"))] = by_cause.get(str(e.get("cause")), 0) + 1
    return {
        "saves": len(cost),
        "blocked_s": _median([e.get("blocked_s") for e in cost]),
        "durable_s": _median([e.get("durable_s") for e in cost]),
        "step_time_dip": _median([e.get("dip") for e in cost]),
        "failed": len(failed), "failed_by_cause": by_cause,
        "abandoned": sum(1 for e in ev if e.get("event") == EventKind.CHECKPOINT_ABANDONED),
        "replay_matches": sum(1 for e in ev if e.get("event") == EventKind.REPLAY_MATCH),
        "replay_mismatches": sum(1 for e in ev if e.get("event") == EventKind.REPLAY_MISMATCH),
    }
