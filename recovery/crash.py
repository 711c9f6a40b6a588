"""After a crashed attempt: requeue it, as Slurm does after a node failure.

Slurm ends a job whose step failed as FAILED and never reruns it, whatever ``--requeue`` says:
a NCCL watchdog timeout or a dying GPU at 3 a.m. would stop the run until someone notices.
The batch script therefore asks, after ``srun`` returned non-zero::

    python -m recovery.crash RUN_DIR --rc $rc   # exit 42: requeued; 0: not a crash, nothing done

The answer comes from the attempt's own event log (rank 0 writes it, fsynced per event), not
from srun's exit code (``--kill-on-bad-exit`` turns most endings into 143):

* the attempt's ``exit`` event says ``error`` after a ``stop`` with reason ``crash``, or ``hang``
  (the hang watchdog ended it), or the attempt left no ``exit`` event at all (killed: OOM
  killer, segfault, lost node) → requeue;
* ``requeue`` (rank 0 already ran ``scontrol requeue`` after the stop checkpoint),
  ``completed``, ``zero_progress``, ``max_restarts`` or a refusal such as
  ``checkpoint_mismatch`` → leave it: requeueing would only repeat a decision;
* a ``stop`` whose reason is final (:data:`recovery.exit_codes.FINAL_REASONS`: no loadable
  checkpoint, another run's checkpoint, a storage error, a full disk, a held run lock,
  torch/megatron-core outside the tested ranges: :mod:`train.versions`) →
  leave it, even if the attempt was killed before writing its ``exit`` event.

Two things outrank the event log, and with either one this process writes nothing at all:

* srun's exit code (``--rc``) is a final code of :data:`recovery.exit_codes.REFUSAL_CODES` (a held run
  lock, software versions, a foreign checkpoint, storage, ...): a refusal is final, another
  attempt would meet it again;
* the run lock is held by another live Slurm job: this job was refused (a duplicate of the run,
  submitted by hand or by a race), its ranks wrote nothing into the run, and its batch script must not
  either: the run's ``events.jsonl`` is the holder's record. Not requeued.

A deterministic crash is bounded by the next attempt's own start decision: the
zero-progress guard (``training.zero_progress_restarts``) and ``training.max_restarts``. The
restart limit is also applied here, from Slurm's restart count and the run's ``config.yaml``,
so a job whose attempts die before writing any event (a worker that cannot even start) still
stops requeueing.

A run directory that does not exist or cannot be read (a missing mount on the nodes) is
refused: exit :data:`recovery.exit_codes.EXIT_STORAGE` (final), one line, no requeue, and nothing
is created (neither the directory nor its ``events.jsonl``): another attempt would meet the
same missing directory.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery import exit_codes, lock, policy
from recovery.events import EventLog, read_events
from recovery.exclusion import requeue_excluding
from recovery.slurm import Runner, Slurm, default_runner

DEFAULT_MAX_RESTARTS = 20  # the schema's default (launch/config.py), when config.yaml cannot be read


def attempt_events(events: list[dict], job_id: str, restart_count: int) -> list[dict]:
    """The events this attempt (job id, restart count) wrote."""
    return [e for e in events if str(e.get("job_id")) == str(job_id) and int(e.get("restart_count") or 0) == restart_count]


def crashed(events: list[dict]) -> tuple[bool, str]:
    """(requeue?, why) from one attempt's events."""
    exits = [e for e in events if e.get("event") == EventKind.EXIT]
    final = [e.get("reason") for e in events
             if e.get("event") == EventKind.STOP and e.get("reason") in exit_codes.FINAL_REASONS]
    if not exits and final:
        return False, f"the attempt stopped for good ({final[-1]}) and was killed before its exit event"
    if not exits:
        return True, "the attempt left no exit event (killed before it could write one)"
    last = exits[-1]
    stops = [e.get("reason") for e in events if e.get("event") == EventKind.STOP]
    final = [r for r in stops if r in exit_codes.FINAL_REASONS]
    if final:
        return False, f"the attempt stopped for good ({final[-1]}): another attempt would meet the same refusal"
    said = next((e.get("detail") for e in reversed(events) if e.get("event") == EventKind.STOP), "")
    if last.get("reason") == "hang":  # the hang watchdog ended the attempt (recovery/watchdog.py)
        return True, f"the attempt hung: {said}"[:300]
    if last.get("reason") == "error" and (not stops or stops[-1] == "crash"):
        return True, f"the attempt crashed: {said}"[:300]
    return False, f"the attempt ended with exit reason {last.get('reason')!r}" + (f" (stop: {stops[-1]})" if stops else "")


def run_dir_problem(run_dir: Path) -> Optional[str]:
    """Why ``run_dir`` cannot be judged (missing, not a directory, unreadable), or None."""
    run_dir = Path(run_dir)
    try:
        if not run_dir.is_dir():
            what = "is not a directory" if run_dir.exists() else "does not exist"
            return f"run directory {run_dir} {what}"
        os.listdir(run_dir)
        events = RunPaths.of(run_dir).events
        if events.exists():
            with open(events, "rb"):
                pass
    except OSError as e:
        return f"run directory {run_dir} cannot be read ({e.strerror or e})"
    return None


