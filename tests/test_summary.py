"""The submit summary: after a submission (fake ``sbatch`` on PATH) and at the end of a dry run."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"


def _cli(tmp_path, *args, path=None):
    env = {**os.environ, **({"PATH": path} if path else {})}
    return subprocess.run([sys.executable, str(PRETRAIN), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)


def test_dry_run_ends_with_the_summary_and_stdout_stays_a_script(tmp_path):
    proc = _cli(tmp_path, "cluster=lustre", "model=30b", "dry_run=true", f"cluster.run_root={tmp_path / 'runs'}")
    assert proc.returncode == 0, proc.stderr
    assert subprocess.run(["bash", "-n"], input=proc.stdout, text=True).returncode == 0
    tail = proc.stderr[proc.stderr.index("dry run of 30b:"):]
    for fragment in ("layout      tp4-pp2", "on 128 GPUs (16 x 8 h100_sxm)", "memory/GPU", "(fits; estimate)",
                     "s/step, MFU ", "tokens/s (estimate)", "333,787 steps (1.4T tokens)", "GPU-hours",
                     "slices of 60 min", "checkpoint  455 GB", "mock: synthetic tokens",
                     "dry run: nothing written or submitted", "without dry_run=true submits it"):
        assert fragment in tail, (fragment, tail)
    assert not (tmp_path / "runs").exists()


def test_a_submission_prints_the_summary_and_the_next_commands(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 31337\n")
    (bin_dir / "sbatch").chmod(0o755 | stat.S_IEXEC)
    runs = tmp_path / "runs"
    proc = _cli(tmp_path, "cluster=lustre", "model=7b", f"cluster.run_root={runs}", "force=true",
                path=f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"submitted job 31337  run 7b  dir {runs / '7b'}")
    assert "memory/GPU" in out and "MFU" in out and "GPU-hours" in out
    assert f"job         31337; run dir {runs / '7b'}" in out
    assert f"python launch/status.py {runs / '7b'} --watch 60" in out
    world = 16 * 8
    assert f"tail -F {runs / '7b'}/logs/31337_{world - 1}.out" in out
    assert f"python analysis/report.py {runs / '7b'} --out {runs / '7b'}/report" in out


def test_the_cost_line_prices_the_estimate_only_when_a_price_is_set(tmp_path):
    import re

    from launch.check import check
    from launch.compose import compose_job
    from launch.planner.estimate import estimate
    from launch.summary import summary

    job = compose_job(["cluster=lustre", "model=7b"])
    assert "cost" not in [ln.split()[0] for ln in summary(job, tmp_path).splitlines() if ln.strip()]
    job = compose_job(["cluster=lustre", "model=7b", "cluster.gpu_hour_price=2.5"])
    line = next(ln.strip() for ln in summary(job, tmp_path).splitlines() if ln.strip().startswith("cost"))
    m = re.fullmatch(r"cost\s+([\d,.]+) \(([\d,.]+) GPU-hours x 2\.5 per GPU-hour, estimate to the target\)", line)
    assert m, line
    hours = estimate(job).gpu_hours_total
    assert float(m.group(2).replace(",", "")) == round(hours)
    assert float(m.group(1).replace(",", "")) == round(2.5 * hours, 2)
    bad = check(compose_job(["cluster=lustre", "model=7b", "cluster.gpu_hour_price=-1"]))
    assert [p.field for p in bad] == ["cluster.gpu_hour_price"]
