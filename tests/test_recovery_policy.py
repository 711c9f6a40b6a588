"""The requeue policy and the checkpoint-interval rule: pure decisions, injected env/runner/clock."""
from __future__ import annotations

import json
import math
import signal
import subprocess
from dataclasses import dataclass
from itertools import count

import pytest
from fake_slurm import FakeSlurm

from recovery.events import EventLog, read_events
from recovery.interval import (
    daly_interval_s,
    expected_waste,
    interval_steps,
    job_mtbf_s,
    resolve_interval,
    young_interval_s,
)
from recovery.policy import (
    EXIT_MAX_RESTARTS,
    EXIT_REQUEUE,
    EXIT_ZERO_PROGRESS,
    after_stop_save,
    failed_nodes,
    lead_time_warning,
    read_progress,
    record_failed_node,
    restart_count_from_env,
    start_decision,
)


@dataclass
class Training:
    max_restarts: int = 20
    zero_progress_restarts: int = 3


def ticking():
    c = count(1000)
    return lambda: float(next(c))


def test_restart_count_from_env():
    assert restart_count_from_env({}) == 0
    assert restart_count_from_env({"SLURMTRON_RESTART_COUNT": "2"}) == 2
    assert restart_count_from_env({"SLURM_RESTART_COUNT": "5", "SLURMTRON_RESTART_COUNT": "2"}) == 5
    assert restart_count_from_env({"SLURM_RESTART_COUNT": "", "SLURMTRON_RESTART_COUNT": "1"}) == 1
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        restart_count_from_env({"SLURM_RESTART_COUNT": "x"})


