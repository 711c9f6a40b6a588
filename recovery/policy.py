"""The one requeue policy: when to start, when to stop, how to come back.

Exit codes of ``python -m train.worker``: the one table is :data:`recovery.exit_codes.EXIT_CODES` (name, code,
final or not, meaning); this module re-exports its names. After a final code neither the local launcher nor
``recovery.crash`` starts another attempt, because another attempt would meet the same refusal (a full disk does
not empty itself; an unreadable file does not fix its permissions). The run stops with the
reason in ``events.jsonl`` (a ``stop`` event) and on the terminal.

How a stop becomes a requeue
----------------------------
Every rank handles the warning signal (SIGUSR2, ``--signal=USR2@<lead>``, delivered to the
job steps, i.e. to each srun task directly) and SIGTERM (preemption, ``scancel``) by setting
a flag (:mod:`recovery.signals`). At the next step boundary the ranks agree, save a
distributed checkpoint and commit it; then rank 0 calls :func:`after_stop_save`, which runs
``scontrol requeue $SLURM_JOB_ID`` and returns 42 for every rank to exit with.

Why ``scontrol requeue`` from inside the job:

* ``#SBATCH --requeue`` alone is not enough: Slurm requeues on NODE_FAIL (and preemption with
  ``PreemptMode=REQUEUE``) but **not on TIMEOUT**: a job that hits its time limit ends
  TIMEOUT with Restarts=0, so a wall-time-sliced run would simply stop. (Seen on Slurm 22.05;
  ``../shared/notes/real-slurm-locally.md``.)
* ``RequeueExit=42`` would requeue on our exit code, but it is a *site* setting in
  slurm.conf that users cannot set and most clusters do not; a toolkit cannot rely on it.
  We still exit 42, so a site that has it configured gets a second, independent trigger.
* ``scontrol requeue`` is an ordinary user command on one's own job, keeps the job id,
  increments ``SLURM_RESTART_COUNT`` (which the zero-progress guard and the restart limit
  read) and with ``--open-mode=append`` keeps appending to the same log. It needs the job
  to have been submitted requeue-able (the renderer adds ``--requeue``) and the site to
  allow it (``cluster.requeue_allowed``; sites that forbid it use a dependency chain of
  continuation jobs instead, ``run.dependency_chain``).

SIGTERM: preemption vs scancel. Both deliver SIGTERM to the job steps, and a handler cannot
tell them apart; rank 0 asks Slurm after the stop checkpoint (:mod:`recovery.stop`), and only
a stop Slurm explains as a preemption, a time limit or a node failure (or a user's
``scancel --signal=USR2``) comes here.

* Preemption (``PreemptMode=REQUEUE`` with ``GraceTime``): the steps get SIGTERM at once,
  SIGKILL after the grace time. Slurm requeues the job itself *only if it does not fail
  first*: a task that dies on the SIGTERM makes it FAILED (143), not requeued. Our ranks
  catch SIGTERM, save within the grace time, and exit 42 after asking for the requeue, so
  the job comes back either way (seen on the test cluster).
* ``scancel`` (the job is being cancelled): ``scontrol requeue`` would *succeed* on the
  cancelled job (Slurm 22.05 requeues finished batch jobs), so the ranks never call this for
  a cancel: they exit 0 and the job ends CANCELLED.

Every decision here takes its environment, runner, clock and files as arguments.
No torch: the renderer and planner import this module on the login node.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery.exit_codes import (  # noqa: F401  (re-exported: the policy's vocabulary)
    EXIT_BAD_CONFIG, EXIT_CKPT_MISMATCH, EXIT_COMPLETED, EXIT_CRASH, EXIT_DISK_FULL, EXIT_FOREIGN, EXIT_MAX_RESTARTS,
    EXIT_NAN, EXIT_NO_LOADABLE, EXIT_REQUEUE, EXIT_RUN_LOCKED, EXIT_SHARED_CKPT, EXIT_STORAGE, EXIT_UNSAFE_CKPT,
    EXIT_BUDGET, EXIT_OOM, EXIT_REPLAY_MISMATCH, EXIT_UNSUPPORTED, EXIT_ZERO_PROGRESS, FINAL_CODES, FINAL_REASONS, REFUSAL_CODES, code_name,
)
from launch import attempts
from recovery import startup_failures
from recovery.slurm import Runner, Slurm, default_runner
from recovery.storage import LocalStorage, atomic_write_json


@dataclass
class Decision:
    """Whether a (re)start may train. ``code`` is the exit code when ``ok`` is False."""

    ok: bool
    reason: str  # "start" | "resume" | "zero_progress" | "max_restarts"
    code: int = EXIT_COMPLETED
    detail: str = ""


IN_JOB_OFFSET = "SLURMTRON_IN_JOB_OFFSET"  # in-job relaunches this job made before this step (recovery/injob.py)


def slurm_restart_count(env: Mapping[str, str]) -> int:
    """``SLURM_RESTART_COUNT`` (set by Slurm on a requeued job), else ``SLURMTRON_RESTART_COUNT``
    (set by the local launcher and by dependency-chain continuations), else 0: Slurm's own count."""
    for key in ("SLURM_RESTART_COUNT", "SLURMTRON_RESTART_COUNT"):
        raw = env.get(key)
        if raw not in (None, ""):
            try:
                return max(0, int(str(raw).strip()))
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not an integer") from None
    return 0


