"""Hostile input on the recovery side: the crash judgement on a missing run directory, a torn event line.
(The fake Slurm stands at the subprocess boundary.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

from recovery import policy
from recovery.crash import main as crash_main, requeue_after_crash
from recovery.events import EventLog, read_events, read_events_counted


def _env(restart: int) -> dict:
    return {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart)}


# ---- the crash judgement ------------------------------------------------------------------------

@pytest.mark.parametrize("restart", [0, 3, 50])
def test_a_missing_run_directory_is_refused_for_good_and_never_created(tmp_path: Path, restart: int, capsys) -> None:
    run_dir = tmp_path / "mnt" / "runs" / "gone"
    fake = FakeSlurm()
    code = crash_main([str(run_dir)], env=_env(restart), runner=fake)
    out = capsys.readouterr().out.strip().splitlines()
    assert code == policy.EXIT_STORAGE and code in policy.FINAL_CODES and code != policy.EXIT_REQUEUE
    assert fake.calls == [] and not (tmp_path / "mnt").exists()  # nothing asked of Slurm, nothing created
    assert len(out) == 1 and "does not exist" in out[0] and "not requeued" in out[0]


def test_a_run_directory_that_is_a_file_or_unreadable_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    fake = FakeSlurm()
    assert requeue_after_crash(f, _env(1), fake)[0] == policy.EXIT_STORAGE
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "events.jsonl").mkdir()  # an event log that cannot be read as a file
    code, why = requeue_after_crash(locked, _env(1), fake)
    assert code == policy.EXIT_STORAGE and "cannot be read" in why and fake.calls == []


def _config(run_dir: Path, max_restarts: int) -> None:
    (run_dir / "config.yaml").write_text(f"training:\n  max_restarts: {max_restarts}\nrun:\n  name: r\n")


def test_requeues_stop_at_the_restart_limit_even_without_an_event_log(tmp_path: Path) -> None:
    """Attempts that die before writing any event (no events.jsonl at all) are requeued up to
    training.max_restarts, read from Slurm's restart count, and no further."""
    _config(tmp_path, 3)
    codes = []
    for restart in range(6):
        fake = FakeSlurm()
        code, why = requeue_after_crash(tmp_path, _env(restart), fake)
        codes.append(code)
        if code == policy.EXIT_REQUEUE:
            assert fake.calls == [["scontrol", "requeue", "77"]]
        else:
            assert fake.calls == [] and "training.max_restarts 3" in why
    assert codes == [42, 42, 42, 0, 0, 0]


def test_without_a_readable_config_the_default_restart_limit_applies(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_bytes(b"\x00\xff binary")
    assert requeue_after_crash(tmp_path, _env(19), FakeSlurm())[0] == policy.EXIT_REQUEUE
    code, why = requeue_after_crash(tmp_path, _env(20), FakeSlurm())
    assert code == 0 and "max_restarts 20" in why


# ---- a torn event line ----------------------------------------------------------------------------

def test_a_torn_last_line_does_not_swallow_the_next_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, job_id="1", clock=lambda: 1.0, host="n")
    log.emit("job_start", world_size=1)
    with open(path, "a") as f:  # a rank killed mid-write
        f.write('{"time": 2.0, "event": "checkpoint_sa')
    EventLog(path, job_id="1", restart_count=1, clock=lambda: 3.0, host="n").emit("job_start", world_size=1)
    events, torn = read_events_counted(path)
    assert [(e["event"], e["restart_count"]) for e in events] == [("job_start", 0), ("job_start", 1)]
    assert torn == 1
    assert path.read_bytes().endswith(b"\n") and path.read_text().count("\n") == 3


def test_writer_does_not_add_blank_lines_to_an_intact_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, clock=lambda: 1.0, host="n")
    for i in range(3):
        log.emit("iteration", step=i)
    assert path.read_text().count("\n") == 3 and read_events_counted(path) == (read_events(path), 0)


def test_status_reports_torn_lines_and_counts_every_attempt(tmp_path: Path) -> None:
    from launch.compose import compose_job, job_to_yaml
    from launch.run_state import gather

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    job = compose_job(["cluster=local", "model=tiny", "run.name=r"])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    path = run_dir / "events.jsonl"
    EventLog(path, clock=lambda: 1.0, host="n").emit("job_start", world_size=1)
    with open(path, "a") as f:
        f.write('{"time": 2.0, "event": "iter')
    EventLog(path, restart_count=1, clock=lambda: 3.0, host="n").emit("job_start", world_size=1)
    state = gather(run_dir, alive=lambda *a, **k: False)
    assert any("1 torn or unreadable line" in w for w in state.warnings), state.warnings
    assert len([e for e in read_events(path) if e["event"] == "job_start"]) == 2


def test_the_analysis_reader_skips_and_counts_a_torn_line(tmp_path: Path) -> None:
    from analysis.parse_events import parse_events_file

    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"time": 1.0, "event": "job_start"}) + "\n" + '{"time": 2.0, "ev')
    EventLog(path, clock=lambda: 3.0, host="n").emit("exit", reason="completed")
    df, skipped = parse_events_file(path)
    assert list(df["event"]) == ["job_start", "exit"] and skipped == 1


