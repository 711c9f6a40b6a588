"""A slice of a chain that finds the slice before it ended TIMEOUT without a word: rank 0 prints one WARNING and
writes a ``previous_slice_timeout`` event with the steps lost, then trains on (train/previous_slice.py). A real
RankContext, event log and Slurm interface; sacct faked at the subprocess boundary."""
from __future__ import annotations

import subprocess

import pytest

from launch import dist_env
from recovery.events import EventLog, read_events


class Sacct:
    """``sacct -X -n -P -o State`` of the previous job: ``state`` (None: accounting unavailable); records calls."""

    def __init__(self, state):
        self.state, self.calls = state, []

    def __call__(self, argv, **kw):
        self.calls.append(list(argv))
        assert argv[0] == "sacct" and "-X" in argv, argv
        if self.state is None:
            return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled\n")
        return subprocess.CompletedProcess(argv, 0, self.state + "\n", "")


def context(tmp_path, job_id="502", restart=0, rank=0, world=2):
    from launch.compose import compose_job
    from recovery.signals import StopFlag
    from train.context import Hooks, RankContext

    job = compose_job(["model=tiny", f"cluster.gpus_per_node={world}", "run.time_limit_min=3"])
    paths = job.paths_at(tmp_path)
    return RankContext(job=job, paths=paths, dist=dist_env.DistEnv(rank, world, rank, "127.0.0.1", 1),
                       env={"SLURM_JOB_ID": job_id}, restart=restart, flag=StopFlag(),
                       events=EventLog(paths.events, rank=rank, job_id=job_id, restart_count=restart, host="n1"),
                       hooks=Hooks())


def previous_slice(paths, *, job="501", last_step=32, end=None):
    """Job 501's slice: resumed at 20, logged up to ``last_step``, then ``end`` (None: killed without a word)."""
    log = EventLog(paths.events, job_id=job, restart_count=0, host="n1", clock=lambda: 100.0)
    log.emit("job_start", world_size=2)
    log.emit("resume", step=20)
    for s in range(21, last_step + 1):
        log.emit("iteration", step=s, loss=5.0, seconds=1.0)
    if end is not None:
        log.emit("exit", reason=end, code=42, step=last_step)


def started(ctx):
    ctx.emit("job_start", world_size=ctx.world)  # the worker writes its own job_start first


def test_a_slice_after_an_unanswered_timeout_warns_with_the_steps_lost(tmp_path, capsys):
    from train.previous_slice import note_previous_slice

    ctx = context(tmp_path)
    previous_slice(ctx.paths)
    started(ctx)
    sacct = Sacct("TIMEOUT")
    rec = note_previous_slice(ctx, 30, runner=sacct)  # the newest checkpoint: step 30
    assert sacct.calls == [["sacct", "-X", "-n", "-P", "-j", "501", "-o", "State"]]
    assert {k: rec[k] for k in ("event", "job_id", "job_id_previous", "last_step", "resume_step", "steps_lost",
                                "slurm_state")} == {
        "event": "previous_slice_timeout", "job_id": "502", "job_id_previous": "501", "last_step": 32,
        "resume_step": 30, "steps_lost": 2, "slurm_state": "TIMEOUT"}
    assert [e["event"] for e in read_events(ctx.paths.events)][-2:] == ["job_start", "previous_slice_timeout"]
    out = capsys.readouterr().out.splitlines()
    assert out == ["WARNING: the previous slice (job 501) ran out of time (run.time_limit_min=3) before a stop "
                   "checkpoint and wrote no exit: 2 step(s) lost (it logged step 32; this slice resumes from step "
                   "30); if this repeats, its start-up outlasts the slice: raise run.time_limit_min (the job check "
                   "says how far)"]


@pytest.mark.parametrize("case", ["requeued_at_its_limit", "killed_not_timeout", "sacct_unavailable",
                                  "same_job_requeued", "not_rank_0", "first_slice"])
def test_no_warning_when_the_previous_slice_ended_otherwise(tmp_path, capsys, case):
    from train.previous_slice import note_previous_slice

    ctx = context(tmp_path, job_id="501" if case == "same_job_requeued" else "502",
                  restart=1 if case == "same_job_requeued" else 0, rank=1 if case == "not_rank_0" else 0)
    if case != "first_slice":
        previous_slice(ctx.paths, end="requeue" if case == "requeued_at_its_limit" else None)
    started(ctx)
    sacct = Sacct({"killed_not_timeout": "NODE_FAIL", "sacct_unavailable": None}.get(case, "TIMEOUT"))
    assert note_previous_slice(ctx, 30, runner=sacct) is None
    assert "previous_slice_timeout" not in [e["event"] for e in read_events(ctx.paths.events)]
    assert "WARNING" not in capsys.readouterr().out
    # sacct is asked only when the event log shows an end nobody answered, on rank 0 of another job
    assert bool(sacct.calls) == (case in ("killed_not_timeout", "sacct_unavailable"))


def test_a_previous_slice_that_logged_no_step_has_no_steps_lost_figure(tmp_path, capsys):
    from train.previous_slice import note_previous_slice

    ctx = context(tmp_path)
    previous_slice(ctx.paths, last_step=20)  # resumed at 20 and never reached a step: start-up outlasted it
    started(ctx)
    rec = note_previous_slice(ctx, 20, runner=Sacct("TIMEOUT"))
    assert (rec["last_step"], rec["steps_lost"]) == (None, None)
    assert "this slice resumes from step 20" in capsys.readouterr().out
