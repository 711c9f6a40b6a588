"""A launch that the run's newest checkpoint answers before any rank starts (recovery/start_check.py): a job
that cannot load it (the other optimizer type) is refused, a change of layout alone is not, and a run already
at its target ends at once. The fast tests commit real checkpoints (recovery.commit, any bytes as shards); the
training test uses a real tiny run through ``launch/pretrain.py`` (cluster=local)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import pretrain
from launch.compose import compose_job
from launch.paths import RunPaths
from recovery import commit
from recovery.identity import ensure_run_id, model_shape
from recovery.policy import EXIT_CKPT_MISMATCH, FINAL_CODES, FINAL_REASONS
from recovery.start_check import judge, optimizer_conflict

REPO = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path, *overrides: str):
    return compose_job([f"cluster.run_root={tmp_path / 'runs'}", "run.name=tiny", *overrides])


def _commit(job, run_dir: Path, step: int, *, distributed_optimizer: bool, layout: str = "tp1-pp1") -> Path:
    """A committed checkpoint of ``job``'s run as the worker writes it (manifest meta and owner)."""
    root = job.paths_at(run_dir).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    staging = commit.prepare_staging(root, step)
    (staging / "__0_0.distcp").write_bytes(os.urandom(256))
    (staging / "common.pt").write_bytes(b"common")
    meta = {"step": step, "layout": layout, "distributed_optimizer": distributed_optimizer,
            "model": model_shape(job.model)}
    run = {"name": job.run.name, "id": ensure_run_id(run_dir), "model": model_shape(job.model)}
    commit.commit(root, step, meta, keep=3, run=run)
    return root


def test_checkpoint_mismatch_is_a_final_exit_code():
    assert FINAL_REASONS["checkpoint_mismatch"] == EXIT_CKPT_MISMATCH == 15 and 15 in FINAL_CODES


def test_only_the_optimizer_type_is_a_conflict():
    assert optimizer_conflict({"distributed_optimizer": False}, False, "p") is None
    assert optimizer_conflict({}, True, "p") is None  # a manifest that does not say: the ranks judge the shards
    c = optimizer_conflict({"distributed_optimizer": False, "layout": "tp1-pp1"}, True, "ckpt/iter_0000020")
    assert c.field == "parallelism.distributed_optimizer"
    assert "parallelism.distributed_optimizer=False" in c.fix and "run.name=NEW" in c.fix
    assert "\n" not in c.line and "ckpt/iter_0000020" in c.line


def test_the_readme_layout_example_is_refused_before_any_rank_starts(tmp_path):
    """Quickstart (tiny: the ordinary optimizer), then ``model=tiny parallelism=tp2_pp2`` (the distributed one)."""
    quick = _job(tmp_path, "training.train_iters=20")
    run_dir = Path(quick.run_dir)
    _commit(quick, run_dir, 10, distributed_optimizer=False)
    job = _job(tmp_path, "model=tiny", "parallelism=tp2_pp2", "training.train_iters=20")
    assert job.parallelism.distributed_optimizer and not quick.parallelism.distributed_optimizer
    verdict = pretrain.checkpoint_verdict(job, run_dir)
    assert verdict.complete is None and verdict.conflict is not None
    [problem] = pretrain.conflict_problems(verdict)
    assert problem.field == "parallelism.distributed_optimizer" and "run.name=NEW" in problem.fix
    # the same layout with the ordinary optimizer reshards: no conflict
    ok = _job(tmp_path, "model=tiny", "parallelism=tp2_pp2", "parallelism.distributed_optimizer=false",
              "training.train_iters=20")
    assert pretrain.checkpoint_verdict(ok, run_dir).conflict is None


def test_a_complete_run_is_said_and_a_raised_target_is_not(tmp_path):
    job = _job(tmp_path, "training.train_iters=20")
    run_dir = Path(job.run_dir)
    assert judge(job, job.paths_at(run_dir).checkpoints, None).resume.path is None  # no checkpoints: start
    _commit(job, run_dir, 20, distributed_optimizer=False)
    verdict = pretrain.checkpoint_verdict(job, run_dir)
    assert verdict.conflict is None and "already complete at step 20/20" in verdict.complete
    assert "run.name=NEW" in verdict.complete
    more = _job(tmp_path, "training.train_iters=30")
    assert pretrain.checkpoint_verdict(more, run_dir).complete is None


