"""One writer per run: ``<run_dir>/run.lock``, held by rank 0 for the whole life of an attempt.

Why a lock *file* created atomically, and not ``fcntl``/``flock``: the run directory lives on
the cluster's shared filesystem and the two writers that must exclude each other run on
different nodes (a resubmitted job, an overlapping ``dependency_chain`` continuation, a
``pretrain.py`` on the login node). POSIX record locks over NFS depend on a working lock
manager (``lockd``/NLM), and on Lustre ``flock`` is cluster-wide only with the ``flock`` mount
option: with ``localflock`` (a common default) it silently excludes nobody on another node,
and with ``noflock`` it fails. A lock that silently does not lock is worse than none.
Creating a file with ``link(2)`` (the NFS-safe variant of ``O_CREAT|O_EXCL``: the complete
holder record appears atomically, or the call fails because a lock exists) works the same on
a local disk, NFSv3/v4 and Lustre. Its cost is that a holder which dies does not release it,
so the record says who holds it and the next writer judges whether that holder is gone:

* the same Slurm job id -> the same writer (a requeued attempt of the job): taken over;
* the same host and a pid that no longer runs (or runs a different process: the pid's start
  time is recorded) -> stale: taken over with a WARNING;
* another Slurm job id that ``squeue`` no longer lists (ended) -> stale: taken over with a WARNING;
* otherwise (the holder runs, or its host/job cannot be asked) -> refused, naming the holder.

``cluster=local``: the launcher (``launch/local.py``) takes the lock before it writes anything
into the run and holds it for the whole chain of attempts; it hands it to its rank 0 through
``SLURMTRON_LOCK_TOKEN`` (its record's token). Rank 0 finding that record holds the lock as it
is (nothing rewritten, nothing released at the attempt's end), so a second launch is refused
from the first instant to the last, also between attempts and while the ranks start.

A takeover renames the stale record away (atomic; of two racing takers only one renames the
record it judged, the other puts back what it moved and looks again) and then creates its own.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launch.paths import RunPaths
from recovery.policy import restart_count_from_env
from recovery.slurm import Runner, Slurm, default_runner

HANDOVER_ENV = "SLURMTRON_LOCK_TOKEN"  # the local launcher's record token, in its ranks' environment
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED",
                           "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})


class RunLocked(RuntimeError):
    """Another live writer holds the run. ``holder`` is its record."""

    def __init__(self, path: Path, holder: "Holder", why: str) -> None:
        self.path, self.holder, self.why = path, holder, why
        if holder.unreadable is not None:
            super().__init__(f"lock file {path} holds no readable lock record ({holder.unreadable!r}): if no attempt "
                             f"of this run is running (squeue / ps), remove it (rm {path}) and start again")
            return
        super().__init__(f"run is locked by {holder.describe()} ({why}); lock file {path}. Wait for it to end, "
                         f"or cancel it (scancel {holder.job_id})" if holder.job_id else
                         f"run is locked by {holder.describe()} ({why}); lock file {path}. Wait for it to end; "
                         f"if you are sure no process of it runs, remove {path}")


@dataclass
class Holder:
    """The lock record (the file's JSON)."""

    host: str
    pid: int
    pid_start: Optional[float] = None  # the process's start time (detects a reused pid)
    job_id: Optional[str] = None  # SLURM_JOB_ID
    restart_count: int = 0
    start_time: float = 0.0  # unix seconds when the lock was taken
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def unreadable(self) -> Optional[str]:
        """The start of the lock file's text when it held no readable record (binary, truncated, not JSON)."""
        return getattr(self, "_unreadable", None)

    @staticmethod
    def garbage(text: str) -> "Holder":
        """The stand-in holder of a lock file that holds no readable record."""
        h = Holder(host="?", pid=0)
        h._unreadable = text[:80]
        return h

    def describe(self) -> str:
        if self.unreadable is not None:
            return ("no known process: the lock file holds no readable lock record; if no attempt of this run "
                    "is running, remove it")
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.start_time)) if self.start_time else "?"
        job = f"Slurm job {self.job_id} (restart {self.restart_count}), " if self.job_id else ""
        return f"{job}pid {self.pid} on {self.host} since {when}"

    @staticmethod
    def from_text(text: str) -> Optional["Holder"]:
        try:
            doc = json.loads(text)
            return Holder(host=str(doc["host"]), pid=int(doc["pid"]), pid_start=doc.get("pid_start"),
                          job_id=doc.get("job_id"), restart_count=int(doc.get("restart_count") or 0),
                          start_time=float(doc.get("start_time") or 0.0), token=str(doc.get("token") or ""))
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return None


