"""One fake Slurm for every unit test that talks to Slurm (submitit's ``MockedSubprocess`` is the model).

``FakeSlurm`` is a ``subprocess.run``-compatible runner: pass it wherever the product takes a
``runner`` (:class:`recovery.slurm.Slurm` and everything built on it). It records every argv in
``calls`` and answers ``sbatch``, ``squeue``, ``scontrol``, ``sacct``, ``sacctmgr`` and ``sinfo``
the way Slurm 22.05 does on the local test cluster, keeping one job's state:

* ``scontrol update ... ExcNodeList=`` on a RUNNING job fails ("no longer pending execution");
  after ``scontrol requeue`` it is accepted, and it replaces the list;
* ``sbatch --parsable`` prints ``<id>`` (ids count up from ``job_id``), ``--test-only`` prints the
  expected start on stderr; after ``max_jobs`` jobs it refuses with ``fail_words`` (a QOS limit);
* ``squeue -j`` lists the job ``queue_polls`` times, calls ``on_leave`` once, then lists nothing.

``usage`` holds the rows of the spend ledger's ``sacct --format=`` (``analysis.spend.SACCT_FORMAT``).
``fields`` adds words to ``scontrol -o show job`` (``Reason=``, ``Restarts=``, ``PreemptTime=``,
``EndTime=``); ``accounting`` is what ``sacct -X -o State`` says (None: accounting disabled, rc 1).

``health`` answers the in-job health check (``srun`` of one task per ``--nodelist`` host): host -> ``"ok"`` or
``"bad <why>"``; a host not in it does not answer (srun exits 1). ``scontrol show node`` gives ``NodeAddr=127.0.0.1``.

``fail`` names commands (``argv[0:2]`` joined, e.g. ``"scontrol requeue"``, or just ``"sbatch"``)
that exit 1 with ``fail_words``; ``missing`` names programs that are not installed (the runner
raises ``FileNotFoundError`` like ``subprocess.run``).
"""
from __future__ import annotations

import re
import subprocess
from typing import Callable, Iterable, Optional

from analysis.spend import SACCT_FORMAT


