"""``launch/status.py`` on a real recorded run (``tests/fixtures/slurm_run``) with Slurm faked at the
subprocess boundary: one fake answers ``squeue``/``sacct`` like Slurm 22.05 does in each state."""
from __future__ import annotations

import io
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch import status
from launch.compose import load_job
from launch.run_state import gather
from recovery.commit import commit, prepare_staging
from recovery.lock import Holder, process_start_time

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "slurm_run"


class FakeSlurm:
    """squeue/sacct answers for one job; ``None`` means Slurm no longer lists the job."""

    def __init__(self, squeue: str | None = None, sacct: str = "", missing: bool = False):
        self.squeue, self.sacct, self.missing, self.calls = squeue, sacct, missing, []

    def __call__(self, argv, **kw):
        self.calls.append(list(argv))
        if self.missing:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        if argv[0] == "squeue":
            if self.squeue is None:
                return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
            return subprocess.CompletedProcess(argv, 0, self.squeue + "\n", "")
        if argv[0] == "sacct" and "-D" in argv:
            return subprocess.CompletedProcess(argv, 0, (FIXTURE / "sacct.txt").read_text(), "")
        if argv[0] == "sacct":
            return subprocess.CompletedProcess(argv, 0, self.sacct + "\n", "")
        raise AssertionError(argv)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "fixture"
    shutil.copytree(FIXTURE, d)
    (d / "sacct.txt").unlink()  # the status asks sacct itself
    return d


@pytest.mark.parametrize("squeue, sacct, state, reason", [
    ("8700|PENDING|Priority", "", "requeued", "Priority"),  # pending again after attempts of the same job
    ("8700|RUNNING|None", "", "running", ""),
    (None, "8700|COMPLETED|0:0", "completed", ""),
    (None, "8700|FAILED|1:0", "failed", "exit 1:0"),
    (None, "8700|CANCELLED by 0|0:15", "cancelled", "by 0"),
    (None, "8700|TIMEOUT|0:0", "timeout", ""),
])
def test_state_from_squeue_then_sacct(run_dir, squeue, sacct, state, reason):
    st = gather(run_dir, runner=FakeSlurm(squeue, sacct))
    assert (st.state, st.reason) == (state, reason)
    assert st.job_id == "8700" and st.attempts == 3  # the fixture ran 3 attempts under one job id
    assert (st.step, st.target) == (20, 20) and st.step_time_s == pytest.approx(1.4, abs=0.3)
    assert st.interruptions == {"preemption": 1, "node_failure": 1}  # causes from sacct -D and the logs
    assert 0 < st.goodput < 1
    assert st.mfu_now is None and "cluster.gpu is cpu" in st.mfu_note
    assert st.log_tail and "successfully saved checkpoint at iteration      20" in st.log_tail[-1]


def test_a_fresh_pending_job_shows_the_reason_and_no_progress(tmp_path):
    d = tmp_path / "new"
    d.mkdir()
    shutil.copy(FIXTURE / "config.yaml", d)
    (d / "submissions.jsonl").write_text(json.dumps({"job_id": "9001", "time": 1.0, "script": "x"}) + "\n")
    st = gather(d, runner=FakeSlurm("9001|PENDING|Resources"))
    assert (st.state, st.reason, st.job_id, st.attempts, st.step) == ("pending", "Resources", "9001", 0, None)
    text = status.format_state(st)
    assert "pending (Resources); job 9001" in text and "checkpoint none verified yet" in text


def test_eta_counts_the_remaining_slices(run_dir):
    cfg = run_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("train_iters: 20", "train_iters: 2020"))
    st = gather(run_dir, runner=FakeSlurm("8700|RUNNING|None"))
    assert st.eta_s == pytest.approx(2000 * st.step_time_s)
    job = load_job(cfg)
    usable = job.run.time_limit_min * 60 - job.training.signal_lead_time_s  # one slice, less the signal lead
    assert st.slices_left == math.ceil(st.eta_s / usable) >= 2
    assert "ETA" in status.format_state(st) and "more slice" in status.format_state(st)