def read_record(path: Path) -> str:
    """The lock file's text; bytes that are not UTF-8 are replaced (a garbage record is judged, not raised)."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (None if it does not exist)."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # psutil.NoSuchProcess, AccessDenied, or no psutil
        return None


def pid_alive(pid: int, start: Optional[float]) -> bool:
    """Does ``pid`` still run the process that started at ``start`` (seconds, 1 s tolerance)?"""
    now_start = process_start_time(pid)
    if now_start is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return start is None
    return start is None or abs(now_start - float(start)) < 1.0


def squeue_states(job_ids: list, runner: Callable[..., Any] = subprocess.run) -> dict:
    """{job id: state} of the jobs ``squeue`` still lists (pending, running, ...); ended jobs are absent.

    Asked through :class:`recovery.slurm.Slurm` (one injected runner). Raises ``RuntimeError``
    when ``squeue`` is missing or fails: "cannot tell" must not read as "not running".
    """
    ids = [str(j) for j in job_ids if j]
    if not ids:
        return {}
    reply = Slurm(runner).call(["squeue", "-h", "-o", "%i|%T", "-j", ",".join(ids)], timeout=60)
    if not reply.ok:
        if "Invalid job id" in reply.err:  # every id is unknown to slurmctld: all long gone
            return {}
        raise RuntimeError(f"squeue -j {','.join(ids)} exited {reply.rc}: {reply.words}")
    out = {}
    for line in reply.out.splitlines():
        jid, _, state = line.strip().partition("|")
        if jid:
            out[jid.split("_")[0]] = state.strip()
    return out


def slurm_job_active(job_id: str, runner: Callable[..., Any] = subprocess.run) -> Optional[bool]:
    """True if ``squeue`` lists the job in an active state, False if not, None if it cannot be asked."""
    try:
        state = squeue_states([job_id], runner).get(str(job_id))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    return state is not None and state.split()[0].rstrip("+") in ACTIVE_STATES


def judge(holder: Holder, me: Optional[Holder], *, host: str,
          alive: Callable[[int, Optional[float]], bool] = pid_alive,
          job_active: Callable[[str], Optional[bool]] = slurm_job_active) -> tuple[str, str]:
    """(verdict, why) for an existing lock record: ``same`` | ``stale`` | ``held``."""
    if me is not None and holder.job_id and me.job_id and str(holder.job_id) == str(me.job_id):
        return "same", f"a requeued attempt of the same Slurm job {holder.job_id}"
    if holder.host == host:
        if alive(holder.pid, holder.pid_start):
            return "held", f"pid {holder.pid} is running on this host"
        if not holder.job_id:
            return "stale", f"pid {holder.pid} on {host} no longer runs"
    if holder.job_id:
        active = job_active(str(holder.job_id))
        if active is False:
            return "stale", f"Slurm job {holder.job_id} has ended"
        if active is None:
            return "held", f"cannot ask Slurm whether job {holder.job_id} still runs"
        return "held", f"Slurm job {holder.job_id} is still active"
    return "held", f"it was taken on another host ({holder.host}) without a Slurm job id; cannot check that pid"


@dataclass
class Acquired:
    """A lock this process holds; ``taken_over`` is the record it replaced (with why), if any."""

    path: Path
    holder: Holder
    taken_over: Optional[Holder] = None
    why: str = ""
    handed: bool = False  # held through the local launcher's record: the launcher releases it

    def release(self) -> bool:
        """Remove the lock if it is still ours (a takeover by a later attempt is left alone)."""
        if self.handed:
            return False
        try:
            current = Holder.from_text(read_record(self.path))
        except OSError:
            return False
        if current is None or current.token != self.holder.token:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True


def me_from_env(env: Mapping[str, str], *, clock: Callable[[], float] = time.time) -> Holder:
    """This process's record (host, pid and its start time, Slurm job id, restart count)."""
    pid = os.getpid()
    return Holder(host=socket.gethostname(), pid=pid, pid_start=process_start_time(pid),
                  job_id=env.get("SLURM_JOB_ID") or None, restart_count=restart_count_from_env(env),
                  start_time=clock())


