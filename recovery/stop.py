"""Who stopped the run, and whether it comes back: one decision at the step boundary.

A stop reaches the ranks as a signal (the handler only sets a flag, :mod:`recovery.signals`)
or as a stop request file written by ``python launch/stop.py`` (rank 0 polls it at each step
boundary). The ranks agree on the stop, save, and then rank 0 decides here, from what Slurm
itself says about the job, whether the stop is a requeue or the end of the job; the decision
is broadcast so every rank exits with the same code.

What Slurm 22.05 shows during the kill window (seen on the local test cluster, one srun task
trapping the signals and querying at once, +1 s and +3 s)::

    cause                         signal  scontrol show job                          sacct -X State
    scancel <id>                  TERM    JobState=COMPLETING Reason=None            CANCELLED by <uid>
                                          PreemptTime=None, Restarts unchanged
    preemption (GraceTime > 0)    TERM    JobState=RUNNING PreemptTime=<now>         RUNNING
    preemption, grace over        TERM    JobState=COMPLETING Restarts=<ours + 1>    PREEMPTED
    time limit reached            TERM    JobState=COMPLETING Reason=TimeLimit       (TIMEOUT)
    scancel --signal=TERM <id>    TERM    JobState=RUNNING PreemptTime=None          RUNNING
    scancel --signal=USR2 <id>    USR2    JobState=RUNNING, EndTime = start + limit  RUNNING
    --signal=USR2@<lead> warning  USR2    EndTime - now <= lead (+ Slurm's ~30 s check period)

``JobState`` prints the COMPLETING flag, not the base state, and ``squeue -t CANCELLED`` does
not match a completing job; the accounting record (``sacct``) carries the cancel at once.

The rule (:func:`decide`). A requeue needs positive evidence; without it the job ends:

* the stop request file (drain) or SIGUSR1 -> ``user_stop``: no requeue;
* SIGUSR2 -> requeue; ``time_limit`` when the job's EndTime is within the signal lead time
  (+ :data:`WARNING_SLACK_S`) of the moment the signal came, else ``user_requeue``
  (``scancel --signal=USR2``: "checkpoint and requeue now");
* SIGTERM/SIGINT: sacct ``CANCELLED`` (or, without accounting, a COMPLETING job with no
  reason, no preemption time and no new restart) -> ``user_cancel``, no requeue;
  a restart count above ours (Slurm already requeued it) -> ``node_failure`` with a node reason,
  ``preemption`` with a PreemptTime or PREEMPTED, else ``user_requeue`` (``scontrol requeue`` by the
  job's user or an admin: sacct REQUEUED, no PreemptTime); rank 0 then does not ask for a requeue
  again (``scontrol requeue`` of a pending job fails "Job is pending execution");
  a PreemptTime or PREEMPTED -> ``preemption``; Reason=TimeLimit/TIMEOUT -> ``time_limit``; NODE_FAIL or a node reason ->
  ``node_failure``; all requeue. Anything else (``scancel --signal=TERM``, a query that
  failed) -> ``undecided``: no requeue, and a WARNING says so. A lost requeue costs a
  resubmission; an unstoppable job costs the allocation.
* outside Slurm (``cluster=local``) there is nothing to ask: ``local_signal``, exit 42, and
  the local launcher does not relaunch a run its user interrupted.

A drain request pending at the same time wins over a requeue: the user asked for the end.

The stop request file ``<run_dir>/stop.json`` (:attr:`launch.paths.RunPaths.stop_request`)::

    {"state": "requested", "requested_at": t, "at_step": N | null, "by": "user@host"}
    {"state": "stopped", "reason": "user_stop" | "user_cancel", "step": N, "job_id": ..., ...}

A ``stopped`` run does not start again by itself (a dependency-chain continuation, a requeue
that raced the cancel): the worker refuses at start. ``launch/pretrain.py`` removes the file,
so resubmitting the same ``run.name`` continues the run.

No torch: the login-node stop command and the unit tests import this module.
"""
from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launch.kinds import Cause
from recovery.slurm import Slurm, default_runner
from recovery.storage import atomic_write_json

# The causes the ranks decide here (launch/kinds.py: ``decided``); each requeues unless it is ``final``.
USER_CANCEL = Cause.USER_CANCEL
USER_STOP = Cause.USER_STOP
USER_REQUEUE = Cause.USER_REQUEUE
PREEMPTION = Cause.PREEMPTION
TIME_LIMIT = Cause.TIME_LIMIT
NODE_FAILURE = Cause.NODE_FAILURE
# Stop reasons that name no cause: the report takes the cause from other evidence.
UNDECIDED = "undecided"
LOCAL_SIGNAL = "local_signal"
REQUEUE_SIGNAL = "requeue_signal"  # SIGUSR2 whose timing could not be read: requeue, cause unknown

