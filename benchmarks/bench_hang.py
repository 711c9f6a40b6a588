"""Hang detection latency and the cost of the live checks, on the real worker (no Slurm).

``python benchmarks/bench_hang.py [--repeats 2] [--append benchmarks/RESULTS.md]``

* **Detection latency**: a 2-rank tiny-model run (the local fault harness :mod:`tests.faults`
  plays Slurm) gets SIGSTOP on rank 1 after 4 steps; measured from the SIGSTOP to the moment
  rank 0's watcher wrote ``summary.json`` (stacks of every rank taken, suspects named, events
  recorded; the ranks are killed right after). Compared with the deadline in force and with
  what would end the hang otherwise: the process-group timeout (1800 s; a stopped rank outside
  any collective is never caught by it, only by the time limit) and nvidia-resiliency-ext's
  default heartbeat timeouts (``initial_rank_heartbeat_timeout`` 3600 s,
  ``rank_heartbeat_timeout`` 2700 s in 0.4.1's ``FaultToleranceConfig``).
* **Overhead**: an uninterrupted run with the default live checks (heartbeats every step,
  straggler all-gather every ``training.stragglers.interval`` steps); every rank times the
  checks themselves and reports them against its median step (the ``live_checks`` event).
  Runs with the checks off (``training.watchdog.enabled=false training.stragglers.interval=0``),
  alternating with runs with them on, give the median step time for comparison (on a shared
  2-core machine the load moves more than the checks cost; the direct timing is the figure of
  record).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from faults import Fault, run_until_done  # noqa: E402
from launch.compose import compose_job, job_to_yaml  # noqa: E402
from recovery.events import read_events  # noqa: E402

FLOOR = 4.0


def _write(run_dir: Path, iters: int, *extra: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job(["parallelism=tp1", "cluster.gpus_per_node=2", "cluster.nodes=1", f"training.train_iters={iters}",
                       "training.checkpoint_interval=3", f"run.dir={run_dir}", f"training.watchdog.step_floor_s={FLOOR}",
                       "training.watchdog.startup_s=240", *extra])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))


def latency(root: Path, i: int) -> dict:
    d = root / f"stop{i}"
    _write(d, 8)
    atts = run_until_done(d, 2, [[Fault("stop_rank", after_steps=4, rank=1)]], timeout_s=600)
    summary = json.loads((d / "hangs" / "local_0" / "summary.json").read_text())
    stopped = atts[0].fired[0][1]
    return {"latency_s": summary["ended"] - stopped, "deadline_s": summary["missed"]["seconds"],
            "detected_s": summary["detected"] - stopped, "suspects": [s["rank"] for s in summary["suspects"]],
            "ok": [a.code for a in atts] == [-9, 0]}


def overhead(root: Path, iters: int, pairs: int = 2) -> dict:
    """Runs with the checks on and off, alternating (the load of a shared machine drifts)."""
    def med(d: Path) -> float:
        return statistics.median(float(e["seconds"]) for e in read_events(d / "events.jsonl")
                                 if e["event"] == "iteration" and int(e["step"]) > 2)
    on_s, off_s, live = [], [], []
    for i in range(pairs):
        on, off = root / f"on{i}", root / f"off{i}"
        _write(on, iters, "training.checkpoint_interval=1000")
        _write(off, iters, "training.checkpoint_interval=1000", "training.watchdog.enabled=false",
               "training.stragglers.interval=0")
        run_until_done(on, 2, [], timeout_s=900)
        run_until_done(off, 2, [], timeout_s=900)
        live += [e for e in read_events(on / "events.jsonl") if e["event"] == "live_checks"]
        on_s.append(med(on))
        off_s.append(med(off))
    return {"overhead": statistics.median(e["overhead"] for e in live),
            "live_ms": statistics.median(e["seconds"] for e in live) * 1000, "steps": iters,
            "median_on_s": statistics.median(on_s), "median_off_s": statistics.median(off_s),
            "on_runs": on_s, "off_runs": off_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--append", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_hang_") as tmp:
        root = Path(tmp)
        lat = [latency(root, i) for i in range(a.repeats)]
        ov = overhead(root, a.iters)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    ls = [x["latency_s"] for x in lat]
    text = "\n".join([
        f"## Hang detection latency and live-check overhead ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"commit {commit})", "",
        f"`python benchmarks/bench_hang.py --repeats {a.repeats} --iters {a.iters}`", "",
        f"2 CPU ranks (gloo), model=tiny, {time.time() - t0:.0f} s wall; load average {load} on "
        f"{os.cpu_count()} cores (shared machine).", "",
        "| quantity | value |", "|---|---|",
        f"| SIGSTOP rank 1 -> hang detected (deadline missed) | "
        + ", ".join(f"{x['detected_s']:.1f} s" for x in lat) + " |",
        f"| SIGSTOP rank 1 -> attempt ended (stacks, suspects, events) | "
        + ", ".join(f"{x:.1f} s" for x in ls) + f" (median {statistics.median(ls):.1f} s) |",
        f"| step deadline in force | " + ", ".join(f"{x['deadline_s']:.1f} s" for x in lat)
        + f" (max(5 x median step, floor {FLOOR:g} s)) |",
        f"| suspect named | " + ", ".join(str(x["suspects"]) for x in lat) + " (rank 1 expected) |",
        "| otherwise: process-group timeout (a hang inside a collective) | 1800 s |",
        "| otherwise: nvidia-resiliency-ext 0.4.1 default heartbeat timeouts (initial / later) | 3600 s / 2700 s |",
        f"| live checks, timed on rank 0 over {ov['steps']} steps | {ov['live_ms']:.1f} ms = "
        f"**{ov['overhead'] * 100:.2f}%** of the median step (goal <= 2%) |",
        f"| median step, checks on / off (alternating runs: on "
        + ", ".join(f"{x * 1000:.0f}" for x in ov["on_runs"]) + " ms; off "
        + ", ".join(f"{x * 1000:.0f}" for x in ov["off_runs"]) + " ms) | "
        f"{ov['median_on_s'] * 1000:.0f} ms / {ov['median_off_s'] * 1000:.0f} ms |", ""])
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write("\n" + text + "\n")
    return 0 if all(x["ok"] for x in lat) else 1


if __name__ == "__main__":
    sys.exit(main())
