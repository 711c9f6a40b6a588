"""Error signatures in job output: what ended (or is about to end) a training attempt.

Each hit becomes a row with a ``kind`` and, where the kind names a cause of an
interruption, a ``cause`` from :data:`CAUSES`. The report picks one cause per
interruption with :data:`CAUSE_PRIORITY` (a dead node makes NCCL time out on every other
node, so the node failure, not the timeout, is the cause).

Patterns follow the text the tools really print:

* Slurm ``slurmstepd``: ``*** JOB 1999616 ON r6i4n5 CANCELLED AT 2021-05-27T21:42:11 DUE TO
  TIME LIMIT ***`` (also ``DUE TO PREEMPTION``, ``DUE TO NODE FAILURE``); without ``DUE TO``
  it is a plain ``scancel`` (user cancel). ``*** STEP ...`` lines repeat the job line.
* PyTorch's NCCL watchdog: ``Watchdog caught collective operation timeout``.
* CUDA OOM: ``CUDA out of memory`` / ``torch.OutOfMemoryError``; the kernel OOM killer via
  ``slurmstepd: error: Detected 1 oom_kill event``.
* GPU Xid (kernel log, or forwarded by health checks): ``NVRM: Xid (PCI:0000:3b:00): 79, ...``.
* NaN/Inf: Megatron's ``found NaN in local grad norm``, rerun-machine messages, and
  ``lm loss: nan`` / ``grad norm: inf`` fields.
"""
from __future__ import annotations

import re

import pandas as pd

__all__ = ["CAUSES", "EXCLUSION_CAUSE", "candidate_lines", "CAUSE_PRIORITY", "DECIDED_CAUSES", "SIGNATURE_COLUMNS", "parse_signature_text", "slurm_reason_cause"]

CAUSES = [
    "time_limit", "preemption", "node_failure", "nccl_timeout", "oom", "nan", "xid", "hang", "crash",
    "user_cancel", "user_stop", "user_requeue", "node_exclusion", "unknown",
]
# An attempt that landed on a recorded failed node and requeued away before training (recovery/exclusion.py).
EXCLUSION_CAUSE = "node_exclusion"
# Most specific root cause first.
CAUSE_PRIORITY = ["node_failure", "xid", "oom", "nan", "nccl_timeout", "hang", "crash", "preemption", "time_limit",
                  "user_requeue", "user_stop", "user_cancel", "node_exclusion", "unknown"]
# Causes the ranks decided themselves from Slurm's own answer at the stop (the event log's ``stop``
# reason, recovery/stop.py): they name the attempt's cause over any guess from logs or sacct.
DECIDED_CAUSES = ("user_cancel", "user_stop", "user_requeue", "preemption", "time_limit", "node_failure")

_SLURM_REASONS = {
    "TIME LIMIT": "time_limit",
    "PREEMPTION": "preemption",
    "NODE FAILURE": "node_failure",
    "NODE_FAIL": "node_failure",
}


def slurm_reason_cause(reason: str | None) -> str:
    """Cause for the ``DUE TO ...`` text of a slurmstepd cancel line (None: user cancel)."""
    if reason is None or reason == "":
        return "user_cancel"
    r = reason.strip().upper()  # e.g. "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS"
    return next((c for k, c in _SLURM_REASONS.items() if r.startswith(k)), "unknown")


_SIGNATURE_RE = re.compile(
    r"(?P<cancel>\*\*\* (?P<scope>JOB|STEP) (?P<sjob>[0-9][0-9_.+A-Za-z]*) ON (?P<host>[^ \t\n]+) "
    r"CANCELLED AT (?P<at>[0-9T:\-]+)(?: DUE (?i:to) (?P<reason>[^*\n]*?))? ?\*\*\*)"
    r"|(?P<nccl>Watchdog caught collective operation timeout[^\n]{0,200}"
    r"|ProcessGroupNCCL[^\n]{0,80}?(?:[Tt]imeout|timed out|watchdog)[^\n]{0,120}"
    r"|NCCL (?:communicator was aborted|watchdog thread terminated|timeout)[^\n]{0,120})"
    r"|(?P<oom>CUDA out of memory[^\n]{0,160}|OutOfMemoryError[^\n]{0,160}"
    r"|Detected [0-9]+ oom[-_]kill event[^\n]{0,80})"
    r"|(?P<xid>NVRM: Xid \([^)\n]*\): (?P<xid_code>[0-9]+)[^\n]{0,120})"
    r"|(?P<nan>found (?:NaN|Inf|nan|inf) in [^\n]{0,80}|(?:NaN|Inf) detected[^\n]{0,80}"
    r"|Unexpected result (?:nan|inf)[^\n]{0,80}"
    r"|(?:lm loss|lm-loss|grad norm): [-+]?(?i:nan|inf)\b)"
    r"|(?P<nodefail>srun: error: Node failure on [^\n]{0,80})"
    r"|(?P<marker>slurmtron: job (?P<mjob>[0-9_]+) restart (?P<restart>[0-9]+))"
    r"|(?P<signal>received signal (?:SIG)?[A-Z0-9]+|Main process received SIG[A-Z]+[^\n]{0,60}"
    r"|Killing subprocess [0-9]+)"
)

