"""The spend ledger's arithmetic (analysis/spend.py), the submit-time refusal of a spent budget
(launch/ledger.py) and the ranks' guard state (train/budget.py, without torch)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import spend
from fake_slurm import FakeSlurm
from launch.compose import compose_job
from launch.ledger import budget_problems, spent
from launch.paths import RunPaths
from train.budget import SCALE, BudgetGuard


def test_event_spans_count_every_attempt_to_its_last_event_and_the_running_one_to_now():
    events = [
        {"event": "job_start", "time": 100.0, "world_size": 4},
        {"event": "iteration", "time": 160.0},
        {"event": "stop", "time": 190.0, "reason": "crash"},  # a failed attempt counts too
        {"event": "job_start", "time": 1000.0, "world_size": 2},
        {"event": "iteration", "time": 1100.0},
    ]
    assert spend.event_spans(events) == [(4, 90.0), (2, 100.0)]
    assert spend.event_spans(events, now=1300.0) == [(4, 90.0), (2, 300.0)]
    assert spend.hours(spend.event_spans(events)) == pytest.approx((4 * 90 + 2 * 100) / 3600)
    assert spend.event_spans([{"event": "job_start", "time": 5.0}], world_size=8, now=6.0) == [(8, 1.0)]
    assert spend.event_spans([{"event": "iteration", "time": "x"}]) == []


def test_sacct_spans_read_every_allocation_with_its_gpus_and_skip_steps_and_pending_rows():
    text = "\n".join([
        "101|3600|billing=16,cpu=16,gres/gpu=8,mem=64G,node=1|REQUEUED",   # attempt 0, requeued
        "101|1800|billing=16,cpu=16,gres/gpu=8,mem=64G,node=1|CANCELLED by 1000",  # attempt 1, cancelled
        "101.batch|1800|cpu=16|CANCELLED",  # a step, not an allocation
        "102|0||PENDING",
        "103|600|cpu=4,node=1|FAILED",  # no GPU count: the world size
        "garbage",
    ])
    assert spend.sacct_spans(text, world_size=4) == [(8, 3600.0), (8, 1800.0), (4, 600.0)]
    assert spend.tres_gpus("cpu=8,gres/gpu:h100=4,node=1") == 4
    assert spend.SACCT_FORMAT.startswith("JobID,ElapsedRaw,AllocTRES,State")


def test_a_phantom_accounting_row_is_capped_at_the_next_attempt_or_not_counted_with_a_warning():
    """Slurm 22.05: a --no-kill job that lost nodes, then requeued, keeps a row with End=Unknown whose elapsed time
    grows after the job ended. Counted as it stands, it would stop a run with a budget early, growing by the hour."""
    tres = "billing=16,cpu=16,gres/gpu=8,node=1"
    text = "\n".join([
        f"101|86400|{tres}|NODE_FAIL|2026-12-07T10:00:00|Unknown",  # the phantom: 'a day' and counting
        f"101|1800|{tres}|COMPLETED|2026-12-07T10:30:00|2026-12-07T11:00:00",
        f"102|7200|{tres}|CANCELLED by 0|2026-12-07T12:00:00|Unknown",  # not running, nothing after it
        f"103|600|{tres}|RUNNING|2026-12-07T13:00:00|Unknown",  # the attempt running now: counted as it is
    ])
    lines = []
    assert spend.sacct_spans(text, world_size=8, warn=lines.append) == [(8, 1800.0), (8, 1800.0), (8, 600.0)]
    assert len(lines) == 2
    assert "job 101's attempt that started 2026-12-07T10:00:00 (NODE_FAIL) has End=Unknown after a later attempt " \
           "started" in lines[0] and lines[0].endswith("counted up to the next attempt's start, 1800 s")
    assert "job 102" in lines[1] and lines[1].endswith("not counted")
    assert spend.tres_gpus("cpu=8") is None


def test_thresholds_are_announced_once_per_budget_and_a_raised_budget_starts_again():
    assert spend.crossed(0.83, []) == [0.5, 0.8]
    assert spend.crossed(0.83, [0.5]) == [0.8]
    assert spend.crossed(1.2, [0.5, 0.8, "projected"]) == [0.95]
    events = [{"event": "budget_warning", "threshold": 0.5, "budget": 2.0},
              {"event": "budget_warning", "threshold": "projected", "budget": 2.0},
              {"event": "budget_warning", "threshold": 0.8, "budget": 1.0}]
    assert spend.announced(events, 2.0) == {0.5, "projected"}
    assert spend.announced(events, 4.0) == set()


def test_ledger_line_and_projection():
    led = spend.Ledger(0.42, "events", 1.0, spend.project(0.42, 100, 36.0, 2), "process-hours")
    assert led.projected == pytest.approx(0.42 + 100 * 36 * 2 / 3600)
    assert led.line() == ("0.42 process-hours of a 1 process-hours budget (42.0%); projected 2.42 process-hours at "
                          "the target (over the budget)")
    assert not led.over and spend.Ledger(1.0, "sacct", 1.0).over
    assert spend.project(1.0, 10, None, 8) is None
    assert spend.projected_text(led).endswith("unless run.budget_gpu_hours is raised to 2.42")


class _Ctx:
    def __init__(self):
        self.lines, self.events = [], []

    def log(self, line):
        self.lines.append(line)

    def emit(self, kind, **fields):
        self.events.append({"event": kind, **fields})


def test_the_guard_warns_at_each_threshold_once_then_stops_at_the_budget():
    job = compose_job(["cluster=local", "model=tiny", "cluster.gpus_per_node=2", "run.budget_gpu_hours=1.0"])
    now = [0.0]
    guard = BudgetGuard(job, base_hours=0.45, source="events", announced={0.5}, iters=10, clock=lambda: now[0])
    ctx = _Ctx()
    assert guard.local(0) == (int(0.45 * SCALE), 0)  # no step time yet: no projection
    now[0] = 0.2 * 3600 / 2  # two processes, 0.2 h later: 0.65 spent
    guard.step_times += [360.0]
    spent_n, proj_n = guard.local(4)
    assert spent_n == pytest.approx(0.65 * SCALE, rel=1e-9) and proj_n / SCALE == pytest.approx(0.65 + 6 * 0.2)
    assert guard.review(ctx, 4, spent_n, proj_n) is None
    assert [e["threshold"] for e in ctx.events] == ["projected"]  # 0.5 was announced by an earlier attempt
    now[0] = 0.5 * 3600 / 2  # 0.95
    assert guard.review(ctx, 6, *guard.local(6)) is None
    assert [e["threshold"] for e in ctx.events] == ["projected", 0.8, 0.95]
    assert ctx.lines[1].startswith("WARNING: budget: 80% of run.budget_gpu_hours spent")
    now[0] = 0.56 * 3600 / 2
    led = guard.review(ctx, 7, *guard.local(7))
    assert led is not None and led.over and len(ctx.events) == 3
    assert spend.stop_text(led, 7, "r").startswith("budget: 1.01 process-hours of a 1 process-hours budget")
    # no bare command that would start a new local run: the same command, with its cluster and other overrides
    assert spend.stop_text(led, 7, "r").endswith("resubmit the same python launch/pretrain.py command (run.name=r, "
                                                 "with its cluster= and every other override) adding "
                                                 "run.budget_gpu_hours=<more>")


def _run_dir(tmp_path: Path, overrides: list, events: list) -> tuple:
    job = compose_job(["model=tiny", f"cluster.run_root={tmp_path}", "run.name=r", *overrides])
    run_dir = tmp_path / "r"
    paths = job.paths_at(run_dir)
    paths.events.parent.mkdir(parents=True, exist_ok=True)
    paths.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    return job, run_dir


def test_a_resubmission_over_a_spent_budget_is_refused_with_the_arithmetic(tmp_path):
    events = [{"event": "job_start", "time": 0.0, "world_size": 4}, {"event": "exit", "time": 1800.0}]
    job, run_dir = _run_dir(tmp_path, ["cluster=local", "cluster.gpus_per_node=4", "run.budget_gpu_hours=2"], events)
    (p,) = budget_problems(job, run_dir)
    assert p.field == "run.budget_gpu_hours"
    assert p.arithmetic == "spent 2 process-hours (event log) >= budget 2 process-hours"
    assert p.fix == "raise it to continue the run: run.budget_gpu_hours=3 (or more)"
    job, run_dir = _run_dir(tmp_path, ["cluster=local", "cluster.gpus_per_node=4", "run.budget_gpu_hours=2.5"],
                            events)
    assert budget_problems(job, run_dir) == []


def test_on_slurm_the_spend_is_slurms_accounting_of_every_attempt(tmp_path):
    job, run_dir = _run_dir(tmp_path, ["cluster=lustre", "run.budget_gpu_hours=10"],
                            [{"event": "job_start", "time": 0.0, "world_size": 8}, {"event": "exit", "time": 60.0}])
    RunPaths.of(run_dir).submissions.write_text(json.dumps({"job_id": "77"}) + "\n")
    slurm = FakeSlurm(usage=[(3600, "cpu=64,gres/gpu=8,node=1", "REQUEUED"), (1800, "cpu=64,gres/gpu=8,node=1", "FAILED")])
    assert spent(job, run_dir, runner=slurm) == (pytest.approx(12.0), "sacct")
    (p,) = budget_problems(job, run_dir, runner=slurm)
    assert "spent 12 GPU-hours (Slurm accounting) >= budget 10 GPU-hours" in p.arithmetic
    slurm = FakeSlurm(fail={"sacct"}, fail_words="sacct: error: Slurm accounting storage is disabled")
    assert spent(job, run_dir, runner=slurm) == (pytest.approx(8 * 60 / 3600), "events")


# ---- quotas and a sweep's budget at submit ------------------------------------------------------------------------

def _team_run(root: Path, name: str, account: str, spans: list) -> None:
    """A run directory another submission left: its config.yaml names the account, its events the attempts."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"cluster:\n  account: {account}\n  nodes: 2\n  gpus_per_node: 8\n")
    (d / "events.jsonl").write_text("".join(
        json.dumps({"event": "job_start", "time": a, "world_size": 16}) + "\n"
        + json.dumps({"event": "exit", "time": b}) + "\n" for a, b in spans))