def restart_count_from_env(env: Mapping[str, str]) -> int:
    """This attempt's restart count: Slurm's (:func:`slurm_restart_count`) plus the in-job relaunches the job
    made before this step (``SLURMTRON_IN_JOB_OFFSET``, exported by the batch script's in-job loop), so every
    ``srun`` step of an allocation is an attempt of its own for the restart limit, the zero-progress guard,
    the event log and the hang directory, and the count never goes back after a requeue."""
    raw = env.get(IN_JOB_OFFSET)
    try:
        offset = max(0, int(str(raw).strip())) if raw not in (None, "") else 0
    except ValueError:
        raise ValueError(f"{IN_JOB_OFFSET}={raw!r} is not an integer") from None
    return slurm_restart_count(env) + offset


def attempt_from_env(env: Mapping[str, str]) -> int:
    """This attempt's number in the run (:mod:`launch.attempts`): ``SLURMTRON_ATTEMPT`` (the local launcher numbers
    attempts across its launches of a run), else the restart count (Slurm: unique within the job id)."""
    raw = env.get(attempts.ATTEMPT_ENV)
    if raw not in (None, ""):
        try:
            return max(0, int(str(raw).strip()))
        except ValueError:
            raise ValueError(f"{attempts.ATTEMPT_ENV}={raw!r} is not an integer") from None
    return restart_count_from_env(env)


# ---- the start-up rule: attempts that never reached the start decision ---------------------

def startup_decision(run_dir: Path, env: Mapping[str, str], training: Any) -> Decision:
    """Every rank, before it imports torch or Megatron-Core: may this attempt try to start?

    Refuses (reason ``zero_progress``, exit 3, final) when the last ``training.zero_progress_restarts`` attempts of
    the current chain all failed to start (:func:`recovery.startup_failures.startup_failures`: an import, a version check,
    the process group join), so a missing package is one line and a stop, not a requeue loop. The chain is the one
    of :func:`start_decision`: a fresh launch (restart count 0) starts a new one, so a user who fixed the
    environment and launches again is not refused. The previous attempts of the chain are this job's attempts
    ``attempt - 1`` ... ``attempt - n`` (the restart count says how many exist). ``zero_progress_restarts <= 0``
    disables the rule."""
    n = int(getattr(training, "zero_progress_restarts"))
    restart = restart_count_from_env(env)
    attempt = attempt_from_env(env)
    if n <= 0 or restart < n:
        return Decision(ok=True, reason="start")
    job = attempts.attempt_of({"job_id": env.get("SLURM_JOB_ID"), "attempt": attempt})[0]
    failed = startup_failures.startup_failures(Path(run_dir))
    last = [failed.get((job, attempt - k)) for k in range(1, n + 1)]
    if not all(last):
        return Decision(ok=True, reason="start")
    first = last[0][0]
    hosts = sorted({str(r.get("host")) for recs in last for r in recs})
    error = str(first.get("error") or "an error")
    what = _unimportable(error)
    return Decision(
        ok=False, reason="zero_progress", code=EXIT_ZERO_PROGRESS,
        detail=f"{what + ' is not importable' if what else 'the ranks could not start'} on "
               f"{'node' if len(hosts) == 1 else 'nodes'} {', '.join(hosts)}: {error} (the last {n} attempts failed "
               f"before their first step, training.zero_progress_restarts={n}; the records are in "
               f"{RunPaths.of(run_dir).startup}; fix the environment and launch again)")


