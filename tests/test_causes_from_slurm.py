"""Causes from what Slurm says: an admin's ``scontrol requeue``, a stop that Slurm already requeued, and a crash
recorded in the kill window of a cancel. Fake Slurm at the subprocess boundary; the decision, the requeue
call and the report's attempt table are real."""
from __future__ import annotations

import json
import signal
from datetime import datetime, timedelta

import pandas as pd
import pytest
from fake_slurm import FakeSlurm

from analysis import parse_slurm
from recovery import policy
from recovery import stop as st
from recovery.events import EventLog, read_events

T0 = st.slurm_time("2026-12-01T00:08:06")


def slurm(state: str, restarts: int, preempt: str = "None", accounting: str = "REQUEUED", reason: str = "None"):
    return FakeSlurm(job_id="8100", state=state, accounting=accounting,
                     fields=f"Reason={reason} Requeue=1 Restarts={restarts} TimeLimit=00:30:00 "
                            f"StartTime=2026-12-01T00:07:58 EndTime=Unknown PreemptTime={preempt}")


def judge(runner, restart: int = 0) -> st.StopDecision:
    j = st.Judge({"SLURM_JOB_ID": "8100"}, restart_count=restart, lead_s=30.0, received_at=lambda: T0,
                 runner=runner, clock=lambda: T0 + 1)
    return j.decide(signal.SIGTERM, False)


def test_an_admin_scontrol_requeue_is_a_user_requeue_not_a_preemption():
    # what the ranks of a job see after `scontrol requeue <id>`: SIGTERM, Restarts above theirs, sacct REQUEUED,
    # no PreemptTime (seen on the local Slurm 22.05 cluster)
    d = judge(slurm("PENDING", restarts=1))
    assert (d.reason, d.requeue, d.requeued_by_slurm) == ("user_requeue", True, True)
    assert "Slurm already requeued the job (Restarts 1 > 0)" in d.evidence and "sacct REQUEUED" in d.evidence
    assert d.as_dict()["requeued_by_slurm"] is True
    # a preemption past its grace time also shows the new restart, but with a PreemptTime / PREEMPTED
    assert judge(slurm("COMPLETING", 1, preempt="2026-12-01T00:08:00")).reason == "preemption"
    assert judge(slurm("COMPLETING", 1, accounting="PREEMPTED")).reason == "preemption"
    assert judge(slurm("COMPLETING", 1, accounting="NODE_FAIL")).reason == "node_failure"
    assert judge(slurm("PENDING", 1), restart=1).reason == "undecided"  # a restart of its own is no evidence