def test_zero_progress_guard_stops_a_deterministic_crash(tmp_path):
    t = Training(zero_progress_restarts=3)
    clock = ticking()
    # a job that crashes at the same iteration every time, before any new checkpoint
    decisions = [start_decision(tmp_path, r, 10, t, clock=clock, job_id="77") for r in range(5)]
    assert [d.ok for d in decisions[:3]] == [True, True, True]
    d = decisions[3]
    assert (d.ok, d.reason, d.code) == (False, "zero_progress", EXIT_ZERO_PROGRESS)
    assert "3 consecutive restarts" in d.detail and "checkpoint step 10" in d.detail
    recs = read_progress(tmp_path)
    assert [r["restart_count"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[3]["decision"] == "zero_progress" and recs[0]["time"] == 1000.0
    assert json.loads((tmp_path / "progress.json").read_text())[0]["job_id"] == "77"


def test_zero_progress_from_no_checkpoint_at_all(tmp_path):
    t = Training(zero_progress_restarts=2)
    ds = [start_decision(tmp_path, r, None, t) for r in range(3)]
    assert [d.ok for d in ds] == [True, True, False]
    assert "no checkpoint" in ds[2].detail


def test_progress_resets_the_guard(tmp_path):
    t = Training(zero_progress_restarts=2)
    steps = [None, 10, 10, 20, 20, 30, 30]  # every second restart makes a checkpoint
    ds = [start_decision(tmp_path, r, s, t) for r, s in enumerate(steps)]
    assert all(d.ok for d in ds), [d.detail for d in ds]
    assert start_decision(tmp_path, 7, 30, t).reason == "zero_progress"


def test_fresh_submission_starts_a_new_chain(tmp_path):
    t = Training(zero_progress_restarts=1)
    assert start_decision(tmp_path, 0, 10, t).ok
    assert not start_decision(tmp_path, 1, 10, t).ok
    assert start_decision(tmp_path, 0, 10, t).ok  # the user fixed it and resubmitted


def test_guard_disabled_and_max_restarts(tmp_path):
    t = Training(max_restarts=2, zero_progress_restarts=0)
    assert all(start_decision(tmp_path, r, 5, t).ok for r in range(3))
    d = start_decision(tmp_path, 3, 5, t)
    assert (d.ok, d.reason, d.code) == (False, "max_restarts", EXIT_MAX_RESTARTS)
    assert "3 unplanned restarts (restart count 3 - 0 planned slice requeues, which are not counted) > training.max_restarts 2" in d.detail


def test_after_stop_save_requeues_own_job_under_slurm(tmp_path):
    run = FakeSlurm(job_id="4242")
    ev = EventLog(tmp_path / "events.jsonl", clock=lambda: 1.0)
    code = after_stop_save(signal.SIGUSR2, {"SLURM_JOB_ID": "4242"}, run, events=ev, step=7)
    assert code == EXIT_REQUEUE
    assert run.calls == [["scontrol", "requeue", "4242"]]
    (rec,) = read_events(tmp_path / "events.jsonl")
    assert (rec["event"], rec["method"], rec["step"], rec["signal"]) == ("requeue", "scontrol", 7, "SIGUSR2")


def test_after_stop_save_when_scontrol_refuses(tmp_path):
    # scancel: the job is already being cancelled and Slurm refuses the requeue
    run = FakeSlurm(fail={"scontrol requeue"}, fail_words="Requested operation is presently disabled")
    ev = EventLog(tmp_path / "events.jsonl")
    assert after_stop_save(signal.SIGTERM, {"SLURM_JOB_ID": "9"}, run, events=ev) == EXIT_REQUEUE
    (rec,) = read_events(tmp_path / "events.jsonl")
    assert rec["method"] == "exit_code" and "presently disabled" in rec["detail"]
    missing = FakeSlurm(missing={"scontrol"})
    assert after_stop_save(signal.SIGTERM, {"SLURM_JOB_ID": "9"}, missing, events=ev) == EXIT_REQUEUE
    rec = read_events(tmp_path / "events.jsonl")[-1]
    assert rec["method"] == "exit_code" and "could not run" in rec["detail"]


def test_after_stop_save_outside_slurm_or_when_not_allowed_runs_nothing():
    run = FakeSlurm()
    assert after_stop_save(signal.SIGTERM, {}, run) == EXIT_REQUEUE
    assert after_stop_save(signal.SIGUSR2, {"SLURM_JOB_ID": "1"}, run, requeue_allowed=False) == EXIT_REQUEUE
    assert run.calls == []


def test_failed_nodes_roundtrip(tmp_path):
    assert failed_nodes(tmp_path) == []
    record_failed_node(tmp_path, "node-3", "rank 5 crashed: ECC", clock=lambda: 5.0, job_id="11")
    record_failed_node(tmp_path, "node-7", "NODE_FAIL", clock=lambda: 6.0, job_id="11")
    nodes = failed_nodes(tmp_path)
    assert [n["host"] for n in nodes] == ["node-3", "node-7"]
    assert nodes[0] == {"host": "node-3", "reason": "rank 5 crashed: ECC", "time": 5.0, "job_id": "11"}
    assert json.loads((tmp_path / "failed_nodes.json").read_text()) == nodes
    with pytest.raises(ValueError):
        record_failed_node(tmp_path, "", "x")


def test_lead_time_warning_shows_the_arithmetic():
    assert lead_time_warning(120, 30, 60) is None
    assert lead_time_warning(90, 30, 60) is None
    w = lead_time_warning(60, 30.0, 45.0)
    assert "60 s < one step 30.0 s + one save 45.0 s = 75.0 s" in w
    assert "signal_lead_time_s >= 113" in w


# ---- checkpoint interval -------------------------------------------------------------------

def test_young_and_daly_hand_values():
    # C = 60 s, M = 24 h: Young sqrt(2*60*86400) = 3219.94 s
    assert young_interval_s(60, 86400) == pytest.approx(3219.937887, rel=1e-9)
    x = 60 / (2 * 86400)
    assert daly_interval_s(60, 86400) == pytest.approx(3219.937887 * (1 + math.sqrt(x) / 3 + x / 9) - 60, rel=1e-9)
    # Daly is below Young here (the -C term dominates) and is M once C >= 2M
    assert daly_interval_s(60, 86400) < young_interval_s(60, 86400)
    assert daly_interval_s(100, 40) == 40


def test_interval_steps_and_reasoning():
    mtbf = job_mtbf_s(50000, 500)  # 100 h / node-count: 360000 s
    assert mtbf == 360000
    steps, why = interval_steps(save_s=30, step_s=5, mtbf_s=mtbf)
    assert steps == round(daly_interval_s(30, mtbf) / 5)
    assert "Young" in why and "Daly" in why and f"every {steps} step(s)" in why
    # the chosen interval wastes less than twice and half of it
    tau = steps * 5
    assert expected_waste(tau, 30, mtbf) < expected_waste(2 * tau, 30, mtbf)
    assert expected_waste(tau, 30, mtbf) < expected_waste(tau / 2, 30, mtbf)
    assert interval_steps(save_s=1, step_s=1e6, mtbf_s=100)[0] == 1  # never 0


def test_resolve_interval():
    assert resolve_interval(10, save_s=1, step_s=1, node_mtbf_hours=1, nodes=1) == (10, "configured: every 10 step(s)")
    steps, why = resolve_interval("auto", save_s=30, step_s=5, node_mtbf_hours=50000, nodes=500)
    assert steps == interval_steps(30, 5, 360000)[0] and why.startswith("auto: node MTBF 50000 h / 500 node(s)")
    for bad in (0, "ten", None):
        with pytest.raises(ValueError, match="checkpoint_interval"):
            resolve_interval(bad, save_s=1, step_s=1, node_mtbf_hours=1, nodes=1)
    with pytest.raises(ValueError):
        job_mtbf_s(0, 4)
    with pytest.raises(ValueError):
        interval_steps(0, 1, 1)


def test_pure_recovery_modules_do_not_import_torch():
    """The renderer and planner import these on the login node."""
    import sys

    code = ("import sys, recovery.commit, recovery.resume, recovery.policy, recovery.interval, "
            "recovery.signals, recovery.events, recovery.storage, recovery.slurm, recovery.crash, recovery.exclusion; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_async_interval_charges_the_blocking_time_and_exposes_the_write_time():
    from recovery.interval import interval_steps, job_mtbf_s

    mtbf = job_mtbf_s(24.0, 16)
    sync_steps, _ = interval_steps(60.0, 10.0, mtbf)
    async_steps, why = interval_steps(3.0, 10.0, mtbf, write_s=60.0)
    assert async_steps < sync_steps  # a save that stalls 3 s instead of 60 s is worth doing more often
    assert "blocking C=3 s" in why and "W=60 s" in why and "(tau+W)/2M" in why
    tau = async_steps * 10.0
    want = 3.0 / tau + (tau + 60.0) / (2 * mtbf)
    assert f"{100 * want:.2f}%" in why


def test_lead_time_counts_the_wait_for_an_async_save_in_flight():
    from recovery.policy import lead_time_warning

    assert lead_time_warning(30, 5.0, 10.0) is None
    warn = lead_time_warning(30, 5.0, 10.0, wait_s=20.0)
    assert warn is not None and "the async save in flight 20.0 s" in warn and "35.0 s" in warn


def test_an_async_interval_is_never_shorter_than_a_save_takes_to_be_durable():
    """A 142 s save at 5.3 s/step: Daly alone would save every few steps, before the previous save is durable."""
    from recovery.interval import interval_steps, min_async_steps

    assert min_async_steps(142.0, 5.3) == 27 and min_async_steps(10.0, 5.0) == 2 and min_async_steps(0.1, 5.0) == 1
    steps, why = interval_steps(2.0, 5.3, 3600.0, write_s=142.0)
    assert steps == 27 and steps * 5.3 >= 142.0
    assert "raised from" in why and "ceil(W / step 5.3 s) = 27" in why
    assert interval_steps(2.0, 5.3, 3600.0)[0] < 27  # a synchronous save is durable when it returns: no floor


def test_the_plan_shows_the_interval_arithmetic():
    from launch.compose import compose_job
    from launch.plan import plan

    job = compose_job(["cluster=lustre", "model=70b", "cluster.node_mtbf_hours=2", "cluster.fs_write_bandwidth_gbs=2"])
    text, _code = plan(job)
    line = next(x for x in text.splitlines() if "checkpoint interval auto" in x)
    assert "raised from" in line and "ceil(W / step" in line