def _unimportable(error: str) -> Optional[str]:
    """``megatron`` of ``ModuleNotFoundError: No module named 'megatron'`` (an import error), else None."""
    if not error.startswith(("ModuleNotFoundError", "ImportError")):
        return None
    quoted = error.split("'")
    return quoted[1].split(".")[0] if len(quoted) >= 3 and quoted[1] else None


# ---- small JSON files written atomically ------------------------------------------------

def _read_json_list(path: Path) -> list:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return doc if isinstance(doc, list) else []


# ---- start decision: restart limit and zero-progress guard -----------------------------

def read_progress(run_dir: Path) -> list[dict]:
    """The per-attempt start records, oldest first."""
    return [r for r in _read_json_list(RunPaths.of(run_dir).progress) if isinstance(r, dict)]


def start_decision(
    run_dir: Path,
    restart_count: int,
    latest_step: Optional[int],
    training: Any,
    *,
    clock: Callable[[], float] = time.time,
    job_id: Optional[str] = None,
    storage: Optional[LocalStorage] = None,
) -> Decision:
    """Rank 0, before building the model: may this attempt train?

    Records the attempt (restart count, the step it resumes from) in
    ``<run_dir>/progress.json``, then refuses when

    * more than ``training.max_restarts`` of the chain's restarts were *unplanned* (reason ``max_restarts``,
      exit 4; :func:`restart_tally`): a crash, a hang, a node failure, a time limit that got no signal. A
      planned requeue (the attempt before saved a verified stop checkpoint on the warning signal or a
      preemption and asked for the requeue, :func:`after_stop_save`) is not a failure and never counts, so a
      run of a thousand wall-time slices is not stopped at slice ``max_restarts + 1``; or
    * the last ``training.zero_progress_restarts`` consecutive restarts all started from the
      same checkpoint step as the attempt before them (or all from none): those restarts
      made no new checkpoint, so another one will not either (a deterministic crash, a
      wall-time slice shorter than a save interval with no signal, a bad node). Reason
      ``zero_progress``, exit 3. This is what stops the endless requeue loop of
      Megatron-Bridge PR #4765.

    A record with restart count 0 is a fresh submission: it starts a new chain, so a user
    who fixed the cause and resubmits is not refused. (Continuation jobs of a dependency
    chain export ``SLURMTRON_RESTART_COUNT`` so they count as restarts.)
    ``zero_progress_restarts <= 0`` disables the guard.
    """
    run_dir = Path(run_dir)
    records = read_progress(run_dir)
    record = {
        "time": clock(),
        "restart_count": int(restart_count),
        "latest_step": latest_step,
        "job_id": job_id,
    }
    max_restarts = int(getattr(training, "max_restarts"))
    n = int(getattr(training, "zero_progress_restarts"))
    chain = current_chain(records + [record])
    unplanned, planned = restart_tally(chain[:-1], int(restart_count))
    decision: Decision
    if unplanned > max_restarts:
        decision = Decision(
            ok=False, reason="max_restarts", code=EXIT_MAX_RESTARTS,
            detail=f"{unplanned} unplanned restarts (restart count {restart_count} - {planned:,} planned slice "
                   f"requeues, which are not counted) > training.max_restarts {max_restarts}; raise "
                   f"training.max_restarts or find out why the job keeps failing (events.jsonl)",
        )
    else:
        same = 0  # consecutive restarts (newest first) that started where their predecessor did
        for prev, cur in zip(reversed(chain[:-1]), reversed(chain[1:])):
            if cur["latest_step"] == prev["latest_step"]:
                same += 1
            else:
                break
        where = "no checkpoint" if latest_step is None else f"checkpoint step {latest_step}"
        if n > 0 and restart_count > 0 and same >= n:
            decision = Decision(
                ok=False, reason="zero_progress", code=EXIT_ZERO_PROGRESS,
                detail=f"the last {same} consecutive restarts all started from {where}: no new "
                       f"checkpoint was written in between (training.zero_progress_restarts={n}). "
                       f"A deterministic crash, a time limit shorter than one checkpoint interval "
                       f"without a warning signal, or a bad node; see the logs and events.jsonl",
            )
        else:
            decision = Decision(
                ok=True, reason="resume" if latest_step is not None else "start",
                detail=f"restart {restart_count} ({unplanned}/{max_restarts} unplanned, {planned} planned) from "
                       f"{where}; {same} consecutive restart(s) without progress (limit {n})",
            )
    record["decision"] = decision.reason
    atomic_write_json(RunPaths.of(run_dir).progress, records + [record], storage)
    return decision