def test_a_job_over_what_is_left_of_its_accounts_quota_is_refused_with_the_arithmetic(tmp_path):
    from datetime import datetime

    from launch.ledger import period_start, quota_problems

    now = datetime(2026, 12, 20, 12, 0).timestamp()
    month = period_start("month", now)
    root = tmp_path / "runs"
    _team_run(root, "a", "llm", [(month + 3600, month + 3600 + 2000 * 3600 / 16)])  # 2,000 GPU-hours this month
    _team_run(root, "b", "llm", [(month - 7200, month + 3600)])  # 16 GPU-hours of it in this month
    _team_run(root, "c", "vision", [(month, month + 10**6)])  # another team's run
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("period: month\nquotas:\n  llm: 50000\n  vision: 1000\n")
    job = compose_job(["cluster=lustre", "model=7b", f"cluster.run_root={root}", "cluster.account=llm",
                       f"cluster.quota_file={quotas}"])
    (p,) = quota_problems(job, root / "7b", now=now)
    assert p.field == "cluster.quota_file" and "account llm's quota" in p.message
    assert p.arithmetic.startswith(f"account llm: quota 50,000 GPU-hours per month - spent 2,016 by 2 run(s) under "
                                   f"{root} since 2026-12-01 = 47,984 left < this job's estimate 48,")
    assert p.fix.startswith("set training.train_iters=") and p.fix.endswith("or wait for the next month")
    quotas.write_text("period: month\nquotas:\n  llm: 60000\n")
    assert quota_problems(job, root / "7b", now=now) == []
    quotas.write_text("period: fortnight\nquotas: {llm: 1}\n")
    (bad,) = quota_problems(job, root / "7b", now=now)
    assert bad.message == "not a quota file" and "fortnight" not in bad.arithmetic
    # an endless file (/dev/zero) or a huge one is refused after one MiB, not read until memory runs out
    for endless in ("/dev/zero", str(_huge(tmp_path / "huge.yaml"))):
        job = compose_job(["cluster=lustre", "model=7b", f"cluster.run_root={root}", "cluster.account=llm",
                           f"cluster.quota_file={endless}"])
        (big,) = quota_problems(job, root / "7b", now=now)
        assert big.field == "cluster.quota_file" and big.message == "the quota file is too large to be a quota file"
        assert "more than 1048576 bytes" in big.arithmetic