WARNING_SLACK_S = 60.0  # Slurm checks time limits about every 30 s: the warning can come that early
QUERY_WAIT_S = 100.0  # at worst scontrol (60 s) then sacct (30 s), recovery.slurm's timeouts

REQUESTED = "requested"
STOPPED = "stopped"


@dataclass(frozen=True)
class StopDecision:
    """``reason`` (a cause above), whether rank 0 asks Slurm for a requeue, and the evidence."""

    reason: str
    requeue: bool
    evidence: str
    requeued_by_slurm: bool = False  # Slurm already requeued the job: rank 0 must not ask again

    @classmethod
    def of(cls, cause: Cause, evidence: str, **kw: Any) -> "StopDecision":
        """A decision naming a cause of the vocabulary: a requeue unless the cause is final."""
        return cls(cause.value, not cause.final, evidence, **kw)

    def as_dict(self) -> dict:
        return {"reason": self.reason, "requeue": self.requeue, "evidence": self.evidence,
                "requeued_by_slurm": self.requeued_by_slurm}


@dataclass(frozen=True)
class SlurmView:
    """What the controller and the accounting say about the job, at one moment.

    ``fields`` is ``scontrol -o show job`` as key -> value ({} if it failed); ``accounting``
    the first word of ``sacct -X State`` (None if sacct failed or had no record).
    """

    fields: Mapping[str, str] = field(default_factory=dict)
    accounting: Optional[str] = None
    errors: tuple = ()
    at: float = 0.0  # when the query ran (unix seconds)

    @property
    def ok(self) -> bool:
        return bool(self.fields) or self.accounting is not None

    def get(self, key: str) -> str:
        return str(self.fields.get(key, "") or "")

    @property
    def state(self) -> str:
        return self.get("JobState").upper()

    @property
    def reason(self) -> str:
        return self.get("Reason")

    @property
    def restarts(self) -> Optional[int]:
        try:
            return int(self.get("Restarts"))
        except ValueError:
            return None

    @property
    def preempt_time(self) -> Optional[str]:
        v = self.get("PreemptTime")
        return v if v and v not in ("None", "Unknown", "N/A") else None

    @property
    def end_time(self) -> Optional[float]:
        return slurm_time(self.get("EndTime"))

    def summary(self) -> str:
        keys = ("JobState", "Reason", "Restarts", "PreemptTime", "EndTime")
        parts = [f"{k}={self.fields[k]}" for k in keys if k in self.fields]
        s = "scontrol " + (" ".join(parts) if parts else "(no answer)")
        s += f"; sacct {self.accounting}" if self.accounting is not None else "; sacct (no record)"
        return s + (f"; errors: {'; '.join(self.errors)}" if self.errors else "")


def slurm_time(text: str) -> Optional[float]:
    """``2026-12-01T00:08:38`` (Slurm prints local time) -> unix seconds; None for Unknown/None."""
    try:
        return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_scontrol(text: str) -> dict:
    """``scontrol -o show job`` (one line of ``Key=Value`` tokens) -> dict; the first of a key wins."""
    out: dict = {}
    for tok in text.split():
        k, eq, v = tok.partition("=")
        if eq:
            out.setdefault(k, v)
    return out


def query_job(job_id: str, runner: Optional[Callable[..., Any]] = None, *,
              clock: Callable[[], float] = time.time) -> SlurmView:
    """Ask the controller (``scontrol -o show job``) and the accounting (``sacct -X``) about the job.

    ``runner`` is :func:`recovery.slurm.default_runner` by default (SIGTERM ignored in the child:
    Slurm signals every process of a cancelled step, the query asking about it included)."""
    slurm = Slurm(runner or default_runner)
    at = clock()
    errors = []
    r = slurm.show_job(str(job_id))
    fields = parse_scontrol(r.out) if r.ok else {}
    if not r.ok:
        errors.append(f"scontrol rc {r.rc}: {r.words[:200]}")
    a = slurm.accounting_state(str(job_id))
    lines = [x.strip() for x in a.out.splitlines() if x.strip()]
    accounting = lines[-1].split()[0].upper() if a.ok and lines else None
    if not a.ok:
        errors.append(f"sacct rc {a.rc}: {a.words[:200]}")
    return SlurmView(fields=fields, accounting=accounting, errors=tuple(errors), at=at)


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def decide(signum: int, view: Optional[SlurmView], *, under_slurm: bool, restart_count: int,
           lead_s: float, received_at: Optional[float], stop_requested: bool = False) -> StopDecision:
    """The rule of the module docstring. ``signum`` 0 = no signal (only the stop request file)."""
    d = _decide_signal(signum, view, under_slurm=under_slurm, restart_count=restart_count, lead_s=lead_s,
                       received_at=received_at) if signum else None
    if stop_requested:
        if d is None or d.requeue or d.reason == UNDECIDED:
            why = "stop request file (launch/stop.py)"
            return StopDecision.of(USER_STOP, why + (f"; over {_signame(signum)}: {d.reason} ({d.evidence})"
                                                     if d else ""))
    assert d is not None, "decide() needs a signal or a stop request"
    return d


