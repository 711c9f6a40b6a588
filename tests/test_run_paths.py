"""``RunPaths``: one place names every file of a run; a shared checkpoint root never mixes runs."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from launch.compose import compose_job
from launch.paths import RunPaths
from launch.render import render


def test_checkpoints_default_to_the_run_directory():
    paths = RunPaths.of("/runs/a", "a")
    assert paths.checkpoints == Path("/runs/a/checkpoints")
    assert paths.events == Path("/runs/a/events.jsonl") and paths.config == Path("/runs/a/config.yaml")
    assert paths.staging(20) == Path("/runs/a/checkpoints/iter_0000020.tmp")
    assert paths.checkpoint(20) == Path("/runs/a/checkpoints/iter_0000020")
    assert paths.rank_log(1, 3) == Path("/runs/a/logs/local_1_rank3.out")


def test_two_runs_with_one_checkpoint_root_never_share_a_directory():
    a = compose_job(["cluster=lustre", "model=7b", "run.name=a", "cluster.checkpoint_root=/lustre/ckpt"])
    b = compose_job(["cluster=lustre", "model=7b", "run.name=b", "cluster.checkpoint_root=/lustre/ckpt"])
    assert a.paths.checkpoints == Path("/lustre/ckpt/a")
    assert b.paths.checkpoints == Path("/lustre/ckpt/b")
    assert a.paths.checkpoints != b.paths.checkpoints


def test_the_striped_directory_is_the_one_the_ranks_write():
    job = compose_job(["cluster=lustre", "model=7b", "run.name=a", "cluster.checkpoint_root=/lustre/ckpt",
                       "cluster.lustre_stripe_count=4"])
    script = render(job, run_dir="/runs/a", code_dir="/opt/slurmtron")
    striped = re.search(r"^CKPT_DIR=(.*)$", script, re.M)
    assert striped, "the lustre profile stripes the checkpoint directory"
    assert Path(shlex.split(striped.group(1))[0]) == job.paths_at("/runs/a").checkpoints == Path("/lustre/ckpt/a")


@pytest.mark.training
def test_a_second_run_under_the_same_checkpoint_root_starts_fresh(tmp_path):
    """Run ``b`` must not resume from run ``a``'s checkpoint when both use one checkpoint root."""
    from trainutil import train

    root = tmp_path / "ckpt"
    common = ["model=tiny", "parallelism=tp1", "training.train_iters=2", "training.checkpoint_interval=2",
              f"cluster.checkpoint_root={root}"]
    a = train(tmp_path / "a", common + ["run.name=a"], world=1)
    b = train(tmp_path / "b", common + ["run.name=b"], world=1)
    assert a.codes == [0] and b.codes == [0], b.all_logs()
    assert (root / "a" / "iter_0000002").is_dir() and (root / "b" / "iter_0000002").is_dir()
    assert sorted(b.losses) == [1, 2], "run b trained its own steps instead of loading run a's checkpoint"
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_a_config_saved_with_a_retired_field_still_loads_with_a_warning(tmp_path):
    """training.fail_at_iter left the schema (it is an environment switch now); old runs continue."""
    from launch.compose import compose_job, job_to_yaml, load_job

    path = tmp_path / "config.yaml"
    path.write_text(job_to_yaml(compose_job(["model=tiny"])).replace("training:\n", "training:\n  fail_at_iter: 3\n"))
    said = []
    job = load_job(path, warn=said.append)
    assert job.model.name == compose_job(["model=tiny"]).model.name
    assert len(said) == 1 and "training.fail_at_iter=3" in said[0] and "SLURMTRON_TEST_FAIL_AT_ITER" in said[0]
    assert not hasattr(job.training, "fail_at_iter")


@pytest.mark.parametrize("run_dir,fragment", [
    ("/", "'/', a system or shared directory"),
    ("/etc", "a system or shared directory"),
    ("/tmp/../etc", "which resolves to /etc"),
    ("'~'", "a system or shared directory"),
])
def test_a_run_directory_that_is_a_system_or_home_directory_is_refused(run_dir, fragment):
    from launch.check import run_dir_problems

    (p,) = run_dir_problems(compose_job(["cluster=local", "model=tiny", f"run.dir={run_dir}"]))
    assert p.field == "run.dir" and fragment in p.arithmetic and "directory of its own" in p.fix


def test_a_run_directory_of_its_own_is_accepted(tmp_path):
    from launch.check import run_dir_problems

    assert run_dir_problems(compose_job(["cluster=local", "model=tiny", f"run.dir={tmp_path / 'runs' / 'x'}"])) == []