def expand(nodelist: str) -> list[str]:
    """``stn[1-2],gpu7`` -> hosts, as ``scontrol show hostnames`` prints them."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r",?([^\[]*)\[([^\]]*)\]", part)
        if not m:
            out.append(part.strip(","))
            continue
        for rng in m.group(2).split(","):
            lo, _, hi = rng.partition("-")
            out += [f"{m.group(1)}{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


class FakeSlurm:
    """A job and the cluster's accounting, as Slurm's commands report them."""

    def __init__(self, job_id: str = "77", state: str = "RUNNING", exc: str = "", attempts: Iterable = (),
                 events: Iterable = (), sinfo: Iterable = (), fail: Iterable[str] = (), fail_words: str = "",
                 missing: Iterable[str] = (), queue_polls: int = 0, on_leave: Optional[Callable[[], None]] = None,
                 max_jobs: Optional[int] = None, fields: str = "", accounting: Optional[str] = None,
                 health: Optional[dict] = None, usage: Iterable = ()):
        self.job_id, self.state, self.exc = job_id, state, exc
        self.attempts = list(attempts)  # sacct rows: (state, nodelist, start, end)
        self.events = list(events)  # sacctmgr rows: (node, time, state, reason)
        self.sinfo = list(sinfo)  # (node, state, reason)
        self.fail, self.fail_words, self.missing = set(fail), fail_words, set(missing)
        self.queue_polls, self.on_leave = queue_polls, on_leave
        self.next_id, self.max_jobs = int(job_id), max_jobs
        self.fields = fields  # more `scontrol show job` words, e.g. "Reason=None Restarts=0 PreemptTime=None"
        self.accounting = accounting  # `sacct -X -o State` of the job ("CANCELLED by 0"); None: no slurmdbd
        self.health = dict(health or {})  # host -> "ok" | "bad <why>"; absent: no answer
        self.usage = list(usage)  # sacct rows of the spend ledger: (elapsed seconds, AllocTRES, state)
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kwargs) -> subprocess.CompletedProcess:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] in self.missing:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: {argv[0]!r}")
        for key in (" ".join(argv[:2]), argv[0]):
            if key in self.fail:
                return self._done(argv, 1, "", self.fail_words or f"{key}: error")
        handler = getattr(self, "_" + argv[0], None)
        if handler is None:
            raise AssertionError(f"unexpected command {argv}")
        return handler(argv)

    def called(self, *prefix: str) -> list[list[str]]:
        """The recorded calls whose argv starts with ``prefix``."""
        return [c for c in self.calls if c[:len(prefix)] == list(prefix)]

    @staticmethod
    def _done(argv, rc=0, out="", err="") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(argv, rc, out, err)

    # ---- one handler per program --------------------------------------------------------------

    def _sbatch(self, argv):
        if "--test-only" in argv:
            return self._done(argv, 0, "", f"sbatch: Job {self.next_id} to start at 2026-01-01T00:00:00 using "
                                           "128 processors on nodes n[1-16] in partition gpu")
        if self.max_jobs is not None and self.next_id - int(self.job_id) >= self.max_jobs:
            return self._done(argv, 1, "", self.fail_words or "sbatch: error: QOSMaxSubmitJobPerUserLimit")
        job_id, self.next_id = self.next_id, self.next_id + 1
        return self._done(argv, 0, f"{job_id}\n" if "--parsable" in argv else f"Submitted batch job {job_id}\n")

    def _squeue(self, argv):
        self.queue_polls -= 1
        if self.queue_polls >= 0:
            return self._done(argv, 0, f"{self.state}\n")
        if self.on_leave is not None:
            self.on_leave()
            self.on_leave = None
        return self._done(argv, 0, "")

    def _scontrol(self, argv):
        if argv[1:3] == ["show", "hostnames"]:
            return self._done(argv, 0, "\n".join(expand(argv[3])) + "\n")
        if argv[1:4] == ["-o", "show", "job"]:
            return self._done(argv, 0, f"JobId={self.job_id} JobState={self.state} "
                                       f"ExcNodeList={self.exc or '(null)'} NodeList=stn[1-2] {self.fields}\n")
        if argv[1:3] == ["show", "node"]:
            return self._done(argv, 0, f"NodeName={argv[3]} Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost\n")
        if argv[1] == "requeue":
            self.state = "COMPLETING"  # requeued: pending again after the old allocation is released
            return self._done(argv, 0)
        if argv[1] == "update":
            if self.state == "RUNNING":
                return self._done(argv, 1, "", f"Job is no longer pending execution for job {self.job_id}")
            self.exc = dict(a.split("=", 1) for a in argv[2:])["ExcNodeList"]
            return self._done(argv, 0)
        raise AssertionError(f"unexpected command {argv}")

    def _sacct(self, argv):
        if argv[-2:] == ["-o", "State"]:  # the accounting state (recovery.slurm.Slurm.accounting_state)
            if self.accounting is None:
                return self._done(argv, 1, "", "sacct: error: Slurm accounting storage is disabled")
            return self._done(argv, 0, f"{self.accounting}\n")
        if f"--format={SACCT_FORMAT}" in argv:  # the spend ledger (analysis/spend.py); Start and End left empty
            return self._done(argv, 0, "".join(f"{self.job_id}|{e}|{t}|{s}||\n" for e, t, s in self.usage))
        rows = [f"{self.job_id}|{s}|{n}|{a}|{b}" for s, n, a, b in self.attempts]
        return self._done(argv, 0, "\n".join(rows) + "\n")

    def _sacctmgr(self, argv):
        nodes = set(argv[argv.index("show") + 2].split("=", 1)[1].split(","))
        rows = [f"{n}|{t}|{s}|{r}" for n, t, s, r in self.events if n in nodes]
        return self._done(argv, 0, "\n".join(rows) + "\n")

    def _sinfo(self, argv):
        return self._done(argv, 0, "\n".join(f"{n}|{s}|{r}" for n, s, r in self.sinfo) + "\n")

    def _srun(self, argv):
        hosts = next(a.split("=", 1)[1] for a in argv if a.startswith("--nodelist=")).split(",")
        lines = [f"{h} {self.health[h]}" for h in hosts if h in self.health]
        return self._done(argv, 0 if len(lines) == len(hosts) else 1, "\n".join(lines) + "\n",
                          "" if len(lines) == len(hosts) else "srun: error: Nodes not responding")