_GROUP = {"nccl_timeout": "nccl", "oom": "oom", "xid": "xid", "nan": "nan", "node_failure": "nodefail"}
SIGNATURE_COLUMNS = ["source", "job_id", "offset", "kind", "cause", "detail", "slurm_job", "host", "at", "at_md"]

# Times printed at the start of the hit's line: Megatron/Python logging ("[2026-11-29 10:00:00")
# or glog as PyTorch's C++ side prints it ("[E1129 10:19:00.123"), which has no year.
_LINE_TIME_RE = re.compile(
    r"(?P<iso>[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}:[0-9]{2})"
    r"|\[[IWEF](?P<md>[0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2})"
)


def _line_time(text: str, pos: int) -> tuple[str | None, str | None]:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    m = _LINE_TIME_RE.search(text, start, end if end >= 0 else len(text))
    if not m:
        return None, None
    return (m.group("iso").replace(" ", "T"), None) if m.group("iso") else (None, m.group("md"))


# Literals one of which every signature line holds: ``str.find`` over the chunk (C, fast) picks
# the few candidate lines; the full pattern then runs on those lines only. Running the
# alternation over every position of a multi-GB log is ~50x slower.
_LITERALS = (
    "CANCELLED AT", "Watchdog caught", "ProcessGroupNCCL", "NCCL comm", "NCCL watchdog", "NCCL timeout",
    "out of memory", "OutOfMemoryError", "oom", "NVRM: Xid", "found ", " detected", "Unexpected result",
    ": nan", ": inf", ": -nan", ": -inf", ": +nan", ": NaN", ": Inf", "Node failure", "received ", "Killing subprocess",
    "slurmtron: job",
)


def candidate_lines(text: str, literals: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, end) of every line of ``text`` holding one of ``literals``, in file order."""
    starts: set[int] = set()
    for lit in literals:
        pos = text.find(lit)
        while pos >= 0:
            starts.add(text.rfind("\n", 0, pos) + 1)
            pos = text.find(lit, pos + len(lit))
    out = []
    for st in sorted(starts):
        end = text.find("\n", st)
        out.append((st, len(text) if end < 0 else end))
    return out


def parse_signature_text(text: str, *, source: str = "", job_id: str | None = None,
                         base_offset: int = 0) -> tuple[pd.DataFrame, int]:
    """Every error signature in ``text``, in file order, with its cause; ``skipped`` is 0.

    ``kind`` is one of slurm_cancel, slurm_step_cancel, nccl_timeout, oom, xid, nan,
    node_failure, signal, attempt_start (slurmtron's batch-script banner; ``detail`` holds
    the restart count, so the lines after it belong to that attempt).
    ``cause`` is None for ``signal`` rows (a SIGTERM is a consequence, not a cause).
    ``at`` is the cancel time Slurm printed, or the time at the start of the hit's line
    (naive local time); ``at_md`` keeps a year-less glog time (``"1129 10:19:00"``) for
    the caller to complete.
    """
    recs = []
    for m in (m for st, en in candidate_lines(text, _LITERALS) for m in _SIGNATURE_RE.finditer(text, st, en)):
        g = m.groupdict()
        off = base_offset + m.start()
        detail = m.group(0)[:240]
        if g["cancel"]:
            scope = g["scope"]
            # a step cancelled without a reason is how every requeue (ours included) ends a step:
            # only the job-level line says "plain scancel"
            cause = slurm_reason_cause(g["reason"]) if scope == "JOB" or g["reason"] else None
            recs.append((source, job_id, off, "slurm_cancel" if scope == "JOB" else "slurm_step_cancel",
                         cause, detail, g["sjob"], g["host"], g["at"], None))
            continue
        if g["marker"]:  # the batch script's "slurmtron: job J restart K": later lines are attempt K
            recs.append((source, job_id, off, "attempt_start", None, g["restart"], g["mjob"], None, None, None))
            continue
        at, md = _line_time(text, m.start())
        for kind in ("nccl_timeout", "oom", "xid", "nan", "node_failure"):
            if g[_GROUP[kind]]:
                recs.append((source, job_id, off, kind, kind, detail, None, None, at, md))
                break
        else:
            recs.append((source, job_id, off, "signal", None, detail, None, None, at, md))
    df = pd.DataFrame(recs, columns=SIGNATURE_COLUMNS)
    df["at"] = pd.to_datetime(df["at"], format="%Y-%m-%dT%H:%M:%S", errors="coerce")
    return df, 0