def test_a_corrupt_final_checkpoint_is_not_called_complete(tmp_path):
    job = _job(tmp_path, "training.train_iters=20")
    run_dir = Path(job.run_dir)
    _commit(job, run_dir, 10, distributed_optimizer=False)
    root = _commit(job, run_dir, 20, distributed_optimizer=False)
    shard = root / commit.dir_name(20) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # same size: only a re-hash sees it
    shard.write_bytes(bytes(data))
    assert pretrain.checkpoint_verdict(job, run_dir).complete is None  # the ranks fall back to step 10


def test_another_runs_checkpoint_is_left_to_the_ranks(tmp_path):
    job = _job(tmp_path, "training.train_iters=20")
    run_dir = Path(job.run_dir)
    _commit(job, run_dir, 20, distributed_optimizer=True)
    (run_dir / "run_id").unlink(missing_ok=True)
    ensure_run_id(run_dir)  # the run directory was created anew: the checkpoint is another run's
    verdict = pretrain.checkpoint_verdict(job, run_dir)
    assert verdict.complete is None and verdict.conflict is None


def _pretrain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.training
def test_a_real_run_complete_then_relaunched_in_a_layout_it_cannot_load(tmp_path):
    common = [f"cluster.run_root={tmp_path / 'runs'}", "run.name=tiny", "cluster.gpus_per_node=2",
              "training.train_iters=4"]
    first = _pretrain(tmp_path, *common)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    paths = RunPaths.of(tmp_path / "runs" / "tiny")
    logs = sorted(p.name for p in paths.logs.iterdir())
    events = paths.events.read_text()

    again = _pretrain(tmp_path, *common)  # already complete: ends here, no rank started
    assert again.returncode == 0, again.stderr
    assert "already complete at step 4/4" in again.stderr and "Traceback" not in again.stderr + again.stdout
    assert sorted(p.name for p in paths.logs.iterdir()) == logs and paths.events.read_text() == events

    other = _pretrain(tmp_path, *common, "parallelism=tp2")  # tp2 recipe: the distributed optimizer
    assert other.returncode == 2, other.stderr
    assert "parallelism.distributed_optimizer" in other.stderr and "run.name=NEW" in other.stderr
    assert "Traceback" not in other.stderr + other.stdout
    assert sorted(p.name for p in paths.logs.iterdir()) == logs and paths.events.read_text() == events

    # the ranks' own checks (a Slurm job submitted before the checkpoint existed meets them there)
    from trainutil import train

    seen = len(paths.rank_log(0, 1).read_text(errors="replace"))  # rank logs are appended to
    done = train(paths.run_dir, common, world=2, attempt=0)  # complete: ends before the model is built
    assert done.codes == [0, 0], done.all_logs()
    new = done.log(0)[seen:]
    assert "already complete at step 4/4" in new and "building the" not in new, new[-3000:]
    seen = len(done.log(0))
    # the other optimizer type: final, one line
    res = train(paths.run_dir, [*common, "parallelism=tp2", "training.train_iters=8"], world=2, attempt=0)
    assert res.codes == [EXIT_CKPT_MISMATCH] * 2, res.all_logs()
    log = res.log(0)[seen:]
    assert "Traceback" not in log and "refused to start: parallelism.distributed_optimizer" in log, log[-3000:]
    assert "UserWarning" not in log and "known Megatron-Core/torch warnings are filtered" in log, log[-3000:]
    stops = [e for e in res.events if e["event"] == "stop"]
    assert stops[-1]["reason"] == "checkpoint_mismatch" and stops[-1]["code"] == EXIT_CKPT_MISMATCH


def test_an_impossible_run_directory_is_left_to_the_write_that_refuses_it(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    job = compose_job([f"cluster.run_root={tmp_path / 'afile' / 'runs'}", "run.name=tiny"])
    verdict = pretrain.checkpoint_verdict(job, Path(job.run_dir))
    assert verdict.conflict is None and verdict.complete is None
