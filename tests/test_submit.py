"""Submission through a fake ``sbatch`` at the subprocess boundary (a real executable on PATH).

The fake records its argv (one JSON line per call) and answers like ``sbatch --parsable``;
everything above it (rendering, writing the run directory, parsing, the record) is real.
"""
from __future__ import annotations

import io
import json
import stat
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch import pretrain
from launch.compose import CONFIG_DIR, compose_job, load_job
from launch.config import register_configs
from launch.render import render
from launch.submit import SubmitError, parse_job_id, read_submissions, submit

FAKE_SBATCH = r"""#!/usr/bin/env python3
import json, os, sys
log = os.environ["FAKE_SBATCH_LOG"]
n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
with open(log, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\n")
if os.environ.get("FAKE_SBATCH_FAIL"):
    print("sbatch: error: Batch job submission failed: Invalid account", file=sys.stderr)
    sys.exit(1)
if "--test-only" in sys.argv:
    print("sbatch: Job 5000 to start at 2026-01-01T00:00:00 using 128 processors on nodes n[1-16] in partition gpu",
          file=sys.stderr)
else:
    print(f"{4242 + n};cluster")
"""


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "sbatch"
    exe.write_text(FAKE_SBATCH)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "sbatch_calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("FAKE_SBATCH_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _job(tmp_path, *extra):
    return compose_job(["cluster=lustre", "model=7b", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}", *extra])


def test_submit_writes_the_script_runs_sbatch_and_records_the_job(tmp_path, fake_sbatch):
    job = _job(tmp_path)
    run_dir = tmp_path / "runs" / "t"
    subs = submit(job, run_dir, clock=lambda: 1000.0)
    assert [s.job_id for s in subs] == ["4242"]
    assert fake_sbatch() == [["--parsable", str(run_dir / "sbatch.sh")]]
    assert (run_dir / "sbatch.sh").read_text() == render(job, run_dir)
    assert (run_dir / "logs").is_dir()  # sbatch does not create the --output directory
    assert read_submissions(run_dir) == [{"job_id": "4242", "time": 1000.0, "script": str(run_dir / "sbatch.sh"),
                                          "dependency": None, "kind": "submit", "message": ""}]


def test_dependency_chain_presubmits_afterany_continuations(tmp_path, fake_sbatch):
    job = _job(tmp_path, "run.dependency_chain=2")
    subs = submit(job, tmp_path / "runs" / "t")
    assert [s.job_id for s in subs] == ["4242", "4243", "4244"]
    calls = fake_sbatch()
    assert [c[:2] for c in calls[1:]] == [["--parsable", "--dependency=afterany:4242"],
                                          ["--parsable", "--dependency=afterany:4243"]]
    assert [r["kind"] for r in read_submissions(tmp_path / "runs" / "t")] == ["submit", "continuation", "continuation"]


def test_test_only_queues_nothing_and_records_the_answer(tmp_path, fake_sbatch):
    subs = submit(_job(tmp_path), tmp_path / "runs" / "t", test_only=True)
    assert fake_sbatch()[0][0] == "--test-only"
    assert subs[0].job_id is None and "to start at" in subs[0].message
    assert read_submissions(tmp_path / "runs" / "t")[0]["kind"] == "test_only"


def test_a_refused_submission_raises_and_records_nothing(tmp_path, fake_sbatch, monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "1")
    with pytest.raises(SubmitError, match="Invalid account"):
        submit(_job(tmp_path), tmp_path / "runs" / "t")
    assert read_submissions(tmp_path / "runs" / "t") == []


@pytest.mark.parametrize("text,expected", [("123\n", "123"), ("123;cl\n", "123"), ("Submitted\n77\n", "77")])
def test_parse_job_id(text, expected):
    assert parse_job_id(text) == expected


@pytest.mark.parametrize("text", ["", "sbatch: error", "12a"])
def test_parse_job_id_refuses_garbage(text):
    with pytest.raises(SubmitError):
        parse_job_id(text)


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_pretrain_main_submits_and_fills_the_run_directory(tmp_path, fake_sbatch):
    overrides = ["cluster=lustre", "model=7b", "run.name=r1", f"cluster.run_root={tmp_path / 'runs'}", "force=true"]
    out = io.StringIO()
    assert pretrain.main(_cfg(overrides), out=out, err=io.StringIO()) == 0
    run_dir = tmp_path / "runs" / "r1"
    assert "submitted job 4242" in out.getvalue() and str(run_dir) in out.getvalue()
    assert load_job(run_dir / "config.yaml").model.name == "7b"
    assert (run_dir / "sbatch.sh").exists() and read_submissions(run_dir)[0]["job_id"] == "4242"
    # the same name again continues the same run: same directory, a second submission
    assert pretrain.main(_cfg(overrides + ["run.time_limit_min=120"]), out=io.StringIO(), err=io.StringIO()) == 0
    assert [r["job_id"] for r in read_submissions(run_dir)] == ["4242", "4243"]
    # ... but a different model shape under the same name is refused and not submitted
    err = io.StringIO()
    assert pretrain.main(_cfg(overrides + ["model.num_layers=40"]), out=io.StringIO(), err=err) == 2
    assert "model.num_layers: 32 -> 40" in err.getvalue() and "run.name" in err.getvalue()
    assert len(fake_sbatch()) == 2


def test_pretrain_main_reports_a_failed_submission(tmp_path, fake_sbatch, monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "1")
    err = io.StringIO()
    runs = tmp_path / "runs"
    rc = pretrain.main(_cfg(["cluster=lustre", "model=7b", f"cluster.run_root={runs}", "force=true"]),
                       out=io.StringIO(), err=err)
    assert rc == pretrain.EXIT_SUBMIT_FAILED and "Invalid account" in err.getvalue()
    assert err.getvalue().strip().splitlines()[-1].startswith("submission failed:")
    assert not runs.exists()  # nothing left behind: no config.yaml that would refuse the next model


def test_a_failed_submission_restores_a_continued_run(tmp_path, fake_sbatch, monkeypatch):
    overrides = ["cluster=lustre", "model=7b", "run.name=r", f"cluster.run_root={tmp_path / 'runs'}", "force=true"]
    assert pretrain.main(_cfg(overrides), out=io.StringIO(), err=io.StringIO()) == 0
    run_dir = tmp_path / "runs" / "r"
    config, script = (run_dir / "config.yaml").read_text(), (run_dir / "sbatch.sh").read_text()
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "1")
    assert pretrain.main(_cfg(overrides + ["run.time_limit_min=120"]), out=io.StringIO(), err=io.StringIO()) == 1
    assert (run_dir / "config.yaml").read_text() == config and (run_dir / "sbatch.sh").read_text() == script
    assert [r["job_id"] for r in read_submissions(run_dir)] == ["4242"]


def test_a_broken_dependency_chain_keeps_the_jobs_it_queued(tmp_path):
    calls = []

    def runner(argv, **kw):
        calls.append(argv)
        ok = len(calls) == 1
        return type("P", (), {"returncode": 0 if ok else 1, "stdout": "11\n" if ok else "",
                              "stderr": "" if ok else "sbatch: error: QOSMaxSubmitJobPerUserLimit"})()

    err = io.StringIO()
    cfg = _cfg(["cluster=lustre", "model=7b", "run.name=c", f"cluster.run_root={tmp_path}", "force=true",
                "run.dependency_chain=2"])
    assert pretrain.main(cfg, runner=runner, out=io.StringIO(), err=err) == 1
    assert "after job(s) 11 were queued" in err.getvalue() and "QOSMaxSubmitJobPerUserLimit" in err.getvalue()
    assert [r["job_id"] for r in read_submissions(tmp_path / "c")] == ["11"]