# ---- the rank side: one line, a final code, never a traceback ------------------------------------

def _worker(run_dir: Path, tmp_path: Path) -> tuple[int, list[str]]:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update({"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RANK": "0", "WORLD_SIZE": "1",
                "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "SLURM_JOB_ID": "55"})
    p = subprocess.run([sys.executable, "-m", "train.worker", str(run_dir)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    return p.returncode, [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]


@pytest.mark.parametrize("content", [None, b"\x00\xff\xfe binary \x80" * 8, b"model: [\n  oops",
                                     b"model:\n  num_layers: lots\n", b"- just\n- a list\n"])
def test_worker_on_a_missing_run_directory_or_a_hostile_config_says_one_line(tmp_path: Path, content) -> None:
    run_dir = tmp_path / "run"
    if content is not None:
        run_dir.mkdir()
        (run_dir / "config.yaml").write_bytes(content)
    code, lines = _worker(run_dir, tmp_path)
    assert not any("Traceback" in ln for ln in lines), lines
    refusals = [ln for ln in lines if ln.startswith("slurmtron: refused to start:")]
    assert len(refusals) == 1, lines
    if content is None:
        assert code == policy.EXIT_STORAGE and "does not exist" in refusals[0]
        assert not run_dir.exists()
    else:
        assert code == policy.EXIT_BAD_CONFIG == policy.FINAL_REASONS["bad_config"]
        assert "config.yaml cannot be read back into a job" in refusals[0]
        stop = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "stop"]
        assert [s["reason"] for s in stop] == ["bad_config"]  # the crash requeue sees a final stop
        fake = FakeSlurm()
        code2, why = requeue_after_crash(run_dir, {"SLURM_JOB_ID": "55", "SLURM_RESTART_COUNT": "0"}, fake)
        assert code2 == 0 and fake.calls == [] and "bad_config" in why


@pytest.mark.parametrize("content", [b"\x00\x01\xff\xfe\x80garbage", b"", b"{\"host\": 1", b"[1, 2]"])
def test_a_garbage_run_lock_says_how_to_clear_it(tmp_path: Path, content: bytes) -> None:
    import io

    from launch.local import locked_line
    from recovery import lock

    path = tmp_path / "run.lock"
    path.write_bytes(content)
    with pytest.raises(lock.RunLocked) as e:
        lock.acquire(path, lock.me_from_env({}))
    text = str(e.value)
    assert "holds no readable lock record" in text and f"rm {path}" in text and "pid 0" not in text
    line = locked_line(e.value, tmp_path)
    assert line.count("\n") == 0 and "rm " in line and "being trained right now" not in line
    holder, _why = lock.active_holder(path)
    assert "pid 0" not in holder.describe() and "remove it" in holder.describe()
    assert path.read_bytes() == content  # left for the user to look at


@pytest.mark.parametrize("content", [b"\x00\xff\xfe\x80 binary", b"{not json", b"[1]", None])
def test_a_stop_file_that_is_no_record_refuses_the_local_launch_before_the_lock(tmp_path: Path, content) -> None:
    import io

    from hydra import compose, initialize_config_dir

    from launch import pretrain
    from launch.compose import CONFIG_DIR, compose_job, job_to_yaml
    from launch.config import register_configs

    run_dir = tmp_path / "runs" / "t"
    cfg = ["cluster=local", "model=tiny", "run.name=t", f"cluster.run_root={tmp_path / 'runs'}"]
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(job_to_yaml(compose_job(cfg)) + "# the earlier attempt's copy\n")
    (run_dir / "events.jsonl").write_text('{"event": "job_start", "rank": 0}\n')
    if content is None:
        (run_dir / "stop.json").mkdir()
    else:
        (run_dir / "stop.json").write_bytes(content)
    before = {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None)
              for p in sorted(run_dir.rglob("*"))}
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=cfg)
    err = io.StringIO()
    rc = pretrain.main(composed, out=io.StringIO(), err=err)
    after = {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None)
             for p in sorted(run_dir.rglob("*"))}
    assert after == before  # no run.lock taken, config.yaml not rewritten, nothing cleared
    assert rc == pretrain.EXIT_REFUSED and "Traceback" not in err.getvalue()
    assert "stop file is not a stop record" in err.getvalue() and "stop.json" in err.getvalue()


def test_status_of_a_local_run_with_a_garbage_lock_is_not_running(tmp_path: Path) -> None:
    from launch.compose import compose_job, job_to_yaml
    from launch.run_state import gather

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(job_to_yaml(compose_job(["cluster=local", "model=tiny", "run.name=r"])))
    (run_dir / "run.lock").write_bytes(b"\x00\xff garbage")
    state = gather(run_dir, alive=lambda *a, **k: True)
    assert state.state == "unknown" and "rm " in state.reason and "pid 0" not in state.reason