def _decide_signal(signum: int, view: Optional[SlurmView], *, under_slurm: bool, restart_count: int,
                   lead_s: float, received_at: Optional[float]) -> StopDecision:
    name = _signame(signum)
    if not under_slurm:
        return StopDecision(LOCAL_SIGNAL, True, f"{name} outside Slurm: exit 42; the local launcher relaunches "
                                                f"unless its user interrupted it")
    if signum == signal.SIGUSR1:
        return StopDecision.of(USER_STOP, f"{name} (scancel --signal=USR1: stop without requeue)")
    seen = view.summary() if view is not None else "no Slurm answer"
    if signum == signal.SIGUSR2:
        end = view.end_time if view is not None else None
        if end is None:
            return StopDecision(REQUEUE_SIGNAL, True, f"{name}; the job's end time is unknown ({seen})")
        when = received_at if received_at is not None else view.at
        left = end - when
        window = lead_s + WARNING_SLACK_S
        if left <= window:
            return StopDecision.of(TIME_LIMIT, f"{name} {left:.0f} s before EndTime <= lead {lead_s:g} s + "
                                               f"{WARNING_SLACK_S:g} s: the time-limit warning ({seen})")
        return StopDecision.of(USER_REQUEUE, f"{name} {left:.0f} s before EndTime > lead {lead_s:g} s + "
                                             f"{WARNING_SLACK_S:g} s: scancel --signal=USR2 ({seen})")
    # SIGTERM, SIGINT: a cancel, a preemption, a time limit, a node failure, or someone's kill
    if view is None or not view.ok:
        return StopDecision(UNDECIDED, False, f"{name}; Slurm could not be asked ({seen})")
    acct, state, reason = view.accounting or "", view.state, view.reason.lower()
    if acct.startswith("CANCELLED") or state.startswith("CANCELLED"):
        return StopDecision.of(USER_CANCEL, f"{name}; {seen}")
    if view.restarts is not None and view.restarts > restart_count:
        if "NODE_FAIL" in (acct, state) or "node" in reason:
            cause = NODE_FAILURE
        elif view.preempt_time or "PREEMPTED" in (acct, state):
            cause = PREEMPTION
        else:  # REQUEUED, no PreemptTime: `scontrol requeue` by the job's user or an admin
            cause = USER_REQUEUE
        return StopDecision.of(cause, f"{name}; Slurm already requeued the job (Restarts {view.restarts} > "
                                      f"{restart_count}): {seen}", requeued_by_slurm=True)
    if view.preempt_time or "PREEMPTED" in (acct, state):
        return StopDecision.of(PREEMPTION, f"{name}; {seen}")
    if reason == "timelimit" or "TIMEOUT" in (acct, state):
        return StopDecision.of(TIME_LIMIT, f"{name}; {seen}")
    if "NODE_FAIL" in (acct, state) or "node" in reason:
        return StopDecision.of(NODE_FAILURE, f"{name}; {seen}")
    if view.accounting is None and state == "COMPLETING" and reason in ("", "none"):
        return StopDecision.of(USER_CANCEL, f"{name}; no accounting record, and the controller is ending the "
                                            f"job with no reason, no preemption and no restart: {seen}")
    return StopDecision(UNDECIDED, False, f"{name}; nothing in Slurm's answer says preemption, time limit or "
                                          f"node failure ({seen})")


# ---- the stop request file --------------------------------------------------------------

