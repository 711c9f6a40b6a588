"""Submission through ``FakeSlurm`` at the subprocess boundary.

The fake records its argv and answers like ``sbatch --parsable``; everything above it (rendering,
writing the run directory, parsing, the record) is real.
"""
from __future__ import annotations

import io

import pytest
from fake_slurm import FakeSlurm
from hydra import compose, initialize_config_dir

from launch import pretrain
from launch.compose import CONFIG_DIR, compose_job, load_job
from launch.config import register_configs
from launch.render import render
from launch.submit import SubmitError, parse_job_id, read_submissions, submit

@pytest.fixture
def fake():
    return FakeSlurm(job_id="4242")


REFUSING = dict(fail={"sbatch"}, fail_words="sbatch: error: Batch job submission failed: Invalid account")


def _job(tmp_path, *extra):
    return compose_job(["cluster=lustre", "model=7b", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}", *extra])


def test_submit_writes_the_script_runs_sbatch_and_records_the_job(tmp_path, fake):
    job = _job(tmp_path)
    run_dir = tmp_path / "runs" / "t"
    subs = submit(job, run_dir, runner=fake, clock=lambda: 1000.0)
    assert [s.job_id for s in subs] == ["4242"]
    assert fake.calls == [["sbatch", "--parsable", str(run_dir / "sbatch.sh")]]
    assert (run_dir / "sbatch.sh").read_text() == render(job, run_dir)
    assert (run_dir / "logs").is_dir()  # sbatch does not create the --output directory
    assert read_submissions(run_dir) == [{"job_id": "4242", "time": 1000.0, "script": str(run_dir / "sbatch.sh"),
                                          "dependency": None, "kind": "submit", "message": ""}]


def test_dependency_chain_presubmits_afterany_continuations(tmp_path, fake):
    job = _job(tmp_path, "run.dependency_chain=2")
    subs = submit(job, tmp_path / "runs" / "t", runner=fake)
    assert [s.job_id for s in subs] == ["4242", "4243", "4244"]
    calls = [c[1:] for c in fake.called("sbatch")]
    assert [c[:2] for c in calls[1:]] == [["--parsable", "--dependency=afterany:4242"],
                                          ["--parsable", "--dependency=afterany:4243"]]
    assert [r["kind"] for r in read_submissions(tmp_path / "runs" / "t")] == ["submit", "continuation", "continuation"]


def test_test_only_queues_nothing_and_records_the_answer(tmp_path, fake):
    subs = submit(_job(tmp_path), tmp_path / "runs" / "t", runner=fake, test_only=True)
    assert fake.calls[0][1] == "--test-only"
    assert subs[0].job_id is None and "to start at" in subs[0].message
    assert read_submissions(tmp_path / "runs" / "t")[0]["kind"] == "test_only"


def test_a_refused_submission_raises_and_records_nothing(tmp_path):
    with pytest.raises(SubmitError, match="Invalid account"):
        submit(_job(tmp_path), tmp_path / "runs" / "t", runner=FakeSlurm(**REFUSING))
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


def test_pretrain_main_submits_and_fills_the_run_directory(tmp_path, fake):
    overrides = ["cluster=lustre", "model=7b", "run.name=r1", f"cluster.run_root={tmp_path / 'runs'}", "force=true"]
    out = io.StringIO()
    assert pretrain.main(_cfg(overrides), runner=fake, out=out, err=io.StringIO()) == 0
    run_dir = tmp_path / "runs" / "r1"
    assert "submitted job 4242" in out.getvalue() and str(run_dir) in out.getvalue()
    assert load_job(run_dir / "config.yaml").model.name == "7b"
    assert (run_dir / "sbatch.sh").exists() and read_submissions(run_dir)[0]["job_id"] == "4242"
    # the same name again continues the same run: same directory, a second submission
    assert pretrain.main(_cfg(overrides + ["run.time_limit_min=120"]), runner=fake, out=io.StringIO(),
                         err=io.StringIO()) == 0
    assert [r["job_id"] for r in read_submissions(run_dir)] == ["4242", "4243"]
    # ... but a different model shape under the same name is refused and not submitted
    err = io.StringIO()
    assert pretrain.main(_cfg(overrides + ["model.num_layers=40"]), runner=fake, out=io.StringIO(), err=err) == 2
    assert "model.num_layers: 32 -> 40" in err.getvalue() and "run.name" in err.getvalue()
    assert len(fake.called("sbatch")) == 2


def test_pretrain_main_reports_a_failed_submission(tmp_path):
    err = io.StringIO()
    runs = tmp_path / "runs"
    rc = pretrain.main(_cfg(["cluster=lustre", "model=7b", f"cluster.run_root={runs}", "force=true"]),
                       runner=FakeSlurm(**REFUSING), out=io.StringIO(), err=err)
    assert rc == pretrain.EXIT_SUBMIT_FAILED and "Invalid account" in err.getvalue()
    assert err.getvalue().strip().splitlines()[-1].startswith("submission failed:")
    assert not runs.exists()  # nothing left behind: no config.yaml that would refuse the next model


def test_a_failed_submission_restores_a_continued_run(tmp_path, fake):
    overrides = ["cluster=lustre", "model=7b", "run.name=r", f"cluster.run_root={tmp_path / 'runs'}", "force=true"]
    assert pretrain.main(_cfg(overrides), runner=fake, out=io.StringIO(), err=io.StringIO()) == 0
    run_dir = tmp_path / "runs" / "r"
    config, script = (run_dir / "config.yaml").read_text(), (run_dir / "sbatch.sh").read_text()
    assert pretrain.main(_cfg(overrides + ["run.time_limit_min=120"]), runner=FakeSlurm(**REFUSING),
                         out=io.StringIO(), err=io.StringIO()) == 1
    assert (run_dir / "config.yaml").read_text() == config and (run_dir / "sbatch.sh").read_text() == script
    assert [r["job_id"] for r in read_submissions(run_dir)] == ["4242"]


def test_a_broken_dependency_chain_keeps_the_jobs_it_queued(tmp_path):
    runner = FakeSlurm(job_id="11", max_jobs=1, fail_words="sbatch: error: QOSMaxSubmitJobPerUserLimit")
    err = io.StringIO()
    cfg = _cfg(["cluster=lustre", "model=7b", "run.name=c", f"cluster.run_root={tmp_path}", "force=true",
                "run.dependency_chain=2"])
    assert pretrain.main(cfg, runner=runner, out=io.StringIO(), err=err) == 1
    assert "after job(s) 11 were queued" in err.getvalue() and "QOSMaxSubmitJobPerUserLimit" in err.getvalue()
    assert [r["job_id"] for r in read_submissions(tmp_path / "c")] == ["11"]
