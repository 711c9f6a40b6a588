"""What an attempt is, counted once: its identity and the run's attempts.

An *attempt* is one launch of all the job's ranks: one ``srun`` step of a Slurm job (a requeue or an in-job
relaunch is another), one round of local processes (``cluster=local``). It is named ``(job, attempt)``:

* ``job``: the Slurm job id, or ``local`` for ``cluster=local``;
* ``attempt``: the event's ``attempt`` field when it has one (the local launcher numbers attempts across all its
  launches of a run, ``SLURMTRON_ATTEMPT``: a second ``python launch/pretrain.py`` of a run starts one past the
  last recorded attempt, so rank log names never repeat), else its ``restart_count`` (Slurm's count plus the
  in-job relaunches: unique within one job id).

The restart count (``SLURMTRON_RESTART_COUNT``) stays the count *within the chain* the requeue policy reads
(:mod:`recovery.policy`): a fresh launch is restart 0, a new chain, whatever its attempt number.

:func:`attempt_keys` is the one definition of the run's attempts: the local launcher's final line,
``launch/status.py``, the report (``analysis/figures.py``) and ``summary.json`` count with it. An attempt is known
from its rank 0 ``job_start``, any rank's ``startup_failed`` (:mod:`recovery.startup_failures`), and the ``stop`` /
``exit`` a refusal writes before ``job_start``; and from its rank logs where it wrote no event at all
(``logs/local_<attempt>_rank<r>.out``; Slurm's ``sacct -D`` plays that part for Slurm attempts, in
``launch/run_state.py``).

Part of the contract both sides read (login node, ranks, analysis): standard library only.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from launch.kinds import EventKind
from launch.paths import RunPaths

ATTEMPT_ENV = "SLURMTRON_ATTEMPT"  # set by the local launcher: this attempt's number in the run
LOCAL = "local"  # the job of a cluster=local attempt
_MARKS = (EventKind.STARTUP_FAILED, EventKind.STOP, EventKind.EXIT)  # any rank's: the attempt was launched
_LOCAL_LOG = re.compile(r"^local_(\d+)_rank\d+\.(?:out|err|log)$")  # RunPaths.rank_log(attempt, rank)


def _int(value: Any) -> Optional[int]:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def attempt_of(event: Mapping[str, Any]) -> tuple[str, int]:
    """``(job, attempt)`` of an event (or a start-up record): the job id or ``local``; the ``attempt`` field,
    else the restart count."""
    job = event.get("job_id")
    job = LOCAL if job in (None, "") or (isinstance(job, float) and math.isnan(job)) else str(job)
    attempt = _int(event.get("attempt"))
    if attempt is None:
        attempt = _int(event.get("restart_count")) or 0
    return job, attempt


def _rank0(rank: Any) -> bool:
    r = _int(rank)
    return r is None or r == 0


def attempt_keys(events: Iterable[Mapping[str, Any]], log_names: Iterable[str] = ()) -> set:
    """The run's attempts, as ``(job, attempt)``: see the module docstring. ``log_names``: the file names in the
    run's ``logs/`` (a local attempt killed before its first event still counts).

    An event log written before attempts were numbered has local attempts without an ``attempt`` field and without
    a job id, each a restart count from 0 again per launch: there each rank 0 ``job_start`` is an attempt of its
    own (they would merge by restart count)."""
    keys: set = set()
    legacy = 0
    for e in events:
        kind = e.get("event")
        old_local = _int(e.get("attempt")) is None and attempt_of(e)[0] == LOCAL
        if kind == EventKind.JOB_START and _rank0(e.get("rank")):
            if old_local:
                legacy += 1
                keys.add((LOCAL, f"launch-{legacy}"))
            else:
                keys.add(attempt_of(e))
        elif kind in _MARKS and not old_local:
            keys.add(attempt_of(e))
    numbered = {k for k in keys if isinstance(k[1], int)}
    for name in log_names:
        m = _LOCAL_LOG.match(name)
        if m and (LOCAL, int(m.group(1))) not in numbered and not legacy:
            keys.add((LOCAL, int(m.group(1))))
    return keys


def attempt_count(events: Iterable[Mapping[str, Any]], log_names: Iterable[str] = ()) -> int:
    """How many attempts the run made (:func:`attempt_keys`)."""
    return len(attempt_keys(events, log_names))


def log_names(run_dir: Path) -> list[str]:
    """The file names in the run's ``logs/`` ([] without one)."""
    try:
        return sorted(p.name for p in RunPaths.of(run_dir).logs.iterdir() if p.is_file())
    except OSError:
        return []


def next_attempt(run_dir: Path, events: Iterable[Mapping[str, Any]] = (), startup_keys: Iterable = ()) -> int:
    """The number of a local launch's first attempt: one past the last attempt the run recorded (in its events,
    its start-up failures' keys, or its rank log names), 0 for a new run. No attempt's log file is ever reused."""
    seen = [a for j, a in attempt_keys(events) if j == LOCAL and isinstance(a, int)]
    seen += [a for j, a in startup_keys if j == LOCAL]
    seen += [int(m.group(1)) for n in log_names(run_dir) if (m := _LOCAL_LOG.match(n))]
    return max(seen) + 1 if seen else 0
