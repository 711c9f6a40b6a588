"""Keep a failed node out of the next attempt of the same (requeued) job.

``<run_dir>/failed_nodes.json`` (:func:`recovery.policy.record_failed_node`) keeps bad nodes
out of the *next submission* (the renderer turns it into ``--exclude``). A requeued job is
not resubmitted, though: it keeps its id and its original ``--exclude``. This module carries
the exclusion over to the next attempt of the same job, in three places:

1. **Before a requeue we ask for** (a stop checkpoint, or a hardware fault on this node):
   :func:`requeue_excluding` runs ``scontrol requeue <id>`` and *then*
   ``scontrol update JobId=<id> ExcNodeList=<old + failed>``.
2. **After a requeue Slurm did by itself** (NODE_FAIL with ``--requeue``): the next attempt
   calls :func:`start_check`, which learns the failed node (:func:`learn_failed_nodes`: the
   NODE_FAIL attempt's node list from ``sacct -D``, narrowed to the node(s) that went down in
   that window by ``sacctmgr show event``, else to those ``sinfo`` shows down/drained now) and
   records it.
3. **At the start of every attempt** (:func:`start_check`): if this allocation contains a
   recorded failed node, the attempt does not train; it requeues itself excluding the failed
   nodes (exit 42). The zero-progress guard and ``max_restarts`` bound this like any restart.

Facts this relies on (Slurm 22.05 on the local test cluster, ``tests/slurm_cluster.py``):

* ``scontrol update ... ExcNodeList=`` on a RUNNING job fails: "Job is no longer pending
  execution". Hence the order: requeue first, then update.
* Right after ``scontrol requeue`` the job is requeued (COMPLETING, then PENDING with reason
  BeginTime for ~10 s) and the update is accepted; the next attempt ran on another node.
* The requeue sends SIGTERM to every process of the job, including an ``scontrol`` started
  from inside it (seen: the update exited 143). :func:`recovery.slurm.default_runner` starts
  commands with SIGTERM ignored, so they finish within ``KillWait``.
* After a NODE_FAIL the node may come back at once (``ReturnToService``), and the requeued job
  was seen landing on it again: only step 3 catches that.
* ``ExcNodeList=`` replaces the list, so the job's current one (its ``--exclude``) is merged in.

Pure logic over an injected ``runner`` (``subprocess.run``-compatible; every command goes through
:class:`recovery.slurm.Slurm`) and clock; no torch, no launch imports. CLI for the batch script, before ``srun``::

    python -m recovery.exclusion start RUN_DIR      # exit 0: train; 42: requeued, stop here
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from launch.hardware_faults import hardware_fault
from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery import policy
from recovery.events import EventLog
from recovery.lock import foreign_holder
from recovery.slurm import Runner, Slurm, default_runner

__all__ = ["default_runner", "requeue_excluding", "set_excluded", "start_check", "hardware_fault", "recorded_hosts"]
EXIT_TRAIN, EXIT_REQUEUED = 0, policy.EXIT_REQUEUE
BAD_NODE_STATES = ("down", "drain", "fail", "not_responding", "no_respond")  # sinfo %T prefixes/words
EVENT_WINDOW_S = 120  # a node going down this long after the attempt ended still counts (slow detection)
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


# ---- host lists ---------------------------------------------------------------------------

def expand_hosts(nodelist: str, runner: Runner) -> list[str]:
    """``stn[1-2],gpu7`` -> hosts, by ``scontrol show hostnames``; plain comma lists without it."""
    return Slurm(runner).hostnames(nodelist)


def recorded_hosts(run_dir: Path) -> list[str]:
    """The failed hosts in ``failed_nodes.json``, de-duplicated, in recording order."""
    hosts: list[str] = []
    for entry in policy.failed_nodes(run_dir):
        host = str(entry.get("host"))
        if _HOST.match(host) and host not in hosts:
            hosts.append(host)
    return hosts


# ---- telling Slurm ------------------------------------------------------------------------

@dataclass
class Outcome:
    """What a Slurm command did; ``ok`` False keeps the command's own words in ``detail``."""

    ok: bool
    detail: str = ""
    excluded: list[str] = field(default_factory=list)


def current_exclusions(job_id: str, runner: Runner) -> list[str]:
    """The job's ExcNodeList now (its ``--exclude`` and earlier updates), expanded."""
    r = Slurm(runner).show_job(job_id)
    if not r.ok:
        return []
    match = re.search(r"\bExcNodeList=(\S+)", r.out)
    return expand_hosts(match.group(1), runner) if match else []


