"""Measured MFU beside the planner's estimate, for every layout of a sweep.

``python -m launch.planner.compare <run_root>/sweeps/<id>.jsonl`` reads the sweep registry that
``launch/pretrain.py -m`` writes (one JSON line per member: job id, run dir, layout, status,
and the planner's estimate for submitted ones), parses each run's iteration lines with
``analysis.parse_megatron`` and prints estimated vs measured step time and MFU, then one line with
the median and worst error against the planner's stated bars (``launch/planner/accuracy.py``) and
whether the site's ``cluster.*`` constants need refitting. This is how the planner is kept honest:
a sweep of short benchmark jobs is its calibration data (how to fit each constant:
``launch/planner/steptime.py``, "Calibration").

Measured step time is the median ``elapsed time per iteration`` after the warm-up iterations.
Measured MFU is what the log prints; when a log has no MFU field it is the estimate scaled by
estimated / measured step time (the FLOPs per step are the same formula on both sides).

Login-node code: pandas, no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from analysis.parse_megatron import parse_iterations_file
from launch.paths import RunPaths
from launch.planner.accuracy import STEP_TIME_MEDIAN, STEP_TIME_WORST

WARMUP_ITERS = 2  # the first iterations include compilation, allocator growth and NCCL setup


def load_registry(path: str | Path) -> list[dict[str, Any]]:
    """The registry's entries; unreadable lines are skipped (a sweep may still be appending)."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def log_files(run_dir: str | Path, job_id: Optional[str]) -> list[Path]:
    """The run's Slurm task logs (``logs/<jobid>_<task>.out``); all of them when the id is unknown."""
    logs = RunPaths.of(run_dir).logs
    if not logs.is_dir():
        return []
    pattern = f"{job_id}_*.out" if job_id else "*.out"
    return sorted(p for p in logs.glob(pattern) if p.is_file())


def measure(files: Sequence[Path]) -> dict[str, Optional[float]]:
    """Median step time (s), printed MFU (fraction) and iteration count from the logs' iteration lines."""
    import pandas as pd

    frames = [parse_iterations_file(f)[0] for f in files]
    frames = [f for f in frames if len(f)]
    if not frames:
        return {"step_s": None, "mfu": None, "iterations": 0}
    df = pd.concat(frames, ignore_index=True).drop_duplicates(subset=["iteration"], keep="last")
    steady = df[df["iteration"] > WARMUP_ITERS]
    if steady.empty:
        steady = df
    step = steady["elapsed_ms"].median()
    mfu = steady["mfu_pct"].median()
    return {
        "step_s": float(step) / 1000 if pd.notna(step) else None,
        "mfu": float(mfu) / 100 if pd.notna(mfu) else None,
        "iterations": int(df["iteration"].max()),
    }


def compare(path: str | Path) -> "Any":
    """One row per registry entry: layout, status, estimated and measured step time and MFU."""
    import pandas as pd

    rows = []
    for e in load_registry(path):
        est = e.get("estimate") or {}
        row = {
            "job_id": e.get("job_id"), "layout": est.get("layout") or e.get("layout"), "status": e.get("status"),
            "est_step_s": est.get("step_time_s"), "est_mfu": est.get("mfu"),
            "meas_step_s": None, "meas_mfu": None, "iterations": 0,
            "reasons": "; ".join(e.get("reasons") or []),
        }
        if e.get("status") == "submitted" and e.get("run_dir"):
            m = measure(log_files(e["run_dir"], e.get("job_id")))
            row.update(meas_step_s=m["step_s"], iterations=m["iterations"], meas_mfu=m["mfu"])
            if row["meas_mfu"] is None and m["step_s"] and row["est_mfu"] and row["est_step_s"]:
                row["meas_mfu"] = row["est_mfu"] * row["est_step_s"] / m["step_s"]
        if row["meas_step_s"] and row["est_step_s"]:
            row["est_over_meas"] = row["est_step_s"] / row["meas_step_s"]
        rows.append(row)
    cols = ["job_id", "layout", "status", "est_step_s", "meas_step_s", "est_mfu", "meas_mfu", "est_over_meas",
            "iterations", "reasons"]
    return pd.DataFrame(rows).reindex(columns=cols)


def main(argv: Sequence[str] | None = None, out=print) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.planner.compare",
                                 description="estimated vs measured step time and MFU for a sweep")
    ap.add_argument("registry", help="<run_root>/sweeps/<sweep id>.jsonl")
    args = ap.parse_args(argv)
    if not Path(args.registry).is_file():
        out(f"no such sweep registry: {args.registry}")
        return 2
    df = compare(args.registry)
    if df.empty:
        out(f"{args.registry}: no entries")
        return 0
    out(df.to_string(index=False, float_format=lambda x: f"{x:.4g}", na_rep="-"))
    line = calibration_line(df)
    if line:
        out(line)
    return 0


def calibration_line(df: "Any") -> str:
    """One line against the planner's stated error: the median and worst estimated / measured step
    time over the measured members, and whether the site's ``cluster.*`` constants need refitting
    (see ``launch/planner/steptime.py``, "Calibration")."""
    ratios = [r for r in df["est_over_meas"].dropna()] if "est_over_meas" in df else []
    if not ratios:
        return ""
    errors = sorted(abs(r - 1) for r in ratios)
    median = errors[len(errors) // 2] if len(errors) % 2 else (errors[len(errors) // 2 - 1] + errors[len(errors) // 2]) / 2
    ok = median <= STEP_TIME_MEDIAN and errors[-1] <= STEP_TIME_WORST
    verdict = ("within the planner's stated error" if ok else
               "outside the planner's stated error: refit this site's cluster.planner.* constants "
               "(achievable_fraction, latencies, step_overhead_s, step_jitter; launch/planner/steptime.py)")
    return (f"estimated / measured step time over {len(ratios)} measured layout(s): median |error| "
            f"{100 * median:.1f}%, worst {100 * errors[-1]:.1f}% (bars {100 * STEP_TIME_MEDIAN:.0f}% / "
            f"{100 * STEP_TIME_WORST:.0f}%): {verdict}")


if __name__ == "__main__":
    sys.exit(main())