PLANNED_STOP = "planned_stop"  # a progress record's mark: its attempt ended with a verified stop checkpoint


def restart_tally(predecessors: list[dict], restart_count: int) -> tuple[int, int]:
    """``(unplanned, planned)`` restarts of an attempt with ``restart_count``, given the progress records of its
    chain before it (:func:`current_chain`). A restart is planned when the attempt before it carries the
    :data:`PLANNED_STOP` mark (:func:`mark_planned_stop`, written by rank 0 once the stop checkpoint is committed
    and before it asks for the requeue, so a crash cannot leave one); every other restart is unplanned, including
    attempts that left no record (they failed before the start decision). Pure."""
    planned = sum(1 for r in predecessors
                  if r.get(PLANNED_STOP) is not None and int(r.get("restart_count") or 0) < restart_count)
    planned = min(planned, max(0, restart_count))
    return max(0, restart_count) - planned, planned


def mark_planned_stop(run_dir: Path, restart_count: int, job_id: Optional[str], step: int, *,
                      clock: Callable[[], float] = time.time, storage: Optional[LocalStorage] = None) -> bool:
    """Mark this attempt's progress record (the newest with ``restart_count`` and ``job_id``) as ended by a
    planned stop at the verified stop checkpoint ``step``, so the requeue it asks for next is not counted
    against ``training.max_restarts`` (:func:`restart_tally`). False when no record matches (the next restart
    then counts as unplanned)."""
    records = read_progress(run_dir)
    for r in reversed(records):
        if int(r.get("restart_count") or 0) == int(restart_count) and (r.get("job_id") or None) == (job_id or None):
            r[PLANNED_STOP] = {"step": int(step), "time": clock()}
            atomic_write_json(RunPaths.of(run_dir).progress, records, storage)
            return True
    return False


def current_chain(records: list[dict]) -> list[dict]:
    """The records since (and including) the newest fresh submission (restart count 0)."""
    start = 0
    for i, r in enumerate(records):
        if int(r.get("restart_count") or 0) == 0:
            start = i
    return records[start:]


# ---- after the stop checkpoint ----------------------------------------------------------

