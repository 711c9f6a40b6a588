"""In-job restart (recovery/injob.py): the decisions after a failed step, with the one fake Slurm; the rendered
script (golden file, --no-kill, node counts); the check and the dry-run line; the simulator's two paths."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fake_slurm import FakeSlurm
from launch.check import check
from launch.compose import compose_job
from launch.planner.simulate import Recovery, Scenario, compare_recovery, simulate_recovery, spares_per_thousand
from launch.render import render
from launch.spares import in_job_enabled, summary_text
from recovery import injob, policy
from recovery.events import EventLog, read_events

GOLDEN = Path(__file__).parent / "golden" / "sbatch_slurm_local_spares.sh"
ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "stn[1-3]", "SLURM_RESTART_COUNT": "0"}
HEALTHY = {"stn1": "ok", "stn2": "ok", "stn3": "ok"}


def crashed_step(run_dir: Path, restart: int = 0, *, reason: str = "crash", exit_reason: str = "error",
                 t0: float = 1000.0) -> None:
    """One step's record: start, two steps, then a crash (or the stop/exit given)."""
    log = EventLog(run_dir / "events.jsonl", job_id="77", restart_count=restart, clock=iter(
        [t0, t0 + 1, t0 + 2, t0 + 5, t0 + 5.5]).__next__)
    log.emit("job_start", step=0)
    log.emit("iteration", step=1, loss=1.0)
    log.emit("iteration", step=2, loss=0.9)
    log.emit("stop", reason=reason, detail="RuntimeError: boom")
    log.emit("exit", reason=exit_reason, code=1)


def decide(run_dir: Path, slurm: FakeSlurm, *, nodes=("stn1", "stn2"), budget: int = 3, env=None, **kw):
    return injob.decide(run_dir, env or ENV, rc=143, step_nodes=list(nodes), budget=budget, runner=slurm,
                        clock=lambda: 1010.0, resolve=lambda h: "127.0.0.1", **kw)


def test_a_crash_is_relaunched_on_the_same_nodes_and_recorded(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(health=HEALTHY)
    d = decide(tmp_path, slurm)
    assert (d.action, d.nodes, d.master_addr) == ("relaunch", ["stn1", "stn2"], "127.0.0.1"), d.why
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "in_job_restart"]
    assert len(ev) == 1 and ev[0]["cause"] == "crash" and ev[0]["spare_used"] == [] and ev[0]["restart_count"] == 0
    assert ev[0]["phases"] == {"detection_s": 3.0, "teardown_s": 5.0, "queue_wait_s": 0.0, "health_check_s": 0.0}
    assert ev[0]["next_restart_count"] == 1 and ev[0]["used"] == 1
    assert injob.offset(tmp_path, "77") == 1
    assert not slurm.called("scontrol", "requeue")
    assert slurm.called("srun"), "the candidates must be health-checked"


