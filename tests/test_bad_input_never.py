"""Bad input gets one line (field, arithmetic, fix) and exit 2: planner numbers, run names, ``${...}`` text,
and the login node's one-writer check (a run already queued, running, or locked)."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from launch import pretrain
from launch.check import check
from launch.compose import CONFIG_DIR, compose_job, job_to_yaml, load_job
from launch.config import register_configs
from launch.planner_config import PlannerCalibration

REPO = Path(__file__).resolve().parent.parent
LOCAL = ["cluster=local", "model=tiny", "run.dir=/nonexistent/runs/t"]


def _fields(job):
    return [p.field for p in check(job)]


@pytest.mark.parametrize("field, value", [
    ("nvlink_bandwidth_gbs", 0.0), ("ib_bandwidth_gbs", -1.0), ("fs_write_bandwidth_gbs", 0.0),
    ("node_mtbf_hours", 0.0), ("node_mtbf_hours", -5.0), ("gpu_memory_gb", 0.0),
    ("achievable_fraction", 0.0), ("achievable_fraction", 1.5), ("achievable_fraction", math.nan),
    ("nvlink_latency_us", -1.0), ("ib_latency_us", math.inf), ("kernel_launch_us", -0.5),
    ("step_overhead_s", math.nan), ("step_jitter", -0.01),
])
def test_planner_numbers_are_refused_with_the_field(field, value):
    job = compose_job(LOCAL)
    if field in PlannerCalibration.__dataclass_fields__:  # the planner's calibration: cluster.planner.*
        job = replace(job, cluster=replace(job.cluster, planner=replace(job.cluster.planner, **{field: value})))
        field = f"planner.{field}"
    else:
        job = replace(job, cluster=replace(job.cluster, **{field: value}))
    assert f"cluster.{field}" in _fields(job)


@pytest.mark.parametrize("lr", [math.nan, math.inf, -1e-4])
def test_learning_rate_not_finite_or_negative_is_refused(lr):
    job = compose_job(LOCAL)
    assert "training.lr" in _fields(replace(job, training=replace(job.training, lr=lr)))


def test_zero_sizes_and_long_run_names_are_refused():
    job = compose_job(LOCAL)
    assert "model.ffn_hidden_size" in _fields(replace(job, model=replace(job.model, ffn_hidden_size=0)))
    assert "model.hidden_size" in _fields(replace(job, model=replace(job.model, hidden_size=0)))
    long_name = "r" * 256
    probs = check(replace(job, run=replace(job.run, name=long_name)))
    assert [p.field for p in probs] == ["run.name"] and "NAME_MAX 255" in str(probs[0])
    assert check(replace(job, run=replace(job.run, name="r" * 255))) == []


def test_shell_dollar_brace_text_is_one_line_exit_2_and_an_escaped_one_round_trips(tmp_path):
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "dry_run=true",
                           "cluster.setup=['source ${HOME}/venv/bin/activate']"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "cluster.setup[0]" in proc.stderr and "\\${HOME}" in proc.stderr
    job = compose_job(["cluster=slurm_local", "cluster.setup=['source \\${HOME}/venv/bin/activate']"])
    assert job.cluster.setup == ["source ${HOME}/venv/bin/activate"]
    (tmp_path / "config.yaml").write_text(job_to_yaml(job))
    assert load_job(tmp_path / "config.yaml") == job  # what the ranks read back is the same text


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_a_run_with_a_queued_job_is_refused_on_the_login_node(tmp_path):
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    (run_dir / "submissions.jsonl").write_text(json.dumps({"job_id": "501", "kind": "submit"}) + "\n")
    calls = []

    def runner(argv, **_kw):
        calls.append(argv)
        if argv[0] == "squeue":
            return SimpleNamespace(returncode=0, stdout="501|PENDING\n", stderr="")
        raise AssertionError(f"nothing may be submitted: {argv}")

    err = io.StringIO()
    rc = pretrain.main(_cfg(["cluster=lustre", "model=7b", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}",
                             "force=true"]),
                       runner=runner, out=io.StringIO(), err=err)
    assert rc == 2 and "job 501 PENDING" in err.getvalue() and "scancel 501" in err.getvalue()
    assert [c[0] for c in calls] == ["squeue"] and not (run_dir / "config.yaml").exists()

    def ended(argv, **_kw):
        if argv[0] == "squeue":
            return SimpleNamespace(returncode=0, stdout="", stderr="")
        return SimpleNamespace(returncode=0, stdout="502\n", stderr="")

    assert pretrain.main(_cfg(["cluster=lustre", "model=7b", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}",
                             "force=true"]),
                         runner=ended, out=io.StringIO(), err=io.StringIO()) == 0
    assert (run_dir / "run_id").read_text().strip()


def _tree(d):
    """Every file under ``d`` with its bytes (the run directory as a reader sees it)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_locked_local_run_is_refused_and_left_untouched(tmp_path):
    """A second cluster=local launch of a run being trained: one line naming the holder, exit 9, and not a byte
    written into the live run (no rank log appended, no event, config/stop request/run id as they were)."""
    from recovery import lock
    from recovery.policy import EXIT_RUN_LOCKED

    run_dir = tmp_path / "runs" / "t"
    cfg = ["cluster=local", "model=tiny", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}"]
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(job_to_yaml(compose_job(cfg)) + "# the live run's copy\n")
    (run_dir / "logs" / "local_0_rank0.out").write_text("iteration 1 of the live run\n")
    (run_dir / "events.jsonl").write_text('{"event": "job_start", "rank": 0}\n')
    (run_dir / "stop.json").write_text('{"state": "requested", "at_step": 9}\n')
    (run_dir / "run_id").write_text("live\n")
    held = lock.acquire(run_dir / "run.lock", lock.me_from_env({}))  # the live launcher: this test process
    before = _tree(run_dir)
    err = io.StringIO()
    try:
        rc = pretrain.main(_cfg(cfg), out=io.StringIO(), err=err)
    finally:
        assert _tree(run_dir) == before
        held.release()
    lines = err.getvalue().splitlines()
    assert rc == EXIT_RUN_LOCKED and len(lines) == 1, err.getvalue()
    assert lines[0].startswith("refused: run.name: this run is being trained right now by ")
    assert f"pid {os.getpid()}" in lines[0] and "nothing was written" in lines[0]


