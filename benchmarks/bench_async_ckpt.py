"""Asynchronous vs synchronous checkpoint saves at a size where bytes matter (``model=ckpt_bench``, ~1.6 GB).

``python benchmarks/bench_async_ckpt.py [--append benchmarks/RESULTS.md] [--workdir DIR] [override ...]``

One CPU rank of the real worker, driven by the local fault harness (:mod:`tests.faults`), in
four attempts measured side by side in one run:

* **sync**: ``training.async_save=false``, a periodic save every 3 steps, SIGUSR2 after 7
  steps: the blocking time of a synchronous save (``checkpoint_saved.seconds``), the step time,
  and signal -> durable stop checkpoint with a *warm* writer (saves came before it);
* **async**: the same with ``training.async_save=true``: the blocking time of an async save
  (``checkpoint_async_started.blocking_s``), its time until durable, the step time while a
  write is in flight vs without, and signal -> durable when the stop has to wait for the save
  in flight first;
* **cold**: no periodic saves, SIGUSR2 after 3 steps: the stop checkpoint is the first save of
  its process (a *cold* writer);
* **resume**: the sync run's next attempt, from its stop checkpoint: restart overhead (rank
  spawn -> first step) vs the cold start of the first attempt.

Every committed save of the sync and async runs also gets its three numbers from its ``checkpoint_cost`` event:
training blocked, time until durable, and the step-time dip while the writer ran.

Signal -> durable (signal sent -> rank 0's ``checkpoint_saved`` event of the stop step) is
compared with bytes / the fsynced sequential write bandwidth of the same filesystem (measured
here, same size) plus one step (the signal can land just after a step began). Goals (issue 15):
async blocking <= 10% of sync; signal -> durable <= 1.5 x that; resume <= 1.5 x cold start.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def attempt(run_dir: Path, restart: int, after: int, overrides: list[str], write_job: bool) -> dict:
    """One signal-stopped attempt; its events, the harness's record and the signal's send time."""
    from faults import Fault, run_attempt, write_rank_logs_tail
    from launch.compose import compose_job, job_to_yaml
    from recovery.events import read_events

    if write_job:
        run_dir.mkdir(parents=True, exist_ok=True)
        job = compose_job(["model=ckpt_bench", "cluster.gpus_per_node=1", "cluster.nodes=1",
                           "training.train_iters=1000", "training.keep_checkpoints=1", f"run.dir={run_dir}",
                           *overrides])
        (run_dir / "config.yaml").write_text(job_to_yaml(job))
    att = run_attempt(run_dir, 1, restart, [Fault("signal_all", after, signal.SIGUSR2)], timeout_s=600)
    if att.codes != [42] or not att.fired:
        raise RuntimeError(f"attempt {restart} of {run_dir.name} ended {att.codes}\n{write_rank_logs_tail(run_dir)}")
    ev = [e for e in read_events(run_dir / "events.jsonl") if e.get("restart_count") == restart]
    return {"ev": ev, "att": att, "fired_at": att.fired[0][1]}


def of(ev: list[dict], name: str) -> list[dict]:
    return [e for e in ev if e["event"] == name]


def signal_to_durable(r: dict) -> tuple[float, dict]:
    (sig,) = of(r["ev"], "signal")
    saved = [e for e in of(r["ev"], "checkpoint_saved") if e["step"] == sig["step"]][-1]
    return saved["time"] - r["fired_at"], saved


def first_step_s(r: dict) -> float:
    return of(r["ev"], "iteration")[0]["time"] - r["att"].started


def step_times(r: dict) -> tuple[list[float], list[float]]:
    """(step seconds with an async write in flight, without): a step is 'in flight' when it ended between an
    async start and that save's commit; the step of a save (its blocking part is not in the step time) and the
    first step are left out."""
    ev = r["ev"]
    windows = []
    for s in of(ev, "checkpoint_async_started"):
        done = [e for e in of(ev, "checkpoint_saved") if e["step"] == s["step"]]
        windows.append((s["time"], done[0]["time"] if done else float("inf")))
    busy, idle = [], []
    for e in of(ev, "iteration")[1:]:
        (busy if any(a < e["time"] <= b for a, b in windows) else idle).append(float(e["seconds"]))
    return busy, idle


def main(argv: list[str] | None = None) -> int:
    from bench_recovery import fsynced_write_bandwidth, git_commit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--append", type=Path, default=None, help="append a section to this RESULTS.md")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_async_ckpt_"))
    extra = list(args.overrides)
    t_wall = time.time()

    sync = attempt(work / "sync", 0, 7, ["training.async_save=false", "training.checkpoint_interval=3", *extra], True)
    asyn = attempt(work / "async", 0, 7, ["training.async_save=true", "training.checkpoint_interval=3", *extra], True)
    cold = attempt(work / "cold", 0, 3, ["training.async_save=true", "training.checkpoint_interval=100000", *extra],
                   True)
    resume = attempt(work / "sync", 1, 2, [], False)
    wall = time.time() - t_wall

    sync_saves = [e for e in of(sync["ev"], "checkpoint_saved") if e["reason"] == "interval"]
    sync_block = [float(e["seconds"]) for e in sync_saves]
    async_starts = of(asyn["ev"], "checkpoint_async_started")
    async_block = [float(e["blocking_s"]) for e in async_starts]
    async_saved = [e for e in of(asyn["ev"], "checkpoint_saved") if e.get("mode") == "async"]
    async_durable = [float(e["seconds"]) for e in async_saved]
    ckpt_bytes = int(sync_saves[-1]["bytes"])
    bw_s, bw = fsynced_write_bandwidth(work, ckpt_bytes)
    _busy_sync, idle_sync = step_times(sync)
    busy, idle = step_times(asyn)
    step_s = statistics.median(idle_sync)
    floor = ckpt_bytes / bw + step_s
    s2d = {"sync run (warm writer)": signal_to_durable(sync), "cold writer (first save of the process)":
           signal_to_durable(cold), "async run (waits for the save in flight)": signal_to_durable(asyn)}
    waits = of(asyn["ev"], "checkpoint_wait")
    cold_start, resume_start = first_step_s(sync), first_step_s(resume)
    load = os.getloadavg()
    med = statistics.median

    lines = [
        f"## Asynchronous checkpoint saves at 1.6 GB ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"commit {git_commit()})",
        "",
        "`" + " ".join(["python benchmarks/bench_async_ckpt.py", *extra]) + "`",
        "",
        f"1 CPU rank, model=ckpt_bench (2 layers, h=2048, ffn=8192, seq 32, gbs 2, fp32, Adam), {wall:.0f} s wall; "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} cores (shared machine).",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| checkpoint bytes (weights + Adam moments + common) | {ckpt_bytes:,} ({ckpt_bytes / 1e9:.2f} GB) |",
        f"| fsynced sequential write of the same size | {bw_s:.2f} s ({bw / 1e6:.0f} MB/s) |",
        f"| step time, no save in flight (sync run) | {step_s:.2f} s (median of {len(idle_sync)}) |",
        f"| blocking time of a periodic save, **sync** | {', '.join(f'{x:.2f}' for x in sync_block)} s |",
        f"| blocking time of a periodic save, **async** | {', '.join(f'{x:.2f}' for x in async_block)} s |",
        f"| **async / sync blocking** (goal <= 10%) | {100 * med(async_block) / med(sync_block):.1f}% |",
        f"| async save: start -> durable (written, committed, agreed) | "
        f"{', '.join(f'{x:.2f}' for x in async_durable)} s |",
        f"| step time with an async write in flight / without | "
        f"{(med(busy) if busy else float('nan')):.2f} s ({len(busy)} steps) / "
        f"{(med(idle) if idle else float('nan')):.2f} s ({len(idle)} steps) = "
        f"**{(med(busy) / med(idle) if busy and idle else float('nan')):.2f}x** |",
        f"| floor: bytes / bandwidth + one step | {floor:.2f} s |",
    ]
    verdicts = []
    for label, (secs, saved) in s2d.items():
        lines.append(f"| signal -> durable stop checkpoint, {label} | {secs:.2f} s = **{secs / floor:.2f}x** the floor "
                     f"(its save {float(saved['seconds']):.2f} s) |")
        verdicts.append(f"{label}: {secs / floor:.2f}x ({'met' if secs <= 1.5 * floor else 'NOT met'})")
    if waits:
        lines.append(f"| of which waiting for the async save in flight (async run) | {float(waits[0]['seconds']):.2f} s |")
    lines += [
        f"| cold start -> first step / resume -> first step | {cold_start:.1f} s / {resume_start:.1f} s = "
        f"**{resume_start / cold_start:.2f}x** (goal <= 1.5) |",
        "",
        f"Signal -> durable vs the floor (goal <= 1.5x): {'; '.join(verdicts)}.",
        "",
    ]
    lines += ["Three numbers per committed save (`checkpoint_cost` events: training blocked, time until durable, "
              "median step time while the writer ran vs recent steps without a save in flight):", "",
              "| run | step | training blocked | durable | step-time dip while writing |", "|---|---|---|---|---|"]
    for label, r in (("sync", sync), ("async", asyn)):
        for c in of(r["ev"], "checkpoint_cost"):
            dip = ("n/a (no step during a sync write)" if c.get("dip") is None else
                   f"{c['step_s_during']:.2f} s vs {c['step_s_outside']:.2f} s = **{100 * c['dip']:+.0f}%** "
                   f"({c['steps_during']} steps)")
            lines.append(f"| {label} | {c['step']} | {float(c['blocked_s']):.2f} s | {float(c['durable_s']):.2f} s | "
                         f"{dip} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))  # the local fault harness (tests/faults.py)
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.exit(main())