def _link_new(path: Path, holder: Holder) -> bool:
    """Create ``path`` holding ``holder`` atomically; False if a lock already exists."""
    tmp = path.with_name(f"{path.name}.{holder.token}.new")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(asdict(holder), sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def acquire(path: Path, me: Holder, *, host: Optional[str] = None,
            alive: Callable[[int, Optional[float]], bool] = pid_alive,
            job_active: Callable[[str], Optional[bool]] = slurm_job_active, attempts: int = 5,
            handed_by: Optional[str] = None) -> Acquired:
    """Take the run lock for ``me`` or raise :class:`RunLocked` naming the live holder.

    ``handed_by``: the token of the local launcher's record (``SLURMTRON_LOCK_TOKEN``); when the
    lock file holds that record, it is this process's already (:attr:`Acquired.handed`)."""
    path = Path(path)
    host = host or socket.gethostname()
    if handed_by:
        try:
            current = Holder.from_text(read_record(path))
        except OSError:
            current = None
        if current is not None and current.token == handed_by:
            return Acquired(path, current, handed=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(attempts):
        if _link_new(path, me):
            return Acquired(path, me)
        try:
            text = read_record(path)
        except FileNotFoundError:
            continue  # released between our link and our read: try again
        holder = Holder.from_text(text)
        if holder is None:
            raise RunLocked(path, Holder.garbage(text), f"unreadable lock record {text[:80]!r}")
        verdict, why = judge(holder, me, host=host, alive=alive, job_active=job_active)
        if verdict == "held":
            raise RunLocked(path, holder, why)
        aside = path.with_name(f"{path.name}.{me.token}.stale")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        moved = Holder.from_text(read_record(aside))
        if moved is None or moved.token != holder.token:  # another taker replaced it meanwhile: put it back
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            os.unlink(aside)
            continue
        os.unlink(aside)
        if _link_new(path, me):
            return Acquired(path, me, taken_over=holder, why=why if verdict == "stale" else f"same writer: {why}")
    raise RunLocked(path, Holder.from_text(read_record(path)) or Holder.garbage("") if path.exists() else me,
                    "the lock kept changing hands while taking it")


def active_holder(path: Path, *, host: Optional[str] = None,
                  alive: Callable[[int, Optional[float]], bool] = pid_alive,
                  job_active: Callable[[str], Optional[bool]] = slurm_job_active) -> Optional[tuple[Holder, str]]:
    """The live holder of ``path`` and why it counts as live, or None (no lock, or a stale one)."""
    try:
        text = read_record(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    holder = Holder.from_text(text)
    if holder is None:
        return Holder.garbage(text), f"unreadable lock record {text[:80]!r}"
    verdict, why = judge(holder, None, host=host or socket.gethostname(), alive=alive, job_active=job_active)
    return (holder, why) if verdict == "held" else None


def foreign_holder(run_dir: Path, job_id: str, runner: Runner = default_runner) -> Optional[str]:
    """Who holds the run lock, when it is a live holder other than Slurm job ``job_id`` (else None)."""
    held = active_holder(RunPaths.of(run_dir).lock, job_active=lambda j: slurm_job_active(j, runner))
    if held is None or (held[0].job_id and str(held[0].job_id) == str(job_id)):
        return None
    holder, why = held
    return f"{holder.describe()} ({why})"
