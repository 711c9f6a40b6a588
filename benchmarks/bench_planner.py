"""Planner benchmarks: rank every valid layout of the 405B model on 16,384 GPUs (target < 1 s).

``python benchmarks/bench_planner.py [--repeats 5] [--append benchmarks/RESULTS.md]``

What it times (wall clock, ``time.perf_counter``, this process only, Hydra compose excluded):

* ``rank_layouts`` for ``model=405b cluster=lustre cluster.nodes=2048`` (2,048 nodes x 8 H100):
  enumerate tp, pp, vpp, cp, sp, recompute and the distributed optimizer, validate each mesh
  with the job check's rules, estimate memory for all and step time for those that fit.
  Reported: median and minimum of ``--repeats`` runs, candidate counts, the winner.
* one ``estimate`` of the 405B recipe (what ``launch/plan.py`` does per call);
* the Llama 3 goodput simulation (7 intervals x 2,000 trials);
* accuracy: estimated vs published step time, TFLOP/s per GPU and memory per GPU for every row of
  ``tests/published_runs.py`` (citations there), per row and per source; rows of models under 1B get
  their own per-source line, marked as carrying no target.

The machine is shared: the load average is recorded beside the numbers, which move with it;
the CPU time of the process is recorded too (less sensitive to other processes than wall time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launch.compose import compose_job  # noqa: E402
from launch.planner import choose_layout, estimate, rank_layouts  # noqa: E402
from launch.planner.simulate import compare_intervals, llama3_scenario  # noqa: E402

TARGET_S = 1.0


def accuracy_rows() -> tuple[list[str], list[str]]:
    """Markdown: one row per published run, and one per source (median and worst |error|, models >= 1B)."""
    sys.path.insert(0, str(REPO / "tests"))
    from published_runs import all_rows, summary

    rows = all_rows()
    units = {"step_s": "s/step", "tflops": "TFLOP/s/GPU", "memory_gib": "GiB/GPU"}
    per_row = [f"| {r.source} | {r.label} | {units[r.metric]} | {r.value:.4g} | {r.estimate():.4g} | "
               f"{100 * r.error():+.1f}% | {r.cite} |" for r in rows]
    per_source = [f"| {src} | {kind} | {s['n']} | {100 * s['median']:.1f}% | {100 * s['worst']:.1f}% |"
                  for (src, kind), s in summary(rows).items()]
    per_source += [f"| {src} | {kind} (< 1B, no target) | {s['n']} | {100 * s['median']:.1f}% | "
                   f"{100 * s['worst']:.1f}% |"
                   for (src, kind), s in summary([r for r in rows if r.params_b < 1], min_params_b=0).items()]
    return per_row, per_source


def _timed(fn, repeats: int, cpu: list[float] | None = None) -> tuple[list[float], object]:
    """Wall times of ``repeats`` calls (and their CPU times into ``cpu``), and the last result."""
    times, result = [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return times, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--append", type=Path, default=None, help="append a section to this RESULTS.md")
    args = ap.parse_args(argv)

    job = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism=auto"])
    cpu: list[float] = []
    times, (rows, invalid) = _timed(lambda: rank_layouts(job), args.repeats, cpu)
    chosen, _ = choose_layout(job)
    best = estimate(chosen)
    fitting = sum(r.fits for r in rows)
    recipe = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048"])
    one_times, _ = _timed(lambda: estimate(recipe), args.repeats)
    scenario = llama3_scenario(5682e9 / 2e12, 10)
    sim_times, _ = _timed(lambda: compare_intervals(scenario, trials=2000, seed=0), 1)

    per_row, per_source = accuracy_rows()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    median = statistics.median(times)
    cpu_median = statistics.median(cpu)
    text = "\n".join([
        "## Planner (`benchmarks/bench_planner.py`)",
        "",
        f"commit `{commit}`, load average {load} (shared machine), Python {sys.version.split()[0]}, "
        f"{args.repeats} repeats",
        "",
        "| what | median | min | target |",
        "|---|---:|---:|---:|",
        f"| rank every layout, 405B on 2048 x 8 H100 ({len(rows) + sum(invalid.values())} candidates: "
        f"{sum(invalid.values())} invalid, {len(rows) - fitting} do not fit, {fitting} ranked) | "
        f"{median:.3f} s wall | {min(times):.3f} s | |",
        f"| the same, CPU time of this process | {cpu_median:.3f} s | {min(cpu):.3f} s | "
        f"< {TARGET_S:g} s CPU {'(met)' if cpu_median < TARGET_S else '(MISSED)'} |",
        f"| one `estimate` (405B recipe) | {1e3 * statistics.median(one_times):.2f} ms | "
        f"{1e3 * min(one_times):.2f} ms | |",
        f"| goodput simulation, Llama 3 case, 7 intervals x 2000 trials | {sim_times[0]:.2f} s | | |",
        "",
        f"Winner: `{chosen.parallelism.name}`: {best.memory_gb_per_gpu:.1f} GiB/GPU, step {best.step_time_s:.2f} s, "
        f"{best.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {100 * best.mfu:.1f}%, "
        f"{best.wall_time_h_total / 24:.1f} days for {recipe.training.train_tokens / 1e12:g}T tokens.",
        "",
        "Accuracy against published runs (`tests/published_runs.py`, one set of constants for every row; error "
        "on step time, positive = the planner is slower than published; for TFLOP/s rows published/estimated - 1; "
        "memory: estimated/published - 1):",
        "",
        "| source | kind | rows | median abs error | worst abs error |",
        "|---|---|---:|---:|---:|",
        *per_source,
        "",
        "| source | run | unit | published | estimated | error | citation |",
        "|---|---|---|---:|---:|---:|---|",
        *per_row,
        "",
    ])
    print(text)
    if args.append:
        with open(args.append, "a") as fh:
            fh.write("\n" + text)
    return 0 if cpu_median < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