def read_request(path: Path) -> Optional[dict]:
    """The stop file's record, or None (absent or unreadable)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def request_problem(path: Path) -> Optional[str]:
    """Why the stop file at ``path`` is not a stop record a launch can read and clear (binary, not JSON, a
    directory), or None (absent, or a record). A launch refuses on it: what the user meant cannot be known."""
    path = Path(path)
    try:
        if path.is_dir():
            return f"{path} is a directory, not a stop record"
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no stop file (or no run directory yet)
        return None
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e})"
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return f"{path} is not a stop record (not JSON: {raw[:40]!r})"
    return None if isinstance(doc, dict) else f"{path} is not a stop record (JSON {type(doc).__name__}, not an object)"


def pending(doc: Optional[dict], step: int) -> bool:
    """A drain request applies at ``step`` (steps done): requested, and ``at_step`` reached (or none)."""
    if not doc or doc.get("state") != REQUESTED:
        return False
    at = doc.get("at_step")
    return at is None or step >= int(at)


def stopped(doc: Optional[dict]) -> bool:
    return bool(doc) and doc.get("state") == STOPPED


def _write(path: Path, doc: dict) -> None:
    atomic_write_json(Path(path), doc)


def request_stop(path: Path, *, at_step: Optional[int] = None, clock: Callable[[], float] = time.time,
                 by: Optional[str] = None) -> dict:
    """Write a drain request (atomically); returns it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = str(os.getuid())
    doc = {"state": REQUESTED, "requested_at": clock(), "at_step": at_step,
           "by": by or f"{user}@{socket.gethostname()}"}
    _write(path, doc)
    return doc


def mark_stopped(path: Path, reason: str, step: Optional[int], job_id: Optional[str], *,
                 clock: Callable[[], float] = time.time) -> dict:
    """Record that the run ended on the user's decision; later attempts refuse to start."""
    old = read_request(path) or {}
    doc = {"state": STOPPED, "reason": reason, "step": step, "job_id": job_id, "stopped_at": clock(),
           "requested_at": old.get("requested_at"), "at_step": old.get("at_step"), "by": old.get("by")}
    _write(path, doc)
    return doc


def poller(path: Path) -> Callable[[int], bool]:
    """Rank 0's per-step check: one ``stat`` while there is no file; the file is read when it changes."""
    cache: dict = {"key": None, "doc": None}

    def poll(step: int) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != cache["key"]:
            cache["key"], cache["doc"] = key, read_request(path)
        return pending(cache["doc"], step)

    return poll


def start_refusal(path: Path, latest_step: Optional[int], job_id: Optional[str], *,
                  clock: Callable[[], float] = time.time) -> Optional[tuple[str, str]]:
    """Rank 0, before an attempt trains: ``(reason, detail)`` if the user already ended the run.

    A ``stopped`` file: the run ended on a cancel or a drain, and this attempt is a
    dependency-chain continuation or a requeue that raced it. A drain request that applies at
    the checkpoint this attempt would resume from: honour it now (nothing new to save).
    """
    doc = read_request(path)
    again = "resubmit with launch/pretrain.py (same run.name) to continue the run"
    if stopped(doc):
        return (str(doc.get("reason") or USER_STOP),
                f"the run was stopped ({doc.get('reason')} at step {doc.get('step')}, job {doc.get('job_id')}); "
                f"{again}")
    if pending(doc, latest_step or 0):
        mark_stopped(path, USER_STOP, latest_step, job_id, clock=clock)
        return (USER_STOP, f"a stop request ({doc.get('by')}) applies at checkpoint step {latest_step}: "
                           f"not training; {again}")
    return None


class Judge:
    """Rank 0's side of a stop: :meth:`begin` asks Slurm in a thread while the ranks save, and
    :meth:`decide` (after the save) applies :func:`decide`. The stop path waits for Slurm only
    if Slurm is slower than the checkpoint."""

    def __init__(self, env: Mapping[str, str], *, restart_count: int, lead_s: float,
                 received_at: Callable[[], Optional[float]], runner: Optional[Callable[..., Any]] = None,
                 clock: Callable[[], float] = time.time, stop_file: Optional[Path] = None) -> None:
        self.job_id = env.get("SLURM_JOB_ID") or ""
        self.requested: Callable[[int], bool] = poller(stop_file) if stop_file is not None else (lambda step: False)
        self.restart_count = restart_count
        self.lead_s = lead_s
        self.received_at = received_at
        self.runner = runner
        self.clock = clock
        self._thread: Any = None
        self._view: list = []

    def begin(self, signum: int, requested: bool) -> None:
        if not (signum and self.job_id) or signum == signal.SIGUSR1:
            return  # nothing to ask: the stop file, SIGUSR1, or no Slurm
        import threading

        def ask() -> None:
            self._view.append(query_job(self.job_id, self.runner, clock=self.clock))

        self._thread = threading.Thread(target=ask, name="slurm-stop-query", daemon=True)
        self._thread.start()

    def decide(self, signum: int, requested: bool) -> StopDecision:
        if self._thread is None and signum and self.job_id and signum != signal.SIGUSR1:
            self.begin(signum, requested)
        if self._thread is not None:
            self._thread.join(timeout=QUERY_WAIT_S)
        view = self._view[0] if self._view else None
        return decide(signum, view, under_slurm=bool(self.job_id), restart_count=self.restart_count,
                      lead_s=self.lead_s, received_at=self.received_at(), stop_requested=requested)
