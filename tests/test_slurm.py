"""recovery.slurm: the one Slurm interface (runner, replies, queue check), with ``FakeSlurm`` at the boundary."""
from __future__ import annotations

from fake_slurm import FakeSlurm

from recovery.slurm import Slurm, default_runner


def test_default_runner_survives_the_sigterm_a_requeue_sends():
    # Slurm SIGTERMs the scontrol that asked for the requeue; the child ignores it and reports its real status
    proc = default_runner(["bash", "-c", "kill -TERM $$; echo alive"])
    assert (proc.returncode, proc.stdout.strip()) == (0, "alive")


def test_a_command_that_cannot_run_is_a_reply_not_an_exception():
    r = Slurm(FakeSlurm(missing={"scontrol"})).requeue("5")
    assert (r.ok, r.rc) == (False, 127) and "scontrol could not run" in r.words


def test_requeue_update_and_queries_use_the_one_runner():
    fake = FakeSlurm(job_id="5", sinfo=[("stn1", "idle", "none")])
    slurm = Slurm(fake)
    assert slurm.hostnames("stn[1-3]") == ["stn1", "stn2", "stn3"]
    assert slurm.hostnames("a,b") == ["a", "b"] and slurm.hostnames("(null)") == []
    assert not slurm.update_excluded("5", ["stn2"]).ok  # a running job: Slurm refuses
    assert slurm.requeue("5").ok and slurm.update_excluded("5", ["stn2", "stn3"]).ok
    assert fake.exc == "stn2,stn3"
    assert "stn1|idle" in slurm.node_states(["stn1"]).out
    assert [c[:2] for c in fake.calls] == [["scontrol", "show"], ["scontrol", "update"], ["scontrol", "requeue"],
                                          ["scontrol", "update"], ["sinfo", "-h"]]


def test_in_queue_until_squeue_stops_listing_the_job_and_true_when_it_cannot_tell():
    left = []
    fake = FakeSlurm(queue_polls=2, on_leave=lambda: left.append(1))
    slurm = Slurm(fake)
    assert [slurm.in_queue("77") for _ in range(3)] == [True, True, False] and left == [1]
    assert Slurm(FakeSlurm(missing={"squeue"})).in_queue("77")
    assert Slurm(FakeSlurm(fail={"squeue"}, fail_words="slurm_load_jobs error: Socket timed out")).in_queue("77")
    assert not Slurm(FakeSlurm(fail={"squeue"}, fail_words="slurm_load_jobs error: Invalid job id specified")
                     ).in_queue("77")


def test_sbatch_answers_parsable_ids_in_order():
    fake = FakeSlurm(job_id="4242")
    slurm = Slurm(fake)
    assert slurm.sbatch("s.sh", "--parsable").out.strip() == "4242"
    assert slurm.sbatch("s.sh", "--parsable", "--dependency=afterany:4242").out.strip() == "4243"
    assert fake.called("sbatch", "--parsable", "--dependency=afterany:4242") == [
        ["sbatch", "--parsable", "--dependency=afterany:4242", "s.sh"]]


def test_squeue_and_sacct_name_the_jobs_and_a_missing_program_is_told_apart():
    fake = FakeSlurm(job_id="5", attempts=[("COMPLETED", "stn1", "2026-01-01T00:00:00", "2026-01-01T01:00:00")])
    slurm = Slurm(fake)
    assert slurm.squeue(["5", "6"], "%i|%T").ok
    assert slurm.sacct(["5"], "-D", "-X").out.startswith("5|COMPLETED")
    assert fake.calls == [["squeue", "-h", "-j", "5,6", "-o", "%i|%T"], ["sacct", "-D", "-X", "-j", "5"]]
    gone = Slurm(FakeSlurm(missing={"sacct"})).sacct(["5"])
    assert isinstance(gone.error, FileNotFoundError) and not gone.ok
