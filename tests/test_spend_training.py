"""The budget ceiling and memory health on real Megatron-Core training (CPU, ``cluster=local`` through
``launch/pretrain.py``).

Budget: one run with a budget a few steps deep: it warns at 50/80/95% (events and WARNING lines), stops itself at the
budget with a verified checkpoint, reason ``budget``, exit 17, and is not relaunched; the same command with the
budget still spent is refused at submit with the arithmetic; raised, the run continues from the checkpoint to the
target. The real-Slurm variant is in tests/test_slurm_e2e.py (the budget scenario).

Memory: the memory line every log interval (RSS on the CPU, n/a for the allocator's fields) and an injected CUDA
out-of-memory (``SLURMTRON_TEST_OOM_AT_ITER``): forensics under ``oom/``, a final ``oom`` stop (exit 18, not
relaunched) quoting the planner's estimate and fixes, and the report's cause ``oom``.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.spend import fmt
from launch import status
from launch.paths import RunPaths
from recovery.events import read_events
from recovery.policy import EXIT_BUDGET, EXIT_OOM
from recovery.resume import find_latest_verified

pytestmark = pytest.mark.training

REPO = Path(__file__).resolve().parent.parent
ITERS = 6
STEP_S = 2.0  # every step sleeps this long (a test hook): five steps spend more than the budget below
BUDGET_H = 5 * STEP_S / 3600  # one process: 10 process-seconds, reached before the 6th step whatever start-up took


def _pretrain(tmp_path: Path, budget: float, *, sleep: float = 0.0, env: dict = {}, name: str = "b",
              more: tuple = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURMTRON_TEST_STEP_SLEEP_S": str(sleep), **env}
    return subprocess.run(
        [sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=local", "model=tiny",
         "cluster.gpus_per_node=1", "parallelism=tp1", f"cluster.run_root={tmp_path / 'runs'}", f"run.name={name}",
         f"training.train_iters={ITERS}", "training.checkpoint_interval=100", "training.async_save=false",
         "tracking.tensorboard=false", f"run.budget_gpu_hours={budget!r}", *more],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_stops_at_its_budget_with_a_checkpoint_and_continues_once_it_is_raised(tmp_path):
    first = _pretrain(tmp_path, BUDGET_H, sleep=STEP_S)
    run_dir = tmp_path / "runs" / "b"
    events = read_events(RunPaths.of(run_dir).events)
    assert first.returncode == EXIT_BUDGET, first.stdout[-3000:] + first.stderr[-3000:]
    assert sum(e["event"] == "job_start" for e in events) == 1  # final: not relaunched
    (stop,) = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "budget" and stop["code"] == EXIT_BUDGET
    step = stop["step"]
    assert step < ITERS and f"at iteration {step}: stopped with a verified checkpoint" in stop["detail"]
    assert "run.budget_gpu_hours=<more>" in stop["detail"]
    warned = [e["threshold"] for e in events if e["event"] == "budget_warning" and e["threshold"] != "projected"]
    assert warned == [0.5, 0.8, 0.95], warned
    assert all(e["budget"] == BUDGET_H for e in events if e["event"] == "budget_warning")
    assert "WARNING: budget: 50% of run.budget_gpu_hours spent" in first.stdout + first.stderr
    if step > 0:  # a start-up slower than the whole budget stops before the first step: nothing to save
        found = find_latest_verified(RunPaths.of(run_dir).checkpoints)
        assert found.step == step, found

    shown = io.StringIO()
    assert status.main([str(run_dir)], out=shown) == 0
    assert f"state      stopped (budget: run.budget_gpu_hours spent at step {step} (checkpointed)" in shown.getvalue()
    budget_line = next(ln for ln in shown.getvalue().splitlines() if ln.startswith("budget     "))
    assert f" of {fmt(BUDGET_H)} process-hours (" in budget_line, budget_line

    again = _pretrain(tmp_path, BUDGET_H)  # still spent: refused at submit, with the arithmetic
    assert again.returncode == 2 and "run.budget_gpu_hours" in again.stderr and "spent" in again.stderr, again.stderr
    assert sum(e["event"] == "job_start" for e in read_events(RunPaths.of(run_dir).events)) == 1

    more = _pretrain(tmp_path, 1.0)  # raised: continues from the budget stop's checkpoint
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    events = read_events(RunPaths.of(run_dir).events)
    starts = [e for e in events if e["event"] == "job_start"]
    assert len(starts) == 2
    resumed = [e for e in events if e["event"] == "resume"]
    if step > 0:
        assert resumed and resumed[-1]["step"] == step
    assert [e for e in events if e["event"] == "exit"][-1]["reason"] == "completed"
    assert find_latest_verified(RunPaths.of(run_dir).checkpoints).step == ITERS


def test_an_out_of_memory_is_a_final_oom_stop_with_its_forensics_and_the_memory_lines_before_it(tmp_path):
    proc = _pretrain(tmp_path, 1.0, env={"SLURMTRON_TEST_OOM_AT_ITER": "3"}, name="m")
    out = proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "m"
    events = read_events(RunPaths.of(run_dir).events)
    assert proc.returncode == EXIT_OOM, out[-3000:]
    assert sum(e["event"] == "job_start" for e in events) == 1  # final: not relaunched
    lines = [ln for ln in out.splitlines() if ln.startswith("[Rank 0] (after 2 iterations) memory (MB)")]
    assert lines and "| allocated: n/a | max allocated: n/a | reserved: n/a | gap: n/a | alloc retries: n/a | rss: " \
        in lines[0] and not lines[0].endswith("rss: n/a"), lines
    its = [e for e in events if e["event"] == "iteration"]
    assert [e["step"] for e in its] == [1, 2] and all(e["mem_rss"] > 0 and "mem_reserved" not in e for e in its)
    (stop,) = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "oom" and stop["code"] == EXIT_OOM and stop["oom_rank"] == 0
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in stop["detail"]
    assert "planner estimate" in stop["detail"] and "weights" in stop["detail"]  # the per-term estimate
    assert "fix: parallelism.recompute=selective" in stop["detail"]
    summary = RunPaths.of(run_dir).oom(None, 0, 0, "memory_summary.txt")
    assert stop["files"] == [str(summary)] and "rss" in summary.read_text()
    assert "stopping: rank 0: out of GPU memory" in out

    report = tmp_path / "report"
    assert subprocess.run([sys.executable, str(REPO / "analysis" / "report.py"), str(run_dir), "--out", str(report)],
                          capture_output=True, text=True, timeout=600).returncode == 0
    rows = (report / "interruptions.csv").read_text()
    assert ",oom," in rows and "planner estimate" in rows, rows
    md = (report / "report.md").read_text()
    assert "spend: " in md and "process-hours of a 1 process-hours budget" in md
    assert (report / "memory_m.png").stat().st_size > 0 and "rank 0's memory at each logged step" in md
