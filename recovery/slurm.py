"""The one place slurmtron talks to Slurm: every ``scontrol``, ``sacct``, ``sacctmgr``, ``sinfo``,
``squeue``, ``sbatch`` and ``srun`` (the in-job health check) call goes through :class:`Slurm` and its one injected ``runner``.

The runner is ``subprocess.run``-compatible (``runner(argv, capture_output=True, text=True,
timeout=...)``); the unit tests pass ``tests/fake_slurm.py::FakeSlurm`` there, the product
passes :func:`default_runner`. Every method returns a :class:`Reply` (the exit status and both
streams); a command that cannot run at all (not installed, timed out) is a ``Reply`` with
rc 127 and the reason in ``err``, never an exception, so a missing ``scontrol`` on a
workstation is one log line, not a traceback in a signal path.

Why :func:`default_runner` ignores SIGTERM in the child: accepting ``scontrol requeue``, Slurm
SIGTERMs every process of the job, the ``scontrol`` that asked for it and the ``scontrol
update`` that follows it included (seen on the local test cluster: they exited 143). With
SIGTERM ignored they report their real exit status and finish within ``KillWait``.

No torch, no ``launch`` imports: the batch script, the ranks and the login tools all use it.
"""
from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

Runner = Callable[..., Any]  # subprocess.run-compatible
TIMEOUT_S = 60  # one Slurm command; a slow controller answers within seconds


def _ignore_sigterm() -> None:  # pragma: no cover - runs in the child between fork and exec
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def default_runner(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` with text output, a timeout, and SIGTERM ignored in the child (see above)."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", TIMEOUT_S)
    return subprocess.run(list(argv), preexec_fn=_ignore_sigterm, **kwargs)


@dataclass(frozen=True)
class Reply:
    """What one Slurm command answered."""

    argv: tuple
    rc: int
    out: str = ""
    err: str = ""
    error: Optional[BaseException] = field(default=None, compare=False, repr=False)  # why it could not run

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def words(self) -> str:
        """The command's own words, short enough for a log line or an event."""
        return (self.err or self.out).strip()[:300]


class Slurm:
    """Slurm's command line behind one ``runner``: requeue, exclusion update, queries, sbatch."""

    def __init__(self, runner: Runner = default_runner):
        self.runner = runner

    def call(self, argv: Sequence[str], timeout: Optional[float] = TIMEOUT_S) -> Reply:
        """Run one command; a command that cannot run is rc 127 with the reason in ``err``."""
        argv = [str(a) for a in argv]
        try:
            proc = self.runner(argv, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            return Reply(tuple(argv), 127, "", f"{argv[0]} could not run: {exc}", error=exc)
        return Reply(tuple(argv), int(getattr(proc, "returncode", 0)),
                     getattr(proc, "stdout", "") or "", getattr(proc, "stderr", "") or "")

    # ---- the job itself ----------------------------------------------------------------

    def requeue(self, job_id: str) -> Reply:
        """``scontrol requeue <id>``: the job keeps its id and goes back to the queue."""
        return self.call(["scontrol", "requeue", job_id])

    def show_job(self, job_id: str) -> Reply:
        """``scontrol -o show job <id>``: one line of ``Key=Value`` words."""
        return self.call(["scontrol", "-o", "show", "job", job_id])

    def accounting_state(self, job_id: str) -> Reply:
        """``sacct -X -n -P -o State``: the job's state in the accounting (``CANCELLED by <uid>`` at once on a
        cancel, while ``scontrol`` still shows COMPLETING); rc != 0 without slurmdbd."""
        return self.call(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], timeout=30)

    def update_excluded(self, job_id: str, hosts: Iterable[str]) -> Reply:
        """``scontrol update JobId=<id> ExcNodeList=<hosts>`` (replaces the list; pending jobs only)."""
        return self.call(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(hosts)}"])

    def squeue(self, job_ids: Iterable[str], fmt: str) -> Reply:
        """``squeue -h -j <ids> -o <fmt>``: one line per job Slurm still lists (ended jobs are absent)."""
        return self.call(["squeue", "-h", "-j", ",".join(str(j) for j in job_ids), "-o", fmt])

    def sacct(self, job_ids: Iterable[str], *options: str) -> Reply:
        """``sacct <options> -j <ids>``: accounting rows, also of jobs that ended."""
        return self.call(["sacct", *options, "-j", ",".join(str(j) for j in job_ids)])

    def in_queue(self, job_id: str) -> bool:
        """Whether ``squeue`` still lists the job (pending, running, completing); True if it cannot tell."""
        r = self.call(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout=30)
        if r.rc == 127:
            return True
        if not r.ok:
            return "Invalid job id" not in r.err
        return bool(r.out.strip())

    def sbatch(self, script: str, *options: str) -> Reply:
        """``sbatch <options> <script>`` (no timeout: a busy controller may take a while to accept)."""
        return self.call(["sbatch", *options, str(script)], timeout=None)

    # ---- the cluster ---------------------------------------------------------------------

    def hostnames(self, nodelist: str) -> list[str]:
        """``stn[1-2],gpu7`` -> hosts by ``scontrol show hostnames``; plain comma lists without it; [] if unknown."""
        nodelist = (nodelist or "").strip()
        if not nodelist or nodelist in ("(null)", "None", "None assigned"):
            return []
        if "[" not in nodelist:
            return [h for h in nodelist.split(",") if h]
        r = self.call(["scontrol", "show", "hostnames", nodelist])
        return r.out.split() if r.ok else []

    def attempts(self, job_id: str) -> Reply:
        """Every run of the job (``sacct -D -X``): ``JobIDRaw|State|NodeList|Start|End`` rows."""
        return self.call(["sacct", "-j", job_id, "-D", "-X", "--parsable2", "--noheader",
                          "--format=JobIDRaw,State,NodeList,Start,End"])

    def node_events(self, hosts: Sequence[str], start: str) -> Reply:
        """The accounting event table since ``start``: ``NodeName|TimeStart|State|Reason`` rows."""
        return self.call(["sacctmgr", "-n", "-P", "show", "event", f"Nodes={','.join(hosts)}",
                          f"Start={start}", "format=NodeName,TimeStart,State,Reason"])

    def step(self, hosts: Sequence[str], argv: Sequence[str], *, gpus_per_node: int = 0,
             timeout: Optional[float] = 60) -> Reply:
        """``srun`` one task on each of ``hosts`` inside the current allocation (a short check step), bounded by
        ``timeout``; ``--kill-on-bad-exit=0`` so one bad node's answer does not cut the others'; ``--overlap``
        because a step cut by a lost node keeps its CPUs booked until Slurm gives up on the dead node's
        slurmstepd (seen on Slurm 22.05: minutes; a check step without it waited out its timeout)."""
        opts = [f"--nodelist={','.join(hosts)}", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}",
                "--ntasks-per-node=1", "--cpus-per-task=1", "--kill-on-bad-exit=0", "--overlap",
                "--job-name=slurmtron-health"]
        if gpus_per_node > 0:
            opts.append(f"--gpus-per-node={gpus_per_node}")
        return self.call(["srun", *opts, *argv], timeout=timeout)

    def node_states(self, hosts: Sequence[str]) -> Reply:
        """``sinfo`` per node now: ``NodeName|State|Reason`` rows."""
        return self.call(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N|%T|%E"])
