"""Bad-node exclusion for the next attempt of a requeued job, with Slurm faked at the subprocess boundary.

``tests/fake_slurm.py::FakeSlurm`` answers the commands ``recovery/exclusion.py`` runs and keeps the
rules seen on Slurm 22.05 (see the module docstring): ExcNodeList of a running job cannot be
updated, a requeued one can, and ``ExcNodeList=`` replaces the list.
"""
from __future__ import annotations

import pytest
from fake_slurm import FakeSlurm

from recovery import exclusion, policy
from recovery.events import read_events


NODE_FAIL_ATTEMPT = ("NODE_FAIL", "stn[1-2]", "2026-11-29T10:13:30", "2026-11-29T10:13:33")
RUNNING_ATTEMPT = ("RUNNING", "stn[1-2]", "2026-11-29T10:13:44", "Unknown")


def slurm_env(restart=1, nodelist="stn[1-2]"):
    return {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_NODELIST": nodelist}


def test_requeue_comes_before_the_update_and_keeps_the_old_exclusions():
    fake = FakeSlurm(exc="stn9")
    res = exclusion.requeue_excluding("77", ["stn2"], fake)
    assert res.ok, res.detail
    verbs = [c[1] for c in fake.calls if c[0] == "scontrol" and c[1] in ("requeue", "update")]
    assert verbs == ["requeue", "update"]
    assert fake.exc == "stn9,stn2"
    assert res.excluded == ["stn9", "stn2"]


def test_updating_a_running_job_is_refused_with_slurms_words():
    res = exclusion.set_excluded("77", ["stn2"], FakeSlurm())
    assert not res.ok and "no longer pending" in res.detail


def test_a_failed_requeue_is_reported_and_nothing_is_updated():
    fake = FakeSlurm(fail={"scontrol requeue"})
    res = exclusion.requeue_excluding("77", ["stn2"], fake)
    assert not res.ok and "requeue" in res.detail
    assert not any(c[:2] == ["scontrol", "update"] for c in fake.calls)


def test_node_fail_culprit_comes_from_the_event_table_not_the_whole_node_list(tmp_path):
    fake = FakeSlurm(attempts=[NODE_FAIL_ATTEMPT, RUNNING_ATTEMPT],
                     events=[("stn2", "2026-11-29T10:13:33", "DOWN", "ECC errors"),
                             ("stn1", "2026-11-28T09:00:00", "DOWN", "last week")])
    new, unknown = exclusion.learn_failed_nodes(tmp_path, "77", fake, clock=lambda: 5.0)
    assert new == ["stn2"] and unknown == []
    recorded = policy.failed_nodes(tmp_path)
    assert [(r["host"], r["job_id"]) for r in recorded] == [("stn2", "77")]
    assert "ECC errors" in recorded[0]["reason"]
    # learning again records nothing twice
    assert exclusion.learn_failed_nodes(tmp_path, "77", fake)[0] == []
    assert len(policy.failed_nodes(tmp_path)) == 1


def test_without_events_sinfo_names_the_down_node_and_otherwise_nothing_is_guessed(tmp_path):
    fake = FakeSlurm(attempts=[NODE_FAIL_ATTEMPT], sinfo=[("stn1", "mixed", "none"), ("stn2", "down*", "dead")])
    assert exclusion.learn_failed_nodes(tmp_path, "77", fake)[0] == ["stn2"]
    healthy = FakeSlurm(attempts=[NODE_FAIL_ATTEMPT], sinfo=[("stn1", "mixed", "none"), ("stn2", "idle", "none")])
    new, unknown = exclusion.learn_failed_nodes(tmp_path / "other", "77", healthy)
    assert new == [] and "NODE_FAIL" in unknown[0]  # healthy-looking nodes are not excluded


def test_start_on_a_recorded_failed_node_requeues_excluding_it(tmp_path):
    fake = FakeSlurm(attempts=[NODE_FAIL_ATTEMPT, RUNNING_ATTEMPT],
                     events=[("stn2", "2026-11-29T10:13:33", "DOWN", "ECC")])
    events = []
    res = exclusion.start_check(tmp_path, slurm_env(), fake, emit=lambda e, **f: events.append((e, f)))
    assert res.action == "requeue" and res.learned == ["stn2"] and res.bad_here == ["stn2"]
    assert fake.exc == "stn2"
    assert [e for e, _ in events] == ["failed_node", "exclude"]


def test_start_elsewhere_trains_and_still_records_what_it_learned(tmp_path):
    fake = FakeSlurm(attempts=[NODE_FAIL_ATTEMPT], events=[("stn2", "2026-11-29T10:13:33", "DOWN", "ECC")])
    res = exclusion.start_check(tmp_path, slurm_env(nodelist="stn[3-4]"), fake)
    assert res.action == "train" and res.learned == ["stn2"] and res.bad_here == []
    assert exclusion.recorded_hosts(tmp_path) == ["stn2"]
    assert not any(c[:2] == ["scontrol", "requeue"] for c in fake.calls)


def test_a_first_attempt_does_not_ask_sacct_but_honours_recorded_nodes(tmp_path):
    policy.record_failed_node(tmp_path, "stn1", "ECC", job_id="70")
    fake = FakeSlurm()
    res = exclusion.start_check(tmp_path, slurm_env(restart=0), fake)
    assert res.action == "requeue" and res.bad_here == ["stn1"]
    assert not any(c[0] in ("sacct", "sacctmgr") for c in fake.calls)


def test_no_requeue_sites_train_anyway_and_outside_slurm_nothing_happens(tmp_path):
    policy.record_failed_node(tmp_path, "stn1", "ECC", job_id="70")
    fake = FakeSlurm()
    res = exclusion.start_check(tmp_path, slurm_env(restart=0), fake, requeue_allowed=False)
    assert res.action == "train" and res.bad_here == ["stn1"] and "requeue_allowed" in res.detail
    assert exclusion.start_check(tmp_path, {}, fake).detail == "not under Slurm"


def test_cli_exits_42_when_it_requeued_and_logs_the_event(tmp_path, capsys):
    policy.record_failed_node(tmp_path, "stn2", "ECC", job_id="70")
    code = exclusion.main(["start", str(tmp_path)], env=slurm_env(restart=0), runner=FakeSlurm())
    assert code == exclusion.EXIT_REQUEUED
    assert "requeue" in capsys.readouterr().out
    assert [e["event"] for e in read_events(tmp_path / "events.jsonl")] == ["exclude"]
    assert exclusion.main(["bogus"], env={}, runner=FakeSlurm()) == 2


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "uncorrectable ECC error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "GPU Xid error"),
    ("ValueError: global_batch_size is not a multiple", None),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", None),  # a kernel bug, not the node
])
def test_hardware_faults_are_told_from_code_bugs(text, reason):
    assert exclusion.hardware_fault(text) == reason