def test_verified_checkpoint_and_its_age(run_dir):
    root = run_dir / "checkpoints"
    staging = prepare_staging(root, 20)
    (staging / "shard.distcp").write_bytes(b"x" * 100)
    res = commit(root, 20, {"step": 20}, keep=2)
    os.utime(res.path, (1000.0, 1000.0))
    st = gather(run_dir, runner=FakeSlurm("8700|RUNNING|None"), clock=lambda: 1000.0 + 600)
    assert (st.checkpoint_step, st.checkpoint_age_s) == (20, pytest.approx(600.0))
    assert "checkpoint step 20 verified, 10 min ago" in status.format_state(st)


def test_an_async_save_in_progress_on_a_live_run_is_a_note_and_a_dead_ones_staging_a_warning(run_dir):
    root = run_dir / "checkpoints"
    staging = prepare_staging(root, 20)
    (staging / "shard.distcp").write_bytes(b"x" * 100)
    commit(root, 20, {"step": 20}, keep=2)
    (prepare_staging(root, 30) / "shard.distcp").write_bytes(b"x" * 10)  # the next save, still being written
    live = gather(run_dir, runner=FakeSlurm("8700|RUNNING|None"))
    assert live.checkpoint_step == 20 and not any("iter_0000030" in w for w in live.warnings), live.warnings
    text = status.format_state(live)
    assert "note: checkpoint iter_0000030.tmp: a save in progress" in text and "killed during the save" not in text
    ended = gather(run_dir, runner=FakeSlurm(None, "8700|FAILED|1:0"))
    assert any("iter_0000030.tmp skipped" in w and "killed during the save" in w for w in ended.warnings)


def test_no_squeue_is_a_warning_and_the_event_log_still_answers(run_dir):
    st = gather(run_dir, runner=FakeSlurm(missing=True))
    assert st.state == "completed" and "from the event log" in st.reason
    assert any("squeue is not on PATH" in w for w in st.warnings)
    assert "WARNING: squeue is not on PATH" in status.format_state(st)


def test_local_run_running_while_its_lock_is_held_then_completed(run_dir):
    cfg = run_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("launcher: slurm", "launcher: local"))
    me = Holder(host=socket.gethostname(), pid=os.getpid(), pid_start=process_start_time(os.getpid()),
                start_time=1.0)
    (run_dir / "run.lock").write_text(json.dumps(me.__dict__))
    never = FakeSlurm()
    st = gather(run_dir, runner=never)
    assert st.state == "running" and f"pid {os.getpid()}" in st.reason and never.calls == []
    (run_dir / "run.lock").unlink()
    assert gather(run_dir, runner=never).state == "completed"