def set_excluded(job_id: str, hosts: Iterable[str], runner: Runner) -> Outcome:
    """``scontrol update JobId=<id> ExcNodeList=<current + hosts>`` on a pending (or just requeued) job."""
    merged: list[str] = []
    for h in current_exclusions(job_id, runner) + list(hosts):
        if h and h not in merged:
            merged.append(h)
    if not merged:
        return Outcome(True, "nothing to exclude")
    r = Slurm(runner).update_excluded(job_id, merged)
    if not r.ok:
        return Outcome(False, f"scontrol update JobId={job_id} ExcNodeList=... failed (rc {r.rc}): {r.words}", merged)
    return Outcome(True, f"job {job_id} now excludes {','.join(merged)}", merged)


def requeue_excluding(job_id: str, hosts: Sequence[str], runner: Runner = default_runner) -> Outcome:
    """Requeue this job, then keep ``hosts`` out of its next attempt (the order matters, see above)."""
    r = Slurm(runner).requeue(job_id)
    if not r.ok:
        return Outcome(False, f"scontrol requeue {job_id} failed (rc {r.rc}): {r.words}")
    if not hosts:
        return Outcome(True, f"job {job_id} requeued")
    res = set_excluded(job_id, hosts, runner)
    return Outcome(res.ok, f"job {job_id} requeued; {res.detail}", res.excluded)


# ---- learning what Slurm saw ---------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One run of a job, as ``sacct -D -X`` lists it."""

    job_id: str
    state: str
    nodelist: str
    start: str
    end: str


def parse_attempts(text: str) -> list[Attempt]:
    """Rows of ``sacct -D -X --parsable2 --noheader --format=JobIDRaw,State,NodeList,Start,End``."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 5 and parts[0]:
            out.append(Attempt(parts[0], parts[1].split()[0] if parts[1] else "", parts[2], parts[3], parts[4]))
    return out


def node_fail_attempts(job_id: str, runner: Runner) -> list[Attempt]:
    """This job's earlier attempts that ended NODE_FAIL (``sacct -D`` keeps every requeued run)."""
    r = Slurm(runner).attempts(job_id)
    if not r.ok:
        return []
    return [a for a in parse_attempts(r.out) if a.state == "NODE_FAIL"]


def _time(s: str) -> Optional[datetime]:
    try:
        return datetime.fromisoformat(s.strip())
    except ValueError:
        return None


