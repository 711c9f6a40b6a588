"""A step relaunched in the job (``in_job_restart``, a lost node replaced by a spare) ends at the event's time, which
the event log gives to the nanosecond, in an attempt table whose times are at sacct's resolution (microseconds under
pandas 3, seconds from older dumps): the report must store it at the column's resolution, not refuse it."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis.interruptions import _in_job_windows

RELAUNCH = pd.Timestamp("2026-12-01 09:30:00.123456789")  # a float epoch's nanoseconds


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_a_lost_node_relaunch_in_the_job_splits_the_allocation_at_any_resolution(unit):
    win = pd.DataFrame({
        "job": ["2802", "2802"], "attempt": [1, 2],
        "start": pd.Series([pd.Timestamp("2026-12-01 09:00:00"), pd.NaT]).astype(f"datetime64[{unit}]"),
        "end": pd.Series([pd.Timestamp("2026-12-01 10:00:00"), pd.NaT]).astype(f"datetime64[{unit}]"),
        "state": ["COMPLETED", None], "gpus": [4.0, float("nan")]})
    ev = pd.DataFrame({"event": ["in_job_restart"], "job": ["2802"], "attempt": [1], "cause": ["lost_node"],
                       "next_restart_count": [2], "ts": pd.Series([RELAUNCH]).astype("datetime64[ns]")})
    out = _in_job_windows(win, ev)
    relaunch = RELAUNCH.as_unit(unit, round_ok=True)
    lost, spare = out.iloc[0], out.iloc[1]
    assert lost["end"] == relaunch and pd.isna(lost["state"])  # the lost node's step ends at its relaunch
    assert spare["start"] == relaunch and spare["state"] == "COMPLETED"  # the allocation's end passes on
    assert spare["end"] == pd.Timestamp("2026-12-01 10:00:00") and spare["gpus"] == 4.0
    assert out["end"].dtype == win["end"].dtype  # the column keeps its resolution