def test_a_job_slurm_already_requeued_is_not_asked_again_and_says_so(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", job_id="8100", restart_count=0, clock=lambda: 1.0, host="n1")
    fake = FakeSlurm(job_id="8100")
    code = policy.after_stop_save(signal.SIGTERM, {"SLURM_JOB_ID": "8100"}, fake, events=log, step=12,
                                  requeued_by_slurm=True)
    assert code == policy.EXIT_REQUEUE and fake.calls == []
    [ev] = read_events(tmp_path / "events.jsonl")
    assert ev["method"] == "slurm" and "already requeued" in ev["detail"] and "failed" not in ev["detail"]


def test_a_requeue_that_finds_the_job_pending_is_not_reported_as_failed(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", job_id="8100", restart_count=0, clock=lambda: 1.0, host="n1")
    fake = FakeSlurm(job_id="8100", fail={"scontrol requeue"},
                     fail_words="scontrol: error: Job is pending execution for job 8100")
    assert policy.after_stop_save(signal.SIGTERM, {"SLURM_JOB_ID": "8100"}, fake, events=log) == 42
    [ev] = read_events(tmp_path / "events.jsonl")
    assert ev["method"] == "slurm" and "failed" not in ev["detail"]
    other = FakeSlurm(job_id="8100", fail={"scontrol requeue"}, fail_words="Access/permission denied")
    policy.after_stop_save(signal.SIGTERM, {"SLURM_JOB_ID": "8100"}, other, events=log)
    assert read_events(tmp_path / "events.jsonl")[-1]["detail"].startswith("scontrol requeue 8100 failed (rc 1)")


def _at(minutes: float) -> datetime:
    return datetime(2026, 11, 29, 10, 0, 0) + timedelta(minutes=minutes)


def _line(step: int, when: datetime) -> str:
    return (f" [{when:%Y-%m-%d %H:%M:%S}] iteration {step:>8}/      30 | consumed samples: {step * 8:>12} | "
            f"elapsed time per iteration (ms): 1000.0 | learning rate: 1.000000E-04 | global batch size: 8 | "
            f"lm loss: 5.000000E+00 | loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


@pytest.mark.parametrize("state,cause", [("CANCELLED by 0", "user_cancel"), ("TIMEOUT", "time_limit"),
                                         ("PREEMPTED", "preemption"), ("NODE_FAIL", "node_failure"),
                                         ("FAILED", "crash")])
def test_slurms_final_state_outranks_a_crash_in_the_kill_window(state, cause):
    """A scancel whose stop save did not fit in KillWait: rank 0 saw its collective break and recorded
    ``stop crash``; sacct's CANCELLED is what happened (the crash is listed as evidence). A FAILED job stays a crash."""
    from analysis.interruptions import build_attempts, interruptions
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text

    text = "\n".join(_line(s, _at(s / 6)) for s in range(1, 6))
    it, _ = parse_iteration_text(text, source="logs/100_0.out", job_id="100", offsets=True)
    base = _at(0).timestamp()
    ev, _ = parse_events_text("\n".join(json.dumps(r) for r in [
        {"time": base + 1, "event": "job_start", "job_id": "100", "restart_count": 0},
        {"time": base + 50, "event": "signal", "job_id": "100", "restart_count": 0, "signal": "SIGTERM", "step": 5},
        {"time": base + 55, "event": "stop", "job_id": "100", "restart_count": 0, "reason": "crash",
         "detail": "RuntimeError: Connection closed by peer"},
        {"time": base + 55, "event": "exit", "job_id": "100", "restart_count": 0, "reason": "error"}]))
    sacct, _ = parse_slurm.parse_sacct_text(
        "JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES\n"
        f"100|tron|{state}|0:15|{_at(0):%Y-%m-%dT%H:%M:%S}|{_at(0):%Y-%m-%dT%H:%M:%S}|"
        f"{_at(1):%Y-%m-%dT%H:%M:%S}|00:01:00|2|gres/gpu=4\n")
    att, _ = build_attempts(it, None, None, ev, sacct, gpus=4, train_iters=30)
    intr = interruptions(att)
    assert intr["cause"].tolist() == [cause]
    assert "event stop crash" in intr["evidence"].iloc[0]


def _ctx(tmp_path, signum, restart=0):
    from types import SimpleNamespace

    from launch.paths import RunPaths
    from recovery.signals import StopFlag

    flag = StopFlag(clock=lambda: T0)
    if signum:
        flag.set(signum)
    log = EventLog(tmp_path / "events.jsonl", job_id="8100", restart_count=restart, clock=lambda: 1.0, host="n1")
    job = SimpleNamespace(training=SimpleNamespace(signal_lead_time_s=30.0),
                          cluster=SimpleNamespace(requeue_allowed=True))
    return SimpleNamespace(flag=flag, job_id="8100", is_first=True, job=job, env={"SLURM_JOB_ID": "8100"},
                           restart=restart, paths=RunPaths.of(tmp_path), events=log, emit=log.emit,
                           log=lambda line: None)


def _make_judge(runner):
    return lambda ctx: st.Judge(ctx.env, restart_count=ctx.restart, lead_s=30.0, received_at=lambda: T0,
                                runner=runner, clock=lambda: T0 + 1, stop_file=ctx.paths.stop_request)


def test_a_collective_broken_after_a_scancel_is_the_cancel_not_a_crash(tmp_path):
    from train.worker import _broken_by_the_stop_signal

    cancelled = FakeSlurm(job_id="8100", state="COMPLETING", accounting="CANCELLED by 0",
                          fields="Reason=None Restarts=0 PreemptTime=None EndTime=2026-12-01T00:08:06")
    ctx = _ctx(tmp_path, signal.SIGTERM)
    code = _broken_by_the_stop_signal(ctx, RuntimeError("Connection closed by peer"), _make_judge(cancelled))
    assert code == 0
    stop, end = read_events(tmp_path / "events.jsonl")
    assert (stop["event"], stop["reason"], stop["requeue"], stop["saved"]) == ("stop", "user_cancel", False, False)
    assert "RuntimeError after SIGTERM was received" in stop["evidence"] and "sacct CANCELLED" in stop["evidence"]
    assert (end["event"], end["reason"]) == ("exit", "stopped")
    assert st.read_request(ctx.paths.stop_request)["reason"] == "user_cancel"


def test_a_collective_broken_after_an_admin_requeue_is_the_requeue(tmp_path):
    from train.worker import _broken_by_the_stop_signal

    ctx = _ctx(tmp_path, signal.SIGTERM)
    assert _broken_by_the_stop_signal(ctx, RuntimeError("x"), _make_judge(slurm("PENDING", restarts=1))) == 42
    kinds = [(e["event"], e.get("reason") or e.get("method")) for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == [("stop", "user_requeue"), ("requeue", "slurm"), ("exit", "requeue")]


def test_without_a_stop_signal_or_an_answer_a_crash_stays_a_crash(tmp_path):
    from train.worker import _broken_by_the_stop_signal

    assert _broken_by_the_stop_signal(_ctx(tmp_path, None), RuntimeError("x"), _make_judge(FakeSlurm())) is None
    unexplained = FakeSlurm(job_id="8100", state="RUNNING", accounting="RUNNING", fields="Reason=None Restarts=0")
    assert _broken_by_the_stop_signal(_ctx(tmp_path, signal.SIGTERM), RuntimeError("x"),
                                      _make_judge(unexplained)) is None
    assert not (tmp_path / "events.jsonl").exists()


def test_ranks_print_as_integers_in_the_report():
    import pandas as pd

    from analysis.report import _rank, live_alerts

    assert (_rank(2.0), _rank(3), _rank("1"), _rank(None), _rank(float("nan"))) == ("2", "3", "1", "?", "?")
    ev = pd.DataFrame([
        {"ts": pd.Timestamp("2026-01-01"), "job_id": "5", "restart_count": 0, "event": "straggler", "step": 9,
         "rank_slow": 2.0, "host_slow": "n2", "ratio": 1.8, "steps": 20},
        {"ts": pd.Timestamp("2026-01-01"), "job_id": "5", "restart_count": 0, "event": "hang", "step": 9,
         "deadline": "step", "arithmetic": "3 x 2 s", "suspects": [{"rank": 1.0, "host": "n1"}], "stacks": "d"}])
    text = " ".join(live_alerts(ev)["what"])
    assert "rank 2 on n2" in text and "rank 1 on n1" in text and ".0 on" not in text


def test_exclusion_requeue_has_its_own_cause_and_steps_lost_span_a_resubmission():
    """Job 100: attempt 0 trains to step 5 and dies with its node; attempt 1 lands on that (recorded) node and
    requeues away at once; attempt 2 resumes from 5, trains to 10 and is drained at step 10 with its last save at
    step 8 (then job 200, the resubmission, resumes from 8: 2 steps lost across the resubmission)."""
    from analysis.interruptions import build_attempts, interruptions
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text

    def t(minutes):
        return _at(minutes).timestamp()

    def iters(job, first, last, start_min):
        text = "\n".join(_line(s, _at(start_min + (s - first + 1) / 6)) for s in range(first, last + 1))
        return parse_iteration_text(text, source=f"logs/{job}_0.out", job_id=job, offsets=True)[0]

    it = pd.concat([iters("100", 1, 5, 0), iters("100", 6, 10, 7), iters("200", 9, 12, 20)], ignore_index=True)
    recs = [
        {"time": t(0.1), "event": "job_start", "job_id": "100", "restart_count": 0},
        {"time": t(6.1), "event": "exclude", "job_id": "100", "restart_count": 1, "hosts": ["stn1"],
         "bad_here": ["stn1"], "ok": True, "detail": "requeued excluding stn1"},
        {"time": t(7.0), "event": "job_start", "job_id": "100", "restart_count": 2},
        {"time": t(7.0), "event": "resume", "job_id": "100", "restart_count": 2, "step": 5},
        {"time": t(9.0), "event": "stop", "job_id": "100", "restart_count": 2, "reason": "user_stop", "requeue": False,
         "step": 10, "evidence": "stop request file"},
        {"time": t(9.0), "event": "exit", "job_id": "100", "restart_count": 2, "reason": "stopped", "step": 10},
        {"time": t(20.0), "event": "job_start", "job_id": "200", "restart_count": 0},
        {"time": t(20.0), "event": "resume", "job_id": "200", "restart_count": 0, "step": 8},
    ]
    ev, _ = parse_events_text("\n".join(json.dumps(r) for r in recs))
    hdr = "JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES\n"

    def row(job, state, a, b):
        return (f"{job}|tron|{state}|0:0|{_at(a):%Y-%m-%dT%H:%M:%S}|{_at(a):%Y-%m-%dT%H:%M:%S}|"
                f"{_at(b):%Y-%m-%dT%H:%M:%S}|00:01:00|2|gres/gpu=4\n")
    sacct, _ = parse_slurm.parse_sacct_text(hdr + row("100", "NODE_FAIL", 0, 6) + row("100", "REQUEUED", 6, 6.5)
                                            + row("100", "COMPLETED", 7, 9) + row("200", "RUNNING", 20, 25))
    att, _ = build_attempts(it, None, None, ev, sacct, gpus=4, train_iters=30)
    intr = interruptions(att).set_index(["job", "attempt"])
    assert intr.loc[("100", 1), "cause"] == "node_exclusion"
    assert "on recorded failed node(s) stn1" in intr.loc[("100", 1), "evidence"]
    assert intr.loc[("100", 0), "cause"] == "node_failure"
    assert int(att.set_index(["job", "attempt"]).loc[("100", 2), "resumed_from"]) == 5  # on the attempt that resumed
    assert (intr.loc[("100", 2), "cause"], int(intr.loc[("100", 2), "steps_lost"])) == ("user_stop", 2)


@pytest.mark.parametrize("own_requeue,state,cause", [
    (False, "REQUEUED", "user_requeue"),  # `scontrol requeue` by an admin: killed before any stop event
    (True, "REQUEUED", "preemption"),  # the ranks saved in a preemption's grace time and requeued themselves
    (False, "PREEMPTED", "preemption"),  # the grace time ran out: Slurm requeued the preempted job
])
def test_a_sigterm_then_requeued_attempt_is_named_from_sacct_and_the_ranks_own_requeue(own_requeue, state, cause):
    from analysis.interruptions import build_attempts, interruptions
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text

    text = "\n".join(_line(s, _at(s / 6)) for s in range(1, 6)) + "\n" + \
        "\n".join(_line(s, _at(3 + s / 6)) for s in range(3, 31))
    it, _ = parse_iteration_text(text, source="logs/100_0.out", job_id="100", offsets=True)
    base = _at(0).timestamp()
    recs = [{"time": base + 1, "event": "job_start", "job_id": "100", "restart_count": 0},
            {"time": base + 50, "event": "signal", "job_id": "100", "restart_count": 0, "signal": "SIGTERM", "step": 5}]
    if own_requeue:
        recs.append({"time": base + 55, "event": "requeue", "job_id": "100", "restart_count": 0, "method": "scontrol"})
    recs.append({"time": base + 180, "event": "job_start", "job_id": "100", "restart_count": 1})
    ev, _ = parse_events_text("\n".join(json.dumps(r) for r in recs))
    hdr = "JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES\n"
    sacct, _ = parse_slurm.parse_sacct_text(
        hdr + f"100|tron|{state}|0:0|{_at(0):%Y-%m-%dT%H:%M:%S}|{_at(0):%Y-%m-%dT%H:%M:%S}|"
              f"{_at(1):%Y-%m-%dT%H:%M:%S}|00:01:00|2|gres/gpu=4\n"
        f"100|tron|COMPLETED|0:0|{_at(2):%Y-%m-%dT%H:%M:%S}|{_at(3):%Y-%m-%dT%H:%M:%S}|"
        f"{_at(9):%Y-%m-%dT%H:%M:%S}|00:06:00|2|gres/gpu=4\n")
    att, _ = build_attempts(it, None, None, ev, sacct, gpus=4, train_iters=30)
    assert interruptions(att)["cause"].tolist() == [cause]
