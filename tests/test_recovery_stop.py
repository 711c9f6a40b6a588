"""Who stopped the run (recovery/stop.py): the decision rule with a fake runner at the subprocess boundary.

The controller answers below are what ``scontrol -o show job`` and ``sacct -X`` printed on the
local Slurm 22.05 cluster during each kind of stop (see recovery/stop.py's table).
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from fake_slurm import FakeSlurm
from recovery import stop as st

T0 = st.slurm_time("2026-12-01T00:08:06")  # the moment of the stop in the answers below


def slurm(state: str, reason: str = "None", restarts: int = 0, preempt: str = "None",
          end: str = "2026-12-01T00:37:58", accounting: str | None = "RUNNING", **kw) -> FakeSlurm:
    """The job as Slurm answered on the test cluster (scontrol words and the sacct state)."""
    return FakeSlurm(job_id="8100", state=state, accounting=accounting, **kw,
                     fields=f"Reason={reason} Requeue=1 Restarts={restarts} TimeLimit=00:30:00 "
                            f"StartTime=2026-12-01T00:07:58 EndTime={end} PreemptTime={preempt} SuspendTime=None")


def judge(runner, signum: int, *, restart: int = 0, lead: float = 30.0, received: float | None = T0,
          requested: bool = False, env=None) -> st.StopDecision:
    j = st.Judge(env if env is not None else {"SLURM_JOB_ID": "8100"}, restart_count=restart, lead_s=lead,
                 received_at=lambda: received, runner=runner, clock=lambda: T0 + 1)
    j.begin(signum, requested)
    return j.decide(signum, requested)


def test_scancel_is_a_user_cancel_and_is_not_requeued():
    r = slurm("COMPLETING", end="2026-12-01T00:08:06", accounting="CANCELLED by 0")
    d = judge(r, signal.SIGTERM)
    assert (d.reason, d.requeue) == ("user_cancel", False)
    assert "sacct CANCELLED" in d.evidence and "JobState=COMPLETING" in d.evidence
    assert [c[0] for c in r.calls] == ["scontrol", "sacct"] and "8100" in r.calls[0]


def test_cancel_without_accounting_from_the_controller_alone():
    r = slurm("COMPLETING", end="2026-12-01T00:08:06", accounting=None)
    d = judge(r, signal.SIGTERM)
    assert (d.reason, d.requeue) == ("user_cancel", False)
    assert "no accounting record" in d.evidence and "accounting storage is disabled" in d.evidence


def test_preemption_in_the_grace_time_is_requeued():
    r = slurm("RUNNING", preempt="2026-12-01T00:08:06", end="2026-12-01T00:08:36")
    d = judge(r, signal.SIGTERM)
    assert (d.reason, d.requeue) == ("preemption", True)
    assert "PreemptTime=2026-12-01T00:08:06" in d.evidence


def test_slurm_already_requeued_the_job():
    # after the grace time: the controller counts the restart while our tasks still run
    r = slurm("COMPLETING", restarts=1, end="Unknown", accounting="PREEMPTED")
    assert judge(r, signal.SIGTERM).reason == "preemption"
    # the same answer for an attempt that is itself a restart is not "already requeued"
    r = slurm("COMPLETING", restarts=1, accounting="NODE_FAIL")
    assert judge(r, signal.SIGTERM, restart=1) == st.StopDecision(
        "node_failure", True, judge(r, signal.SIGTERM, restart=1).evidence)


def test_time_limit_reached_without_the_warning_is_requeued():
    r = slurm("COMPLETING", reason="TimeLimit", end="2026-12-01T00:08:06", accounting="TIMEOUT")
    d = judge(r, signal.SIGTERM)
    assert (d.reason, d.requeue) == ("time_limit", True)


def test_a_sigterm_slurm_does_not_explain_is_not_requeued():
    # scancel --signal=TERM: the job runs on, no preemption, no cancel
    r = slurm("RUNNING")
    d = judge(r, signal.SIGTERM)
    assert (d.reason, d.requeue) == ("undecided", False)
    assert "nothing in Slurm's answer" in d.evidence


def test_no_answer_from_slurm_is_undecided_and_not_requeued():
    d = judge(FakeSlurm(missing=("scontrol", "sacct")), signal.SIGTERM)
    assert (d.reason, d.requeue) == ("undecided", False)
    assert "could not be asked" in d.evidence and "scontrol" in d.evidence


def test_usr2_far_from_the_end_is_a_user_requeue():
    r = slurm("RUNNING", end="2026-12-01T00:37:58")
    d = judge(r, signal.SIGUSR2, lead=30)
    assert (d.reason, d.requeue) == ("user_requeue", True)
    assert "1792 s before EndTime" in d.evidence


def test_usr2_within_the_lead_time_is_the_time_limit_warning():
    # Slurm's check runs about every 30 s: the warning for --signal=USR2@30 came 45 s before the end
    r = slurm("RUNNING", end="2026-12-01T00:08:51")
    d = judge(r, signal.SIGUSR2, lead=30)
    assert (d.reason, d.requeue) == ("time_limit", True)
    # the signal's time counts, not the query's: the same end time, signalled 2 minutes earlier
    d = judge(r, signal.SIGUSR2, lead=30, received=T0 - 120)
    assert d.reason == "user_requeue"


def test_usr2_with_no_end_time_still_requeues():
    d = judge(FakeSlurm(missing=("scontrol", "sacct")), signal.SIGUSR2)
    assert (d.reason, d.requeue) == ("requeue_signal", True)


def test_usr1_and_the_stop_file_stop_without_asking_slurm():
    r = slurm("RUNNING")
    assert judge(r, signal.SIGUSR1) == st.StopDecision("user_stop", False, judge(r, signal.SIGUSR1).evidence)
    d = judge(r, 0, requested=True)
    assert (d.reason, d.requeue) == ("user_stop", False)
    assert r.calls == []  # neither needs Slurm's word


def test_a_drain_request_wins_over_a_requeue():
    r = slurm("RUNNING", preempt="2026-12-01T00:08:06")
    d = judge(r, signal.SIGTERM, requested=True)
    assert (d.reason, d.requeue) == ("user_stop", False)
    assert "over SIGTERM: preemption" in d.evidence
    # ... and a cancel stays a cancel
    r = slurm("COMPLETING", accounting="CANCELLED by 0")
    assert judge(r, signal.SIGTERM, requested=True).reason == "user_cancel"


def test_outside_slurm_the_local_launcher_decides():
    d = judge(FakeSlurm(missing=("scontrol", "sacct")), signal.SIGTERM, env={})
    assert (d.reason, d.requeue) == ("local_signal", True)


def test_stop_file_lifecycle(tmp_path: Path):
    path = tmp_path / "stop.json"
    poll = st.poller(path)
    assert not poll(5) and st.start_refusal(path, 5, "1") is None
    st.request_stop(path, at_step=8, clock=lambda: 100.0, by="alice@login1")
    assert [poll(s) for s in (5, 7, 8, 9)] == [False, False, True, True]
    # a requeued attempt that would resume from step 10 honours it at start, and says so
    reason, detail = st.start_refusal(path, 10, "77")
    assert reason == "user_stop" and "alice@login1" in detail and "step 10" in detail
    doc = json.loads(path.read_text())
    assert doc["state"] == "stopped" and doc["step"] == 10 and doc["job_id"] == "77" and doc["at_step"] == 8
    assert not poll(11)  # stopped is not a pending request
    reason, detail = st.start_refusal(path, 10, "77")  # a later continuation refuses too
    assert reason == "user_stop" and "resubmit" in detail


def test_parse_scontrol_and_slurm_time():
    f = st.parse_scontrol(slurm("RUNNING", preempt="2026-12-01T00:08:06")(["scontrol", "-o", "show", "job", "8100"]).stdout)
    assert f["JobState"] == "RUNNING" and f["PreemptTime"] == "2026-12-01T00:08:06"
    v = st.SlurmView(fields=f, accounting="RUNNING")
    assert v.preempt_time == "2026-12-01T00:08:06" and v.restarts == 0
    assert st.slurm_time("Unknown") is None and st.slurm_time("2026-12-01T00:08:06") == T0


@pytest.mark.parametrize("argv,msg", [
    ([], "which run?"),
    (["run.name=x", "at_step=0"], "at_step"),
    (["run.name=x", "at_step=ten"], "at_step"),
])
def test_stop_command_refuses_bad_input(argv, msg, capsys):
    from launch import stop

    assert stop.main(argv) == stop.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("refused:") and msg in err and "Traceback" not in err


def test_stop_command_writes_the_request(tmp_path: Path, capsys):
    from launch import stop

    run_dir = tmp_path / "r"
    assert stop.main([str(run_dir)]) == stop.EXIT_BAD_INPUT  # no such run
    assert not (run_dir / "stop.json").exists()
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    assert stop.main([str(run_dir), "at_step=12"]) == 0
    doc = json.loads((run_dir / "stop.json").read_text())
    assert doc["state"] == "requested" and doc["at_step"] == 12
    assert "once step 12 is done" in capsys.readouterr().out


def test_stop_command_finds_the_run_from_the_pretrain_overrides(tmp_path: Path):
    from launch import stop

    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("{}\n")
    assert stop.main([f"cluster.run_root={tmp_path / 'runs'}", "run.name=demo"]) == 0
    assert json.loads((run_dir / "stop.json").read_text())["state"] == "requested"


@pytest.mark.parametrize("config", ["dir", "a: [\n", "- 1\n", "garbage: \x00\n", "\xff\xfe"])
def test_stop_command_writes_nothing_into_a_directory_whose_config_cannot_be_read(tmp_path: Path, capsys, config):
    from launch import stop

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    if config == "dir":
        (run_dir / "config.yaml").mkdir()
    else:
        (run_dir / "config.yaml").write_text(config)
    before = sorted(p.name for p in run_dir.iterdir())
    assert stop.main([str(run_dir)]) == stop.EXIT_BAD_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"refused: {run_dir / 'config.yaml'} cannot be read as a run's config (")
    assert sorted(p.name for p in run_dir.iterdir()) == before and not (run_dir / "stop.json").exists()
