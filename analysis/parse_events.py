"""Read slurmtron's event log (``<run_dir>/events.jsonl``) into a DataFrame.

The format is documented in ``recovery/events.py`` (not imported: analysis depends on no
other slurmtron package). One JSON object per line with ``time`` (unix seconds),
``event``, ``job_id``, ``restart_count``, ``rank``, ``host`` and per-kind fields:
job_start (world_size, layout, train_iters), resume (step, checkpoint, consumed_samples,
from_layout), resume_fallback, signal (signal, step), checkpoint_saved (step, path,
seconds, bytes, reason), checkpoint_interval, requeue (method, step), stop (reason, code,
detail), exit (reason, code, step), train_end (step, consumed_samples).

A killed job can leave a torn last line, and a shared file system can interleave writes:
lines that are not JSON objects are skipped and counted, never raised.
"""
from __future__ import annotations

import json
import os

import pandas as pd

from analysis.parse_megatron import read_text

__all__ = ["EVENT_COLUMNS", "parse_events_text", "parse_events_file"]

EVENT_COLUMNS = ["time", "ts", "event", "job_id", "restart_count", "rank", "host", "step"]


def parse_events_text(text: str) -> tuple[pd.DataFrame, int]:
    """Events in file order; ``ts`` is ``time`` as naive local time (as Megatron prints).

    ``step`` gathers the step of resume/signal/checkpoint_saved/requeue/exit/train_end.
    Records without a numeric ``time`` or a string ``event`` are skipped.
    """
    records, skipped = [], 0
    for line in text.splitlines():  # event logs are small: tens of lines per attempt
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("event"), str)
            or not isinstance(rec.get("time"), (int, float))
            or isinstance(rec.get("time"), bool)
            or not (0 <= rec["time"] < 1e11)
        ):
            skipped += 1
            continue
        records.append(rec)
    df = pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=EVENT_COLUMNS)
    for c in EVENT_COLUMNS:
        if c not in df:
            df[c] = None
    df["time"] = pd.to_numeric(df["time"], errors="coerce").astype("float64")
    df["ts"] = (
        pd.to_datetime(df["time"], unit="s", utc=True).dt.tz_convert(_local_tz()).dt.tz_localize(None)
        if len(df) else pd.Series(dtype="datetime64[ns]")
    )
    df["job_id"] = df["job_id"].map(lambda v: None if v is None or v != v else str(v))
    df["restart_count"] = _whole(df["restart_count"])
    df["step"] = _whole(df["step"])
    cols = EVENT_COLUMNS + [c for c in df.columns if c not in EVENT_COLUMNS]
    return df[cols].reset_index(drop=True), skipped


def _whole(col: pd.Series) -> pd.Series:
    """A step or count column as ``Int64``; what is not a whole number a float holds exactly (text, ``1e400``
    read as inf, nan, 2.5, 1e30) becomes missing instead of ending the report with an OverflowError."""
    x = pd.to_numeric(col, errors="coerce").astype("float64")
    x = x.where(x.abs().lt(2.0 ** 53) & x.eq(x.round()))
    return x.astype("Int64")


def _local_tz():
    from datetime import datetime

    return datetime.now().astimezone().tzinfo


def parse_events_file(path: str | os.PathLike) -> tuple[pd.DataFrame, int]:
    """:func:`parse_events_text` of a file; a missing file is an empty log."""
    if not os.path.exists(path):
        return parse_events_text("")
    return parse_events_text(read_text(path))
