"""Error signatures in job output: what ended (or is about to end) a training attempt.

Each hit becomes a row with a ``kind`` and, where the kind names a cause of an
interruption, a :class:`launch.kinds.Cause`. The report picks one cause per
interruption by the causes' priority (a dead node makes NCCL time out on every other
node, so the node failure, not the timeout, is the cause). A cause found in job output is
one :data:`DETECTORS` row (its pattern and the literals its lines hold).

Patterns follow the text the tools really print:

* Slurm ``slurmstepd``: ``*** JOB 1999616 ON r6i4n5 CANCELLED AT 2021-05-27T21:42:11 DUE TO
  TIME LIMIT ***`` (also ``DUE TO PREEMPTION``, ``DUE TO NODE FAILURE``); without ``DUE TO``
  it is a plain ``scancel`` (user cancel). ``*** STEP ...`` lines repeat the job line.
* PyTorch's NCCL watchdog: ``Watchdog caught collective operation timeout``.
* CUDA OOM: ``CUDA out of memory`` / ``torch.OutOfMemoryError``; the kernel OOM killer via
  ``slurmstepd: error: Detected 1 oom_kill event``.
* GPU Xid (kernel log, or forwarded by health checks): ``NVRM: Xid (PCI:0000:3b:00): 79, ...``;
  and the other node hardware faults of launch/hardware_faults.py (ECC, a GPU off the bus, a CUDA
  device fault, NVLink, InfiniBand): kind ``hardware``, cause ``xid``.
* NaN/Inf: Megatron's ``found NaN in local grad norm``, rerun-machine messages, and
  ``lm loss: nan`` / ``grad norm: inf`` fields.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from launch.hardware_faults import HARDWARE_FAULTS
from launch.kinds import Cause

__all__ = ["DETECTORS", "Detector", "candidate_lines", "SIGNATURE_COLUMNS", "parse_signature_text",
           "slurm_reason_cause"]

_SLURM_REASONS = {
    "TIME LIMIT": Cause.TIME_LIMIT,
    "PREEMPTION": Cause.PREEMPTION,
    "NODE FAILURE": Cause.NODE_FAILURE,
    "NODE_FAIL": Cause.NODE_FAILURE,
}


def slurm_reason_cause(reason: str | None) -> Cause:
    """Cause for the ``DUE TO ...`` text of a slurmstepd cancel line (None: user cancel)."""
    if reason is None or reason == "":
        return Cause.USER_CANCEL
    r = reason.strip().upper()  # e.g. "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS"
    return next((c for k, c in _SLURM_REASONS.items() if r.startswith(k)), Cause.UNKNOWN)


@dataclass(frozen=True)
class Detector:
    """One error signature of job output: a hit is a row of ``kind`` with ``cause``; every line ``pattern``
    matches holds one of ``literals`` (the fast pre-filter of :func:`candidate_lines`)."""

    kind: str
    cause: Cause
    pattern: str
    literals: tuple[str, ...]


# The causes found in job output, in the order they are tried on a line. The node hardware faults are the
# table exclusion uses (launch/hardware_faults.py).
DETECTORS: tuple[Detector, ...] = (
    Detector("nccl_timeout", Cause.NCCL_TIMEOUT,
             r"Watchdog caught collective operation timeout[^\n]{0,200}"
             r"|ProcessGroupNCCL[^\n]{0,80}?(?:[Tt]imeout|timed out|watchdog)[^\n]{0,120}"
             r"|NCCL (?:communicator was aborted|watchdog thread terminated|timeout)[^\n]{0,120}",
             ("Watchdog caught", "ProcessGroupNCCL", "NCCL comm", "NCCL watchdog", "NCCL timeout")),
    Detector("oom", Cause.OOM,
             r"CUDA out of memory[^\n]{0,160}|OutOfMemoryError[^\n]{0,160}"
             r"|Detected [0-9]+ oom[-_]kill event[^\n]{0,80}",
             ("out of memory", "OutOfMemoryError", "oom")),
    *(Detector(f.kind, f.cause, f"(?i:{f.pattern})[^\n]{{0,160}}", f.literals) for f in HARDWARE_FAULTS),
    Detector("nan", Cause.NAN,
             r"found (?:NaN|Inf|nan|inf) in [^\n]{0,80}|(?:NaN|Inf) detected[^\n]{0,80}"
             r"|Unexpected result (?:nan|inf)[^\n]{0,80}"
             r"|(?:lm loss|lm-loss|grad norm): [-+]?(?i:nan|inf)\b",
             ("found ", " detected", "Unexpected result", ": nan", ": inf", ": -nan", ": -inf", ": +nan", ": NaN",
              ": Inf")),
    Detector("node_failure", Cause.NODE_FAILURE, r"srun: error: Node failure on [^\n]{0,80}", ("Node failure",)),
)


_SIGNATURE_RE = re.compile(
    r"(?P<cancel>\*\*\* (?P<scope>JOB|STEP) (?P<sjob>[0-9][0-9_.+A-Za-z]*) ON (?P<host>[^ \t\n]+) "
    r"CANCELLED AT (?P<at>[0-9T:\-]+)(?: DUE (?i:to) (?P<reason>[^*\n]*?))? ?\*\*\*)"
    + "".join(f"|(?P<d{i}>{d.pattern})" for i, d in enumerate(DETECTORS))
    + r"|(?P<marker>slurmtron: job (?P<mjob>[0-9_]+) restart (?P<restart>[0-9]+))"
    r"|(?P<signal>received signal (?:SIG)?[A-Z0-9]+|Main process received SIG[A-Z]+[^\n]{0,60}"
    r"|Killing subprocess [0-9]+)"
)

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
_LITERALS = tuple(dict.fromkeys((
    "CANCELLED AT", *(lit for d in DETECTORS for lit in d.literals), "received ", "Killing subprocess",
    "slurmtron: job",
)))


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

    ``kind`` is one of slurm_cancel, slurm_step_cancel, a :data:`DETECTORS` kind (nccl_timeout,
    oom, xid, hardware, nan, node_failure), signal, attempt_start (slurmtron's batch-script banner; ``detail`` holds
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
            cause = slurm_reason_cause(g["reason"]).value if scope == "JOB" or g["reason"] else None
            recs.append((source, job_id, off, "slurm_cancel" if scope == "JOB" else "slurm_step_cancel",
                         cause, detail, g["sjob"], g["host"], g["at"], None))
            continue
        if g["marker"]:  # the batch script's "slurmtron: job J restart K": later lines are attempt K
            recs.append((source, job_id, off, "attempt_start", None, g["restart"], g["mjob"], None, None, None))
            continue
        at, md = _line_time(text, m.start())
        hit = next((d for i, d in enumerate(DETECTORS) if g[f"d{i}"]), None)
        if hit is not None:
            recs.append((source, job_id, off, hit.kind, hit.cause.value, detail, None, None, at, md))
        else:
            recs.append((source, job_id, off, "signal", None, detail, None, None, at, md))
    df = pd.DataFrame(recs, columns=SIGNATURE_COLUMNS)
    df["at"] = pd.to_datetime(df["at"], format="%Y-%m-%dT%H:%M:%S", errors="coerce")
    return df, 0