def parse_events(text: str) -> list[tuple[str, Optional[datetime], str, str]]:
    """Rows of ``sacctmgr -n -P show event ... format=NodeName,TimeStart,State,Reason``."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4 and parts[0]:
            out.append((parts[0], _time(parts[1]), parts[2], "|".join(parts[3:])))
    return out


def culprits(attempt: Attempt, runner: Runner) -> list[tuple[str, str]]:
    """Which of a NODE_FAIL attempt's nodes failed, with a reason.

    The node list of a NODE_FAIL attempt names every node of the job; excluding all of them
    would throw away healthy nodes. The accounting event table says which went down in the
    attempt's window; if it is unavailable, ``sinfo`` says which are still down or drained.
    If neither tells, nothing is recorded (see the caller's ``unknown`` note).
    """
    hosts = expand_hosts(attempt.nodelist, runner)
    if not hosts:
        return []
    start, end = _time(attempt.start), _time(attempt.end)
    slurm = Slurm(runner)
    r = slurm.node_events(hosts, attempt.start)
    found: list[tuple[str, str]] = []
    if r.ok:
        for node, when, state, reason in parse_events(r.out):
            in_window = when is None or start is None or end is None or (
                start <= when <= end + timedelta(seconds=EVENT_WINDOW_S))
            if node in hosts and in_window and node not in [f[0] for f in found]:
                found.append((node, f"NODE_FAIL: {state.lower()} {reason}".strip()))
    if found:
        return found
    r = slurm.node_states(hosts)
    if r.ok:
        for line in r.out.splitlines():
            node, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if node in hosts and any(b in state.lower() for b in BAD_NODE_STATES) and \
                    node not in [f[0] for f in found]:
                found.append((node, f"NODE_FAIL: {state} {reason}".strip()))
    return found


def learn_failed_nodes(run_dir: Path, job_id: str, runner: Runner,
                       clock: Callable[[], float] = time.time) -> tuple[list[str], list[str]]:
    """Record the nodes behind this job's NODE_FAIL attempts; returns (newly recorded, unknown notes)."""
    known = set(recorded_hosts(run_dir))
    new, unknown = [], []
    for attempt in node_fail_attempts(job_id, runner):
        found = culprits(attempt, runner)
        if not found:
            unknown.append(f"attempt {attempt.start}..{attempt.end} on {attempt.nodelist} ended NODE_FAIL, "
                           f"but no node of it is known to have failed")
        for host, reason in found:
            if host not in known:
                policy.record_failed_node(run_dir, host, reason, clock=clock, job_id=job_id)
                known.add(host)
                new.append(host)
    return new, unknown


# ---- the start of an attempt -----------------------------------------------------------------

@dataclass
class StartCheck:
    """What :func:`start_check` decided: ``train``, or ``requeue`` (this attempt must stop, exit 42)."""

    action: str
    learned: list[str] = field(default_factory=list)  # failed nodes newly recorded from sacct
    bad_here: list[str] = field(default_factory=list)  # recorded failed nodes in this allocation
    detail: str = ""


def start_check(run_dir: Path, env: Mapping[str, str], runner: Runner = default_runner, *,
                requeue_allowed: bool = True, clock: Callable[[], float] = time.time,
                emit: Optional[Callable[..., Any]] = None) -> StartCheck:
    """Before training: learn failed nodes Slurm saw, and refuse to train on a recorded one.

    Outside Slurm (no ``SLURM_JOB_ID``) there is nothing to do. ``emit`` (an EventLog's) gets
    ``failed_node`` for each newly learned node and ``exclude`` when the attempt requeues.
    """
    job_id = env.get("SLURM_JOB_ID") or ""
    if not job_id:
        return StartCheck("train", detail="not under Slurm")
    learned: list[str] = []
    notes: list[str] = []
    if policy.restart_count_from_env(env) > 0:
        learned, notes = learn_failed_nodes(run_dir, job_id, runner, clock)
    failed = recorded_hosts(run_dir)
    if emit is not None:
        for host in learned:
            emit(EventKind.FAILED_NODE, host=host, source="sacct")
    here = expand_hosts(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "", runner)
    bad = [h for h in here if h in failed]
    detail = "; ".join(notes)
    if not bad:
        return StartCheck("train", learned, [], detail or f"no recorded failed node among {','.join(here)}")
    if not requeue_allowed:
        return StartCheck("train", learned, bad, f"on recorded failed node(s) {','.join(bad)} but "
                                                 "cluster.requeue_allowed is false: training anyway")
    res = requeue_excluding(job_id, failed, runner)
    if emit is not None:
        emit(EventKind.EXCLUDE, hosts=failed, bad_here=bad, ok=res.ok, detail=res.detail)
    if not res.ok:
        return StartCheck("train", learned, bad, f"could not requeue away from {','.join(bad)}: {res.detail}")
    return StartCheck("requeue", learned, bad, res.detail)


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
         runner: Runner = default_runner) -> int:
    """``python -m recovery.exclusion start RUN_DIR [--no-requeue]`` (the batch script, before srun)."""
    args = list(sys.argv[1:] if argv is None else argv)
    allowed = "--no-requeue" not in args
    args = [a for a in args if a != "--no-requeue"]
    if len(args) != 2 or args[0] != "start":
        print("usage: python -m recovery.exclusion start RUN_DIR [--no-requeue]", file=sys.stderr)
        return 2
    env = dict(os.environ if env is None else env)
    run_dir = Path(args[1])
    if argv is None:  # the real CLI: the requeue it may do SIGTERMs this process before the update
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if env.get("SLURM_JOB_ID") and (holder := foreign_holder(run_dir, env["SLURM_JOB_ID"], runner)):
        # another live job is the run's writer: this one will be refused by the run lock (exit 9) and must not
        # write into the holder's records or requeue itself on the holder's account
        print(f"slurmtron exclusion: skipped: the run lock is held by {holder}; nothing written", flush=True)
        return EXIT_TRAIN
    events = EventLog(RunPaths.of(run_dir).events, job_id=env.get("SLURM_JOB_ID"),
                      restart_count=policy.restart_count_from_env(env))
    res = start_check(run_dir, env, runner, requeue_allowed=allowed, emit=events.emit)
    print(f"slurmtron exclusion: {res.action}: {res.detail}"
          + (f" (learned {','.join(res.learned)})" if res.learned else ""), flush=True)
    return EXIT_REQUEUED if res.action == "requeue" else EXIT_TRAIN


if __name__ == "__main__":
    sys.exit(main())
