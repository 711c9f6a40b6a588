"""Parse ``sacct --parsable2`` output, including ``-D`` (duplicates: one row per requeued attempt).

The fields are whatever ``--format`` asked for: the header line that is present names them,
so a dump made with a different ``--format`` still parses. Several dumps concatenated (each
with its own header) are fine too. Lines that are not ``|``-separated records with the
header's field count (shell noise, a truncated last line, binary junk) are skipped and
counted.

Normalised columns added when the source fields are there:

* ``job`` (the allocation id: ``123`` of ``123.batch``, ``123_4`` of an array task),
  ``step`` (``batch``, ``0``, ``extern``, or ``""`` for the allocation row), ``is_alloc``;
* ``state`` (first word of ``State``, e.g. ``CANCELLED`` of ``CANCELLED by 1234``) and
  ``cancelled_by``;
* ``submit``, ``start``, ``end`` as timestamps (``Unknown``/``None`` -> NaT),
  ``elapsed_s`` from ``[D-]HH:MM:SS``;
* ``gpus`` from ``AllocTRES`` (``gres/gpu=16``), ``nnodes`` from ``NNodes``;
* ``attempt``: 0, 1, ... per allocation row of the same ``job`` in submit order; with
  ``-D`` Slurm keeps one row per requeued attempt.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from analysis.parse_megatron import read_text
from launch.kinds import Cause

__all__ = ["SACCT_STATE_CAUSE", "parse_sacct_text", "parse_sacct_file", "elapsed_seconds"]

# sacct State of an attempt that ended -> interruption cause (None: not an interruption).
SACCT_STATE_CAUSE: dict[str, Cause | None] = {
    "TIMEOUT": Cause.TIME_LIMIT,
    "PREEMPTED": Cause.PREEMPTION,
    "NODE_FAIL": Cause.NODE_FAILURE,
    "OUT_OF_MEMORY": Cause.OOM,
    "CANCELLED": Cause.USER_CANCEL,
    "FAILED": Cause.UNKNOWN,
    "BOOT_FAIL": Cause.NODE_FAILURE,
    "DEADLINE": Cause.TIME_LIMIT,
    "REQUEUED": Cause.UNKNOWN,  # refined from the log / event log (who asked for the requeue)
    "COMPLETED": None,
    "RUNNING": None,
    "PENDING": None,
}


def elapsed_seconds(s: pd.Series) -> pd.Series:
    """``[D-]HH:MM:SS`` or ``MM:SS(.mmm)`` (sacct Elapsed) to seconds; garbage -> NaN."""
    s = s.astype("string").str.strip()
    parts = s.str.extract(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)$")
    d = pd.to_numeric(parts[0], errors="coerce").fillna(0)
    h = pd.to_numeric(parts[1], errors="coerce").fillna(0)
    m = pd.to_numeric(parts[2], errors="coerce")
    sec = pd.to_numeric(parts[3], errors="coerce")
    return (d * 86400 + h * 3600 + m * 60 + sec).astype("float64")


def _time(s: pd.Series) -> pd.Series:
    return pd.to_datetime(s.where(~s.isin(["Unknown", "None", ""])), format="%Y-%m-%dT%H:%M:%S", errors="coerce")


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    cols = {c.lower(): c for c in df.columns}
    if "jobid" not in cols and "jobidraw" in cols:
        cols["jobid"] = cols["jobidraw"]
    out = df.copy()
    if "jobid" in cols:
        jid = out[cols["jobid"]].astype(str)
        out["job"] = jid.str.split(".", n=1).str[0].str.split("+", n=1).str[0]
        out["step"] = jid.str.extract(r"^[^.]*\.(.*)$", expand=False).astype(object).fillna("")
        out["is_alloc"] = ~jid.str.contains(".", regex=False)
    if "state" in cols:
        st = out[cols["state"]].astype(str).str.strip()
        out["state"] = st.str.split(" ", n=1).str[0].str.rstrip("+")
        out["cancelled_by"] = st.str.extract(r"by (\S+)", expand=False)
    for name in ("submit", "start", "end", "eligible"):
        if name in cols:
            out[name] = _time(out[cols[name]].astype(str).str.strip())
    if "elapsed" in cols:
        out["elapsed_s"] = elapsed_seconds(out[cols["elapsed"]])
    if "nnodes" in cols:
        out["nnodes"] = pd.to_numeric(out[cols["nnodes"]], errors="coerce")
    if "alloctres" in cols:
        out["gpus"] = pd.to_numeric(
            out[cols["alloctres"]].astype(str).str.extract(r"gres/gpu(?::[^=,]+)?=(\d+)", expand=False),
            errors="coerce",
        )
    if "job" in out and "is_alloc" in out:
        order = out["submit"] if "submit" in out else pd.Series(np.arange(len(out)), index=out.index)
        alloc = out[out["is_alloc"]].assign(_o=order).sort_values(["job", "_o"], kind="stable")
        out["attempt"] = pd.NA
        out.loc[alloc.index, "attempt"] = alloc.groupby("job").cumcount().to_numpy()
        # a step belongs to the latest attempt of its job that started before it
        if "start" in out:
            for i in out.index[~out["is_alloc"]]:  # steps are few: a handful per attempt
                a = alloc[alloc["job"] == out.at[i, "job"]]
                if a.empty:
                    continue
                started = int((a["start"] <= out.at[i, "start"]).sum())
                out.at[i, "attempt"] = max(started - 1, 0) if pd.notna(out.at[i, "start"]) else len(a) - 1
        out["attempt"] = pd.to_numeric(out["attempt"], errors="coerce").astype("Int64")
    return out


def parse_sacct_text(text: str) -> tuple[pd.DataFrame, int]:
    """All records of one or more ``sacct --parsable2`` dumps, and the count of skipped lines.

    A header is a line with a ``JobID`` (or ``JobIDRaw``) field, in any position. Records
    before any header cannot be interpreted and are skipped.
    """
    lines = pd.Series(text.splitlines(), dtype=object)
    if lines.empty:
        return pd.DataFrame(), 0
    nonblank = lines[lines.str.strip().astype(bool)]
    is_header = nonblank.str.contains(r"(?:^|\|)JobID(?:Raw)?(?:\||$)", regex=True)
    block = is_header.cumsum()
    frames, skipped = [], int((block == 0).sum())
    for b in sorted(set(block[block > 0])):
        part = nonblank[block == b]
        header = part.iloc[0].rstrip("|").split("|")
        body = part.iloc[1:]
        body = body[~is_header.loc[body.index]]
        fields = body.str.rstrip("\n").str.split("|")
        # --parsable2 has no trailing bar; --parsable has one: accept both
        n = fields.str.len()
        trailing = n == len(header) + 1
        fields = fields.where(~trailing, fields.str[:-1])
        good = fields.str.len() == len(header)
        skipped += int((~good).sum())
        if good.any():
            frames.append(pd.DataFrame(fields[good].tolist(), columns=header, dtype=object))
    if not frames:
        return pd.DataFrame(), skipped
    df = pd.concat(frames, ignore_index=True)
    return _normalise(df), skipped


def parse_sacct_file(path: str | os.PathLike) -> tuple[pd.DataFrame, int]:
    """:func:`parse_sacct_text` of a file read as bytes (decoded with ``errors="replace"``)."""
    df, skipped = parse_sacct_text(read_text(path))
    if not df.empty:
        df.insert(0, "source", str(path))
    return df, skipped