def _huge(path):
    path.write_text("period: month\nquotas:\n" + "".join(f"  a{i}: 1\n" for i in range(200_000)))
    return path
    quotas.write_text("quotas: {vision: 1}\n")
    (acct,) = quota_problems(job, root / "7b", now=now)
    assert acct.field == "cluster.account" and "account 'llm' not in" in acct.arithmetic
    quotas.write_bytes(b"\x00\xff")
    (binary,) = quota_problems(job, root / "7b", now=now)
    assert binary.message == "the quota file cannot be read"


def test_sweep_members_past_the_sweeps_budget_are_refused_in_the_summary_table(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(repo / "launch" / "pretrain.py"), "-m", "cluster=lustre", "model=7b",
                           f"cluster.run_root={tmp_path / 'runs'}", "parallelism.tp=2,4,8", "dry_run=true",
                           "run.sweep_budget_gpu_hours=150000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    rows = {ln.split()[0]: ln for ln in proc.stderr.splitlines() if ln.startswith("7b_tp")}
    assert proc.returncode == 0, proc.stderr[-2000:]
    statuses = {k: v.split()[2] for k, v in rows.items()}
    assert statuses == {"7b_tp2": "ok", "7b_tp4": "ok", "7b_tp8": "refused"}, rows
    assert "run.sweep_budget_gpu_hours: this member would exceed the sweep's remaining budget" in rows["7b_tp8"]
    assert "arithmetic: 2 member(s) accepted" in proc.stderr and "accepted 102,595 + this member 69,095 = 171,690 GPU-hours > sweep budget 150,000 (47,405 left)" in proc.stderr