def max_restarts_of(run_dir: Path) -> Optional[int]:
    """``training.max_restarts`` from the run's ``config.yaml`` (None when it cannot be read)."""
    import yaml

    try:
        doc = yaml.safe_load(RunPaths.of(run_dir).config.read_text(encoding="utf-8"))
        value = doc["training"]["max_restarts"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Verdict:
    """The judgement of a failed attempt: ``again`` (another attempt may train) or ``code`` and why not."""

    again: bool
    why: str
    code: int = 0  # the batch script's exit code when not ``again`` (EXIT_STORAGE for an unreadable run dir)
    job_id: str = ""
    restart: int = 0


def judge(run_dir: Path, env: Mapping[str, str], runner: Runner = default_runner, *,
          rc: Optional[int] = None) -> Verdict:
    """May another attempt follow the one ``env`` describes? The one judgement of a failed ``srun`` step, for the
    requeue path (:func:`requeue_after_crash`) and the in-job relaunch (:mod:`recovery.injob`) alike: writes
    nothing. ``rc``: srun's exit code, when the batch script passes it; a final code ends the decision."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return Verdict(False, "not under Slurm")
    problem = run_dir_problem(run_dir)
    if problem:  # never create it: a missing mount would otherwise requeue without end
        return Verdict(False, f"{problem}: not requeued (another attempt would meet the same; is its "
                              f"filesystem mounted on this node?)", exit_codes.EXIT_STORAGE, job_id)
    if rc is not None and rc in exit_codes.REFUSAL_CODES:
        return Verdict(False, f"srun exited {rc} ({exit_codes.code_name(rc)}): a refusal is final, another attempt "
                              f"would meet it again; not requeued", 0, job_id)
    holder = lock.foreign_holder(run_dir, job_id, runner)
    if holder is not None:
        return Verdict(False, f"this job does not hold the run lock: {holder}. This job was refused (one writer "
                              f"per run); not requeued, nothing written into the run", 0, job_id)
    try:
        restart = policy.restart_count_from_env(env)
    except ValueError as e:
        return Verdict(False, f"{e}: not requeued", 0, job_id)
    again, why = crashed(attempt_events(read_events(RunPaths.of(run_dir).events), job_id, restart))
    if not again:
        return Verdict(False, why, 0, job_id, restart)
    limit = max_restarts_of(run_dir)
    if limit is None:
        limit = DEFAULT_MAX_RESTARTS
    chain = policy.current_chain(policy.read_progress(run_dir) + [{"restart_count": restart, "job_id": job_id}])
    unplanned, planned = policy.restart_tally(chain, restart + 1)  # the restart this crash would make
    if unplanned > limit:
        return Verdict(False, f"{why}; the next restart would be unplanned restart {unplanned} > "
                              f"training.max_restarts {limit} ({planned:,} planned slice requeues not counted): not "
                              f"requeued (another attempt would be refused)", 0, job_id, restart)
    return Verdict(True, why, 0, job_id, restart)


def requeue_after_crash(run_dir: Path, env: Mapping[str, str],
                        runner: Runner = default_runner, *, rc: Optional[int] = None,
                        exclude: Sequence[str] = (), detail: str = "") -> tuple[int, str]:
    """Decide for the attempt ``env`` describes; returns (exit code for the batch script, why).

    ``rc``: srun's exit code, when the batch script passes it; a final code ends the decision. ``exclude``: hosts
    to keep out of the next attempt (:func:`recovery.exclusion.requeue_excluding`: requeue, then the update);
    ``detail`` is added to the reason (the in-job path says why it falls back here)."""
    v = judge(run_dir, env, runner, rc=rc)
    if not v.again:
        return v.code, v.why
    why = v.why + (f"; {detail}" if detail else "")
    log = EventLog(RunPaths.of(run_dir).events, job_id=v.job_id, restart_count=v.restart)
    if exclude:
        out = requeue_excluding(v.job_id, list(exclude), runner)
        ok, error = out.ok, None if out.ok else out.detail
        if not ok and out.detail.startswith("job"):  # requeued, only the exclusion update failed
            ok = True
    else:
        r = Slurm(runner).requeue(v.job_id)
        ok, error = r.ok, None if r.ok else r.words
    log.emit(EventKind.REQUEUE, method="scontrol_after_crash", ok=ok, detail=why, error=error,
             **({"exclude": list(exclude)} if exclude else {}))
    return (exit_codes.EXIT_REQUEUE if ok else 0), why + ("; requeued" if ok else "; scontrol requeue failed")


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
         runner: Runner = default_runner) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    rc: Optional[int] = None
    if len(args) == 3 and args[1] == "--rc":
        try:
            rc = int(args[2])
        except ValueError:
            rc = None  # an unreadable code: decide from the event log alone
        args = args[:1]
    if len(args) != 1:
        print("usage: python -m recovery.crash RUN_DIR [--rc SRUN_EXIT_CODE]", file=sys.stderr)
        return 2
    code, why = requeue_after_crash(Path(args[0]), dict(os.environ if env is None else env), runner, rc=rc)
    print(f"slurmtron: {why}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