def test_cli_json_and_exit_codes(run_dir, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert status.main([str(run_dir), "--json"], runner=FakeSlurm("8700|RUNNING|None"), out=out, err=err) == 0
    doc = json.loads(out.getvalue())
    assert doc["state"] == "running" and doc["step"] == 20 and doc["interruptions"]["preemption"] == 1
    err = io.StringIO()
    assert status.main([f"cluster.run_root={tmp_path}", "run.name=nope"], out=io.StringIO(), err=err) == 2
    assert err.getvalue().count("\n") == 1 and "no run 'nope'" in err.getvalue()
    # by overrides, as pretrain.py names the run
    out = io.StringIO()
    assert status.main([f"cluster.run_root={tmp_path}", "run.name=fixture"], runner=FakeSlurm(None, "8700|COMPLETED|0:0"),
                       out=out, err=io.StringIO()) == 0
    assert "state      completed" in out.getvalue()


def test_watch_refreshes_until_the_run_ends(run_dir):
    answers = iter(["8700|PENDING|BeginTime", "8700|RUNNING|None", None])

    class Changing(FakeSlurm):
        def __call__(self, argv, **kw):
            if argv[0] == "squeue":
                self.squeue = next(answers)
            return super().__call__(argv, **kw)

    out, sleeps = io.StringIO(), []
    rc = status.main([str(run_dir), "--watch", "5"], runner=Changing(sacct="8700|COMPLETED|0:0"), out=out,
                     err=io.StringIO(), sleep=sleeps.append)
    assert rc == 0 and sleeps == [5.0, 5.0]
    states = [ln.split()[1].rstrip(";") for ln in out.getvalue().splitlines() if ln.startswith("state")]
    assert states == ["requeued", "running", "completed"]


def test_sweep_table_shows_every_member(run_dir, tmp_path):
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    rows = [{"run_name": "fixture", "run_dir": str(run_dir), "layout": "tp2-pp1", "status": "submitted",
             "job_id": "8700"},
            {"run_name": "x_tp3-pp1", "run_dir": str(tmp_path / "x"), "layout": "tp3-pp1", "status": "refused",
             "reasons": ["model.num_attention_heads: attention heads must split evenly"]}]
    (sweeps / "s1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    assert status.main([f"cluster.run_root={tmp_path}", "s1"], runner=FakeSlurm("8700|RUNNING|None"), out=out,
                       err=io.StringIO()) == 0
    text = out.getvalue()
    assert "fixture" in text and "running" in text and "20/20" in text
    assert "refused" in text and "model.num_attention_heads" in text


def test_the_status_command_imports_no_torch(run_dir):
    proc = subprocess.run([sys.executable, "-X", "importtime", str(Path(status.__file__)), str(run_dir)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": "/nonexistent"})
    assert proc.returncode == 0 and "state      completed (from the event log)" in proc.stdout, proc.stderr[-2000:]
    mods = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert "launch.run_state" in mods
    assert not [m for m in mods if m.split(".")[0] in ("torch", "megatron")]


def _priced(run_dir, price):
    cfg = run_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("  requeue_allowed:", f"  gpu_hour_price: {price}\n  requeue_allowed:", 1))


def test_gpu_hours_so_far_from_slurm_accounting_and_their_cost(run_dir):
    st = gather(run_dir, runner=FakeSlurm(None, "8700|COMPLETED|0:0"))
    # three allocations of the 4-rank job (sacct -D): 45 s + 1:19 + 55 s, no GPU in AllocTRES: one per rank
    assert st.gpu_hours_source == "sacct" and st.gpu_hours == pytest.approx(4 * (45 + 79 + 55) / 3600)
    assert st.cost is None and "set cluster.gpu_hour_price for a cost" in status.format_state(st)
    _priced(run_dir, 2.5)
    st = gather(run_dir, runner=FakeSlurm(None, "8700|COMPLETED|0:0"))
    assert st.cost == pytest.approx(2.5 * 4 * 179 / 3600)
    line = next(ln for ln in status.format_state(st).splitlines() if ln.startswith("cost"))
    assert line.startswith(f"cost       {st.cost:,.2f} (0.199 process-hours x 2.5 per process-hour"), line
    assert "Slurm accounting" in line


def test_gpu_hours_from_the_event_log_without_slurm(run_dir):
    _priced(run_dir, 1)
    st = gather(run_dir, runner=FakeSlurm(missing=True))
    # each attempt from job_start to its last event (fixture times), x 4 ranks
    assert st.gpu_hours_source == "events"
    assert st.gpu_hours == pytest.approx(4 * (15.2815 + 18.3257 + 24.7840) / 3600, rel=1e-3)
    assert st.cost == pytest.approx(st.gpu_hours) and "event log, worker time" in status.format_state(st)


def test_validation_loss_is_shown_with_its_trend(run_dir):
    log = run_dir / "logs" / "8700_3.out"
    blocks = "".join(f"-----\n validation loss at iteration {it} | lm loss value: {loss:.6E} | "
                     f"lm loss PPL: {math.exp(loss):.6E} | \n-----\n" for it, loss in ((10, 5.5), (20, 4.25)))
    log.write_text(log.read_text() + blocks)
    st = gather(run_dir, runner=FakeSlurm("8700|RUNNING|None"))
    assert (st.val_step, st.val_loss, st.val_first) == (20, pytest.approx(4.25), [10, pytest.approx(5.5)])
    assert st.val_ppl == pytest.approx(math.exp(4.25), rel=1e-5)
    assert f"validation lm loss 4.25, PPL {math.exp(4.25):.4g} at step 20 (was 5.5 at step 10)" in \
        status.format_state(st)
    assert json.loads(json.dumps(st.to_dict()))["val_loss"] == pytest.approx(4.25)
