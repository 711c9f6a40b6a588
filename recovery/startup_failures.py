"""Start-up failures: a rank that fails before the start decision (an import, a version check, the process group
join), recorded so the start-up rule (:func:`recovery.policy.startup_decision`) can stop a chain of them.

One JSON file per attempt and failing rank under ``<run_dir>/startup/`` (:meth:`launch.paths.RunPaths.startup_failure`),
written atomically, so ranks of one attempt that fail at once never share a file: time, job id, attempt (its number
in the run, :mod:`launch.attempts`), restart count, rank, host, the error's first line, the phase and the traceback.

Torch-free: the worker writes and reads these before it imports torch or Megatron-Core.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from launch.attempts import _int, attempt_of
from launch.paths import RunPaths
from recovery.storage import atomic_write_json


def first_line(error: BaseException) -> str:
    """``ModuleNotFoundError: No module named 'megatron'``: the exception's type and first line."""
    said = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


def record_startup_failure(run_dir: Path, *, job_id: Optional[str], attempt: int, restart_count: int, rank: int,
                           host: str, error: str, phase: str, traceback: str = "",
                           clock: Callable[[], float] = time.time) -> Path:
    """Write this rank's start-up failure (one file per attempt and rank, atomically); returns its path."""
    path = RunPaths.of(run_dir).startup_failure(job_id, attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"time": clock(), "job_id": job_id, "attempt": int(attempt),
                             "restart_count": int(restart_count), "rank": int(rank), "host": host, "error": error,
                             "phase": phase, "traceback": traceback[-20000:]})
    return path


def startup_failures(run_dir: Path) -> dict:
    """``{(job, attempt): [record, ...]}``: the run's start-up failures, each attempt's records by rank."""
    out: dict = {}
    try:
        files = sorted(RunPaths.of(run_dir).startup.glob("*.json"))
    except OSError:
        return out
    for f in files:
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and _int(rec.get("attempt")) is not None:
            out.setdefault(attempt_of(rec), []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: _int(r.get("rank")) or 0)
    return out