def test_a_lost_node_is_replaced_by_the_spare_and_never_used_again(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(sinfo=[("stn1", "allocated", "none"), ("stn2", "down*", "Not responding"),
                             ("stn3", "allocated", "none")], health=HEALTHY)
    d = decide(tmp_path, slurm)
    assert d.action == "relaunch" and d.nodes == ["stn1", "stn3"], d.why
    assert d.event["cause"] == "lost_node" and d.event["spare_used"] == ["stn3"] and "stn2" in d.event["avoided"]
    assert [n["host"] for n in policy.failed_nodes(tmp_path)] == ["stn2"]
    assert all("stn2" not in c[1] for c in slurm.called("srun")), "a node Slurm reports down is not probed"
    # the next failure on the new nodes: stn2 stays out (recorded), and no spare is left
    crashed_step(tmp_path, restart=1, t0=2000.0)
    again = decide(tmp_path, FakeSlurm(health=HEALTHY), nodes=d.nodes, env={**ENV, policy.IN_JOB_OFFSET: "1"})
    assert again.action == "relaunch" and again.nodes == ["stn1", "stn3"], again.why


def test_a_node_failing_the_health_check_is_avoided(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(health={"stn1": "ok", "stn2": "bad run directory /r not writable (Read-only file system)",
                              "stn3": "ok"})
    d = decide(tmp_path, slurm)
    assert d.nodes == ["stn1", "stn3"] and "not writable" in d.event["avoided"]["stn2"], d.why
    assert [n["host"] for n in policy.failed_nodes(tmp_path)] == ["stn2"]


def test_a_node_that_does_not_answer_the_health_check_is_avoided(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    d = decide(tmp_path, FakeSlurm(health={"stn1": "ok", "stn3": "ok"}))
    assert d.nodes == ["stn1", "stn3"] and "stn2" in d.event["avoided"], d.why


def hung_step(run_dir: Path, suspect: str) -> None:
    crashed_step(run_dir, reason="hang", exit_reason="hang")
    hang = run_dir / "hangs" / "77_0"
    hang.mkdir(parents=True)
    (hang / "summary.json").write_text(json.dumps({"suspects": [{"rank": 2, "host": suspect, "why": "state T"}]}))


def test_hang_suspects_are_excluded_when_a_spare_allows(tmp_path: Path) -> None:
    hung_step(tmp_path, "stn2")
    d = decide(tmp_path, FakeSlurm(health=HEALTHY))
    assert d.event["cause"] == "hang" and d.nodes == ["stn1", "stn3"] and d.event["spare_used"] == ["stn3"], d.why
    assert policy.failed_nodes(tmp_path) == [], "a suspect is avoided, not recorded as failed (the watchdog does that)"


def test_hang_suspects_are_kept_without_a_spare(tmp_path: Path) -> None:
    hung_step(tmp_path, "stn2")
    d = decide(tmp_path, FakeSlurm(health={"stn1": "ok", "stn2": "ok", "stn3": "bad 0.01 GiB free"}))
    assert d.nodes == ["stn1", "stn2"] and d.event["suspects_kept"] == ["stn2"], d.why


def test_not_enough_healthy_nodes_takes_the_requeue_path_excluding_the_failed(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(sinfo=[("stn2", "down*", "Not responding")], health={"stn1": "ok", "stn3": "bad no GPUs"})
    d = decide(tmp_path, slurm)
    assert d.action == "requeue" and d.code == policy.EXIT_REQUEUE, d.why
    assert "not enough healthy nodes" in d.why
    assert slurm.called("scontrol", "requeue", "77")
    assert slurm.called("scontrol", "update", "JobId=77", "ExcNodeList=stn2,stn3")
    requeue = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "requeue"]
    assert requeue and requeue[-1]["exclude"] == ["stn2", "stn3"]
    assert not [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "in_job_restart"]


def test_a_step_that_never_started_is_not_relaunched_on_the_same_nodes(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text("")
    slurm = FakeSlurm(health=HEALTHY)
    d = decide(tmp_path, slurm)
    assert d.action == "requeue" and "wrote no event and no node changed" in d.why, d.why
    assert slurm.called("scontrol", "requeue", "77")


def test_a_spent_budget_takes_the_requeue_path(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    first = decide(tmp_path, FakeSlurm(health=HEALTHY), budget=1)
    assert first.action == "relaunch"
    crashed_step(tmp_path, restart=1, t0=2000.0)
    slurm = FakeSlurm(health=HEALTHY)
    d = decide(tmp_path, slurm, budget=1, env={**ENV, policy.IN_JOB_OFFSET: "1"})
    assert d.action == "requeue" and "budget is spent (1 of cluster.in_job_restarts 1" in d.why, d.why
    assert slurm.called("scontrol", "requeue", "77") and not slurm.called("srun")


def test_a_requeued_allocation_has_its_budget_again_and_counts_on(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    decide(tmp_path, FakeSlurm(health=HEALTHY), budget=1)
    env = {**ENV, "SLURM_RESTART_COUNT": "1", policy.IN_JOB_OFFSET: str(injob.offset(tmp_path, "77"))}
    assert policy.restart_count_from_env(env) == 2 and policy.slurm_restart_count(env) == 1
    crashed_step(tmp_path, restart=2, t0=3000.0)
    d = decide(tmp_path, FakeSlurm(health=HEALTHY), budget=1, env=env)
    assert d.action == "relaunch" and d.event["slurm_restart"] == 1 and d.event["next_restart_count"] == 3, d.why


@pytest.mark.parametrize("reason", ["zero_progress", "max_restarts", "storage_error", "checkpoint_mismatch"])
def test_a_final_reason_stays_final(tmp_path: Path, reason: str) -> None:
    crashed_step(tmp_path, reason=reason, exit_reason=reason)
    slurm = FakeSlurm(health=HEALTHY)
    d = decide(tmp_path, slurm)
    assert d.action == "stop" and reason in d.why
    assert not slurm.called("srun") and not slurm.called("scontrol", "requeue")
    assert not [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "in_job_restart"]


def test_a_refusal_code_and_the_restart_limit_stop(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(health=HEALTHY)
    assert injob.decide(tmp_path, ENV, rc=policy.EXIT_RUN_LOCKED, step_nodes=["stn1", "stn2"], budget=3,
                        runner=slurm).action == "stop"
    (tmp_path / "config.yaml").write_text("training:\n  max_restarts: 1\n")
    crashed_step(tmp_path, restart=1, t0=2000.0)
    d = decide(tmp_path, slurm, env={**ENV, policy.IN_JOB_OFFSET: "1"})
    assert d.action == "stop" and "max_restarts 1" in d.why, d.why
    assert not slurm.called("srun") and not slurm.called("scontrol", "requeue")


def test_no_requeue_allowed_stops_instead_of_requeueing(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    slurm = FakeSlurm(health=HEALTHY)
    d = decide(tmp_path, slurm, budget=0, requeue_allowed=False)
    assert d.action == "stop" and "requeue_allowed is false" in d.why and not slurm.called("scontrol", "requeue")


def test_the_first_step_avoids_recorded_and_down_nodes(tmp_path: Path) -> None:
    policy.record_failed_node(tmp_path, "stn1", "ECC", job_id="70")
    nodes, addr = injob.first(tmp_path, ENV, 2, FakeSlurm(), resolve=lambda h: "10.0.0.3")
    assert (nodes, addr) == (["stn2", "stn3"], "10.0.0.3")


def test_the_rendezvous_address_falls_back_to_slurms_node_addr() -> None:
    def unresolvable(host: str) -> str:
        raise OSError("no such host")

    assert injob.node_address("stn3", FakeSlurm(), unresolvable) == "127.0.0.1"


def test_probe_line_says_what_is_wrong(tmp_path: Path) -> None:
    env = {"SLURMD_NODENAME": "stn4"}
    assert injob.probe_line(tmp_path, env) == "stn4 ok"
    assert injob.probe_line(tmp_path, env, min_free=1 << 62).startswith("stn4 bad ")
    assert injob.probe_line(tmp_path, env, gpus=8, listdev=lambda: ["nvidia0", "nvidiactl"]) == \
        "stn4 bad 1 GPU devices visible < 8"
    assert "not writable" in injob.probe_line(tmp_path / "missing", env)


def test_the_cli_prints_the_next_nodes_and_address(tmp_path: Path) -> None:
    crashed_step(tmp_path)
    said: list[str] = []
    code = injob.main(["next", str(tmp_path), "--rc", "143", "--nodes", "stn1,stn2", "--budget", "3"], env=ENV,
                      runner=FakeSlurm(health=HEALTHY), out=said.append)
    assert code == injob.EXIT_RELAUNCH and said[0].split()[0] == "stn1,stn2"
    assert injob.main(["offset", str(tmp_path)], env=ENV, out=said.append) == 0 and said[-1] == "1"


def test_restart_count_adds_the_in_job_offset() -> None:
    assert policy.restart_count_from_env({"SLURM_RESTART_COUNT": "2", policy.IN_JOB_OFFSET: "3"}) == 5
    assert policy.slurm_restart_count({"SLURM_RESTART_COUNT": "2", policy.IN_JOB_OFFSET: "3"}) == 2
    with pytest.raises(ValueError, match=policy.IN_JOB_OFFSET):
        policy.restart_count_from_env({policy.IN_JOB_OFFSET: "x"})


# ---- config, check, render, summary --------------------------------------------------------------------

def spare_job(*more: str):
    return compose_job(["cluster=slurm_local", "model=tiny", "run.name=golden", "run.dir=/runs/golden",
                        "run.time_limit_min=10", "cluster.spare_nodes=1", *more])


def test_spares_render_no_kill_and_nodes_plus_spares_golden() -> None:
    job = spare_job()
    assert check(job) == [] and in_job_enabled(job)
    script = render(job, "/runs/golden", failed_nodes=[], code_dir="/opt/slurmtron")
    if os.environ.get("SLURMTRON_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text(), "rendered script differs from golden/sbatch_slurm_local_spares.sh"
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    assert '--nodelist="$STEP_NODES" --ntasks=4 --overlap --kill-on-bad-exit=1 --nodes=2 ' in script
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0


def test_no_spares_renders_todays_script() -> None:
    script = render(spare_job("cluster.spare_nodes=0"), "/runs/golden", failed_nodes=[], code_dir="/opt/slurmtron")
    assert "--no-kill" not in script and "recovery.injob" not in script and "#SBATCH --nodes=2\n" in script


def test_bad_spare_settings_are_one_problem_each() -> None:
    problems = check(spare_job("cluster.spare_nodes=-1", "cluster.in_job_restarts=-2"))
    fields = [p.field for p in problems]
    assert fields.count("cluster.spare_nodes") == 1 and fields.count("cluster.in_job_restarts") == 1
    local = check(compose_job(["cluster=local", "model=tiny", "cluster.spare_nodes=1"]))
    assert [p.field for p in local if p.field == "cluster.spare_nodes"] == ["cluster.spare_nodes"]


def test_the_summary_shows_the_spares_their_cost_and_saving() -> None:
    class Est:
        wall_time_h_total, step_time_s, checkpoint_interval, save_time_s = 100.0, 1.0, 600, 30.0

    job = compose_job(["cluster=slurm_local", "model=tiny", "cluster.spare_nodes=1", "cluster.nodes=64",
                       "cluster.node_mtbf_hours=5000"])
    text = summary_text(job, Est())
    assert text.startswith("1 spare node of 65 (--no-kill), 3 in-job restarts per allocation")
    assert "idle 2 processes x 100 h = 200 process-hours (+2%)" in text
    assert "save" in text and "(simulated)" in text
    assert summary_text(compose_job(["cluster=slurm_local", "model=tiny"]), Est()) is None


# ---- the simulator ----------------------------------------------------------------------------------------

SCENARIO = Scenario(work_h=500.0, nodes=1000, gpus_per_node=8, node_mtbf_h=5000.0, save_h=0.02, restart_h=0.2)


def test_in_job_without_a_budget_is_the_requeue_path_on_the_same_draws() -> None:
    a = simulate_recovery(SCENARIO, 0.5, Recovery("q", queue_wait_h=1.0, requeue_h=0.2), trials=200)
    b = simulate_recovery(SCENARIO, 0.5, Recovery("0", queue_wait_h=1.0, requeue_h=0.2, in_job_h=0.05, spares=4,
                                                  in_job_restarts=0), trials=200)
    assert a.wall_h_mean == b.wall_h_mean and b.in_job_mean == 0
    assert b.gpu_hours_mean == pytest.approx(a.gpu_hours_mean * 1004 / 1000)


def test_in_job_restart_beats_a_queue_wait_and_spares_raise_the_share_in_job() -> None:
    out = compare_recovery(SCENARIO, 0.5, queue_waits_min=(0, 60), spares_per_1000=(0, 4), in_job_restarts=1000,
                           trials=200)
    q0, q60, none, four = out
    assert q60.effective_mean < q0.effective_mean < four.effective_mean
    assert none.in_job_mean < four.in_job_mean and four.requeues_mean < none.requeues_mean
    assert spares_per_thousand(2048, 1) == 3 and spares_per_thousand(1000, 0) == 0


def test_status_shows_the_in_job_restarts_used_and_the_spares_left(tmp_path: Path) -> None:
    from launch.status import format_state
    from launch.run_state import RunState

    crashed_step(tmp_path)
    slurm = FakeSlurm(sinfo=[("stn2", "down*", "Not responding")], health=HEALTHY)
    decide(tmp_path, slurm)
    events = read_events(tmp_path / "events.jsonl")
    assert injob.standing(events, 0, 3) is None
    now = injob.standing(events, 1, 3)
    assert now == {"spares": 1, "budget": 3, "used": 1, "spares_left": 0, "total": 1}
    text = format_state(RunState(run="r", run_dir=str(tmp_path), in_job=now))
    assert "in-job     1 of 3 in-job restarts used in this allocation (1 in the run); spares left 0 of 1" in text
    EventLog(tmp_path / "events.jsonl", job_id="77", restart_count=1).emit("requeue", method="scontrol_after_crash")
    after = injob.standing(read_events(tmp_path / "events.jsonl"), 1, 3)
    assert (after["used"], after["spares_left"], after["total"]) == (0, 1, 1)