# ---- analysis/report.py ------------------------------------------------------------------------

FIXTURE = REPO / "tests" / "fixtures" / "slurm_run"


def _report(*args):
    return subprocess.run([sys.executable, "analysis/report.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_report_without_iteration_lines_says_what_it_found(tmp_path):
    (tmp_path / "a.out").write_text("hello\nno iterations here\n")
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "job_start", "time": 1.0}) + "\n")
    proc = _report(tmp_path / "a.out", tmp_path / "events.jsonl", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no Megatron iteration lines in files: found" in proc.stderr and "1 event(s)" in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_report_out_that_is_a_file_or_unwritable_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    proc = _report(FIXTURE, "--out", tmp_path / "f")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "is a file" in proc.stderr
    proc = _report(FIXTURE, "--out", tmp_path / "f" / "sub")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "not a directory" in proc.stderr


def test_report_skips_a_fifo_with_a_reason_and_counts_unused_sacct_columns(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sacct = tmp_path / "sacct.txt"
    sacct.write_text("JobID|State|Start|End|Elapsed|MyOwnColumn|Flavour\n"
                     "77|COMPLETED|2026-01-01T00:00:00|2026-01-01T00:10:00|00:10:00|x|y\n")
    log = FIXTURE / "logs" / "8700_3.out"  # the last rank logs the iteration lines
    proc = _report(fifo, log, sacct, "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {fifo}: a FIFO" in proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["skipped_inputs"] == [{"path": str(fifo), "reason": summary["skipped_inputs"][0]["reason"]}]
    assert summary["skipped_sacct_columns"] == 2
