"""Benchmark: ``analysis/report.py`` on a large run directory.

    python benchmarks/bench_report.py [--steps 100000] [--repeat 2]

Builds the run directory from the recorded 4-attempt Slurm fixture (``tests/fixtures/slurm_run``)
scaled to ``--steps`` logged steps: ``events.jsonl`` gets one ``iteration`` event per step (the
fixture's other events kept), and the last attempt's rank log one Megatron iteration line per
step. Then runs ``python analysis/report.py RUN --out OUT`` in a fresh process ``--repeat`` times
and prints the wall seconds of each run and of each phase (the report's own progress lines).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "slurm_run"


def make_run(dst: Path, steps: int) -> Path:
    shutil.copytree(FIXTURE, dst)
    events = [json.loads(line) for line in (dst / "events.jsonl").read_text().splitlines() if line.strip()]
    it = next(e for e in events if e["event"] == "iteration")
    other = [e for e in events if e["event"] != "iteration"]
    with open(dst / "events.jsonl", "w") as f:
        for e in other[:3]:
            f.write(json.dumps(e) + "\n")
        for s in range(1, steps + 1):
            f.write(json.dumps({**it, "time": it["time"] + s, "step": s, "consumed_samples": 8 * s}) + "\n")
        for e in other[3:]:
            f.write(json.dumps({**e, "time": it["time"] + steps + 1}) + "\n")
    log = max(dst.glob("logs/*_[0-9].out"))
    line = next(ln for ln in log.read_text().splitlines() if " iteration " in ln)
    start = datetime.datetime(2026, 11, 29, 10, 0, 0)
    with open(log, "w") as f:
        for s in range(1, steps + 1):
            ts = (start + datetime.timedelta(seconds=s)).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(re.sub(r"^\[[^\]]*\] iteration +\d+/ +\d+", f"[{ts}] iteration {s:8d}/{steps:8d}", line) + "\n")
    cfg = dst / "config.yaml"
    cfg.write_text(re.sub(r"train_iters: \d+", f"train_iters: {steps}", cfg.read_text()))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        run = make_run(Path(tmp) / "big", args.steps)
        print(f"input: {args.steps:,} steps: events.jsonl {(run / 'events.jsonl').stat().st_size / 1e6:.1f} MB, "
              f"rank logs {sum(p.stat().st_size for p in run.glob('logs/*')) / 1e6:.1f} MB")
        for i in range(args.repeat):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, str(REPO / "analysis" / "report.py"), str(run), "--out",
                                   str(Path(tmp) / f"out{i}")], capture_output=True, text=True, cwd=REPO)
            wall = time.monotonic() - t0
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            phases = [ln for ln in proc.stderr.splitlines() if ln.startswith("report: [")]
            print(json.dumps({"run": i, "wall_s": round(wall, 2), "phases": phases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