def after_stop_save(
    signum: int,
    env: Mapping[str, str],
    runner: Runner = default_runner,
    *,
    requeue_allowed: bool = True,
    events: Any = None,
    step: Optional[int] = None,
    requeued_by_slurm: bool = False,
    run_dir: Optional[Path] = None,
    storage: Optional[LocalStorage] = None,
) -> int:
    """Rank 0, once the stop checkpoint is committed: ask Slurm for a requeue; return the exit code.

    Under Slurm (``SLURM_JOB_ID`` set) with ``requeue_allowed``, runs
    ``scontrol requeue <job id>`` (see the module docstring for why, and for SIGTERM from
    preemption vs ``scancel``). Outside Slurm there is nothing to call: the local launcher
    relaunches on exit 42. Returns :data:`EXIT_REQUEUE` in every case, so every rank exits
    42 and a site's ``RequeueExit=42`` also works. ``requeued_by_slurm`` (Slurm already requeued the job:
    an admin's ``scontrol requeue``, a preemption whose grace ended) skips the call. If ``events`` (an
    :class:`recovery.events.EventLog`) is given, emits ``requeue`` with the method used.

    ``run_dir`` and ``step`` given (the caller committed and verified the stop checkpoint at ``step``): before
    anything else, marks this attempt's progress record planned (:func:`mark_planned_stop`), so the restart it
    leads to is a planned slice requeue, not one of ``training.max_restarts``. A stop without a checkpoint
    (a signal during start-up, a save that failed) passes neither and counts.
    """
    job_id = env.get("SLURM_JOB_ID") or ""
    planned = False
    unmarked = ""
    if run_dir is not None and step is not None:
        restart = restart_count_from_env(env)
        planned = mark_planned_stop(Path(run_dir), restart, job_id or None, step, storage=storage)
        if not planned:
            unmarked = (f"WARNING: no progress record of restart {restart} (job {job_id or 'local'}) in "
                        f"{RunPaths.of(run_dir).progress}: this requeue counts against training.max_restarts")
            print(unmarked, flush=True)
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
    method = "exit_code"
    detail = ""
    if job_id and requeued_by_slurm:  # an admin's `scontrol requeue`, a preemption: asking again would fail
        method = "slurm"
        detail = f"Slurm had already requeued job {job_id} (its restart count is above this attempt's)"
    elif job_id and requeue_allowed:
        r = Slurm(runner).requeue(job_id)
        if r.ok:
            method = "scontrol"
        elif "pending execution" in r.words.lower():  # requeued meanwhile (Slurm's own requeue won the race)
            method = "slurm"
            detail = f"Slurm had already requeued job {job_id} (scontrol requeue: {r.words})"
        else:
            detail = f"scontrol requeue {job_id} failed (rc {r.rc}): {r.words}"
    elif job_id:
        detail = "cluster.requeue_allowed is false: not requeueing (dependency chain continues)"
    else:
        detail = "not under Slurm: the local launcher relaunches on exit 42"
    if events is not None:
        events.emit(EventKind.REQUEUE, method=method, step=step, signal=name, job_id_requeued=job_id or None,
                    planned=planned, detail="; ".join(d for d in (detail, unmarked) if d))
    return EXIT_REQUEUE


# ---- failed nodes -------------------------------------------------------------------------

def record_failed_node(
    run_dir: Path,
    host: str,
    reason: str,
    *,
    clock: Callable[[], float] = time.time,
    job_id: Optional[str] = None,
) -> list[dict]:
    """Append ``{"host","reason","time","job_id"}`` to ``<run_dir>/failed_nodes.json``.

    The renderer turns the hosts into ``--exclude`` for the next submission, so a node that
    crashed a rank (ECC errors, a dead NIC) does not take the requeued job down again.
    ``job_id`` defaults to ``SLURM_JOB_ID`` from the environment. Returns the new list.
    """
    if not host:
        raise ValueError("record_failed_node: host is empty")
    path = RunPaths.of(run_dir).failed_nodes
    nodes = failed_nodes(run_dir)
    nodes.append({
        "host": host,
        "reason": reason,
        "time": clock(),
        "job_id": job_id if job_id is not None else os.environ.get("SLURM_JOB_ID"),
    })
    atomic_write_json(path, nodes)
    return nodes


def failed_nodes(run_dir: Path) -> list[dict]:
    """The recorded failures, oldest first ([] if none or unreadable)."""
    return [n for n in _read_json_list(RunPaths.of(run_dir).failed_nodes)
            if isinstance(n, dict) and n.get("host")]


# ---- lead time -------------------------------------------------------------------------------

def lead_time_warning(lead_s: float, step_s: float, save_s: float, wait_s: float = 0.0) -> Optional[str]:
    """A warning when the signal lead time cannot fit the rest of a step plus a save.

    After the warning signal, the worst case is that the current step has just begun: it
    must finish (``step_s``), then an asynchronous save still in flight must be written and
    committed (``wait_s``, its whole write time in the worst case; 0 with synchronous saves),
    then the stop checkpoint must be written and committed (``save_s``), all before Slurm's
    SIGKILL at the time limit. None when it fits.
    """
    need = step_s + wait_s + save_s
    if lead_s >= need:
        return None
    suggest = int(-(-need * 1.5 // 1))
    wait = f" + the async save in flight {wait_s:.1f} s" if wait_s > 0 else ""
    return (
        f"signal lead time {lead_s:g} s < one step {step_s:.1f} s{wait} + one save {save_s:.1f} s = "
        f"{need:.1f} s: the job can be killed before its stop checkpoint is durable, losing the "
        f"work since the last periodic checkpoint; set training.signal_lead_time_s >= {suggest} "
        f"(1.5 x {need:.1f} s)"
    )
