"""Issue "never lose a checkpoint": the start decision, quarantine, prune, ownership, the run lock.

Real files in a temporary directory; the only fakes are at the process boundary (squeue runner,
the pid-liveness probe where a live foreign host is needed).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from recovery import crash, lock, policy
from recovery.commit import LATEST, abort_save, commit, final_path, prepare_staging, prune, staging_path
from recovery.quarantine import QUARANTINE_DIR, list_quarantine
from recovery.resume import committed_steps, explain, plan_resume, verify
from recovery.storage import LocalStorage, StorageError, classify

REPO = Path(__file__).resolve().parent.parent
ME = {"name": "runA", "id": "id-A", "model": {"num_layers": 2, "hidden_size": 64}}


def save(root: Path, step: int, keep: int = 3, run=ME) -> Path:
    d = prepare_staging(root, step)
    (d / "__0_0.distcp").write_bytes(f"step {step} ".encode() * 500)
    (d / "common.pt").write_bytes(b"common" + str(step).encode())
    return commit(root, step, {"step": step, "model": ME["model"]}, keep=keep, run=run).path


def flip(path: Path) -> None:
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def names(root: Path) -> list:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


# ---- case 1: every checkpoint fails verification -> refuse, never start over -----------------

def test_all_corrupt_refuses_with_a_listing_and_changes_nothing(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    flip(final_path(tmp_path, 10))
    flip(final_path(tmp_path, 20))
    plan = plan_resume(tmp_path, identity=ME, committed=[10, 20])
    assert plan.action == "refuse" and plan.reason == "no_loadable_checkpoint"
    assert "iter_0000020: checksum mismatch" in plan.detail and "iter_0000010: checksum mismatch" in plan.detail
    assert "restart_from_scratch=true" in plan.detail
    assert names(tmp_path) == ["iter_0000010", "iter_0000020"]  # nothing moved, nothing deleted
    assert policy.FINAL_REASONS["no_loadable_checkpoint"] == policy.EXIT_NO_LOADABLE
    assert policy.EXIT_NO_LOADABLE not in (policy.EXIT_CRASH, policy.EXIT_REQUEUE)


def test_restart_from_scratch_quarantines_everything_and_deletes_nothing(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    flip(final_path(tmp_path, 20))
    prepare_staging(tmp_path, 30)  # a torn save too
    plan = plan_resume(tmp_path, identity=ME, committed=[10, 20], restart_from_scratch=True)
    assert plan.action == "start" and plan.reason == "restart_from_scratch"
    assert names(tmp_path) == [QUARANTINE_DIR]
    moved = list_quarantine(tmp_path)
    assert sorted(n.split(".")[0] for n, _ in moved) == ["iter_0000010", "iter_0000020", "iter_0000030"]
    assert all(r == "training.restart_from_scratch=true" for _, r in moved)
    assert [n["event"] for n in plan.notices] == ["quarantine"] * 3
    # the quarantined checkpoints are intact and still verify where they are
    good = [n for n, _ in moved if n.startswith("iter_0000010.")][0]
    assert verify(tmp_path / QUARANTINE_DIR / good, deep=True) == "not a checkpoint directory name (iter_NNNNNNN)"
    assert (tmp_path / QUARANTINE_DIR / good / "manifest.json").is_file()


def test_a_lone_torn_first_save_starts_with_a_notice_but_not_after_a_commit(tmp_path):
    prepare_staging(tmp_path, 10)
    plan = plan_resume(tmp_path, identity=ME, committed=[])
    assert plan.action == "start" and [n["reason"] for n in plan.notices][-1] == "torn_first_save"
    plan = plan_resume(tmp_path, identity=ME, committed=[10])
    assert plan.action == "refuse" and plan.reason == "no_loadable_checkpoint"


def test_committed_steps_restart_after_a_start_over():
    events = [{"event": "checkpoint_saved", "step": 10}, {"event": "start_over"},
              {"event": "checkpoint_saved", "step": 5}]
    assert committed_steps(events) == [5]


def test_missing_checkpoint_directory_with_committed_history_is_an_environment_error(tmp_path):
    plan = plan_resume(tmp_path / "not-mounted", identity=ME, committed=[10, 20])
    assert plan.action == "refuse" and plan.reason == "storage_error" and "mounted" in plan.detail
    assert plan_resume(tmp_path / "fresh", identity=ME, committed=[]).action == "start"
    (tmp_path / "emptied").mkdir()
    plan = plan_resume(tmp_path / "emptied", identity=ME, committed=[10])
    assert plan.action == "refuse" and plan.reason == "storage_error"


# ---- case 2: cannot read != corrupt; corrupt is quarantined, never pruned ---------------------

def test_corrupt_newer_checkpoint_is_quarantined_on_resume_and_the_older_loaded(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    flip(final_path(tmp_path, 20))
    plan = plan_resume(tmp_path, identity=ME, committed=[10, 20])
    assert plan.action == "resume" and plan.step == 10
    events = [n["event"] for n in plan.notices]
    assert events == ["resume_fallback", "quarantine"]
    assert names(tmp_path) == ["iter_0000010", QUARANTINE_DIR]
    [(qname, reason)] = list_quarantine(tmp_path)
    assert qname.startswith("iter_0000020.") and "checksum mismatch" in reason
    # the next saves (same step again, then more) prune only older verified ones
    save(tmp_path, 20, keep=1)
    save(tmp_path, 30, keep=1)
    assert names(tmp_path) == ["iter_0000030", QUARANTINE_DIR]
    assert len(list_quarantine(tmp_path)) == 1


def test_prune_quarantines_a_damaged_checkpoint_instead_of_deleting_it(tmp_path):
    for s in (10, 20, 30):
        save(tmp_path, s, keep=5)
    (final_path(tmp_path, 20) / "common.pt").write_bytes(b"")  # damaged, older than the newest
    res = prune(tmp_path, keep=1)
    assert [p.name for p in res.removed] == ["iter_0000010"]
    assert [(a.name, "size mismatch" in r) for a, _b, r in res.quarantined] == [("iter_0000020", True)]
    assert names(tmp_path) == ["iter_0000030", QUARANTINE_DIR]


def test_prune_deletes_only_older_than_the_newest_verified(tmp_path):
    for s in (10, 20):
        save(tmp_path, s, keep=5)
    (tmp_path / LATEST).write_text("iter_0000010\n")
    flip(final_path(tmp_path, 20))  # deep damage the cheap check cannot see: 20 still counts as verified
    res = prune(tmp_path, keep=1)
    assert res.removed == [] and names(tmp_path) == ["iter_0000010", "iter_0000020"]  # latest protects 10


def test_storage_errors_are_classified():
    assert classify(OSError(errno.ENOSPC, "No space", "/x")).kind == "disk_full"
    assert classify(OSError(errno.EDQUOT, "Quota", "/x")).kind == "disk_full"
    e = classify(OSError(errno.EACCES, "Permission denied", "/x/shard"))
    assert e.kind == "environment" and "EACCES" in str(e) and "/x/shard" in str(e)
    assert classify(OSError(errno.ESTALE, "Stale", "/x")).kind == "environment"
    assert classify(FileNotFoundError(errno.ENOENT, "gone", "/x")) is None
    assert classify(ValueError("x")) is None
    wrapped = RuntimeError("save failed")
    wrapped.failures = {1: OSError(errno.ENOSPC, "No space left on device", "/ckpt/__1_0.distcp")}
    assert classify(wrapped).kind == "disk_full"
    try:
        try:
            raise OSError(errno.EIO, "I/O error", "/y")
        except OSError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert classify(outer).kind == "environment"


_AS_NOBODY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from recovery.commit import prune
from recovery.resume import plan_resume
os.setgid(65534); os.setuid(65534)
plan = plan_resume(sys.argv[2], identity=None, committed=[10, 20])
out = {"action": plan.action, "reason": plan.reason, "detail": plan.detail}
try:
    prune(sys.argv[2], keep=1)
    out["prune"] = "ran"
except OSError as e:  # the cheap check passes (sizes); the first deletion is refused by the filesystem
    out["prune"] = str(e)
print(json.dumps(out))
"""


def test_eacces_on_one_shard_as_an_unprivileged_reader_stops_and_keeps_everything():
    base = Path(tempfile.mkdtemp(prefix="slurmtron-eacces-"))
    try:
        os.chmod(base, 0o755)
        root = base / "checkpoints"
        save(root, 10)
        save(root, 20)
        for p in [root, *root.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(final_path(root, 20) / "__0_0.distcp", 0o600)  # root's own; nobody cannot read it
        before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(REPO), str(root)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["action"] == "refuse" and out["reason"] == "storage_error"
        assert "EACCES" in out["detail"] and "iter_0000020/__0_0.distcp" in out["detail"]
        assert "not a corrupt checkpoint" in out["detail"]
        assert "Permission denied" in out["prune"]
        assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


# ---- case 5: a missing `latest` target is visible -----------------------------------------

def test_latest_naming_a_missing_directory_is_a_notice(tmp_path):
    save(tmp_path, 10)
    (tmp_path / LATEST).write_text("iter_0000040\n")
    plan = plan_resume(tmp_path, identity=ME, committed=[10])
    assert plan.action == "resume" and plan.step == 10
    assert [(n["event"], n["reason"]) for n in plan.notices] == [("resume_fallback", "latest_target_missing")]
    code, text = explain(tmp_path)
    assert code == 0 and "WARNING: 'latest' names iter_0000040, which does not exist" in text


# ---- case 6: a checkpoint knows whose it is -------------------------------------------------

@pytest.mark.parametrize("other, why", [
    ({"name": "runB", "id": "id-B", "model": ME["model"]}, "written by run 'runB'"),
    ({"name": "runA", "id": "id-OLD", "model": ME["model"]}, "created anew"),
    ({"name": "runA", "id": "id-A", "model": {"num_layers": 4, "hidden_size": 64}}, "model shape"),
])
def test_another_runs_checkpoint_is_refused(tmp_path, other, why):
    save(tmp_path, 4, run=other)
    plan = plan_resume(tmp_path, identity=ME, committed=[])
    assert plan.action == "refuse" and plan.reason == "foreign_checkpoint" and why in plan.detail
    assert names(tmp_path) == ["iter_0000004"]
    assert plan_resume(tmp_path, identity=other, committed=[]).action == "resume"


def test_a_manifest_without_owner_is_loaded_with_a_notice_if_the_shape_matches(tmp_path):
    save(tmp_path, 4, run=None)
    plan = plan_resume(tmp_path, identity=ME)
    assert plan.action == "resume" and [n["reason"] for n in plan.notices] == ["no_owner"]


# ---- case 4: full disk during a save ---------------------------------------------------------

def test_abort_save_removes_staging_and_restores_a_set_aside_checkpoint(tmp_path):
    save(tmp_path, 10)
    good = final_path(tmp_path, 10)
    prepare_staging(tmp_path, 20)
    (staging_path(tmp_path, 20) / "__0_0.distcp").write_bytes(b"x" * 100)
    os.rename(good, str(good) + ".old")  # a re-save of 10 that failed after moving it aside
    assert abort_save(tmp_path, 20) == [staging_path(tmp_path, 20)]
    assert names(tmp_path) == ["iter_0000010"] and verify(good) is None


# ---- the run lock ----------------------------------------------------------------------------

def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    path = tmp_path / "run.lock"
    first = lock.acquire(path, lock.me_from_env({}))
    with pytest.raises(lock.RunLocked) as info:
        lock.acquire(path, lock.Holder(host=first.holder.host, pid=1, job_id=None))
    assert f"pid {os.getpid()}" in str(info.value) and "is running on this host" in str(info.value)
    assert lock.active_holder(path)[0].pid == os.getpid()
    assert first.release() and not path.exists()
    assert lock.active_holder(path) is None


def test_lock_held_by_a_dead_pid_is_taken_over_with_the_reason(tmp_path):
    path = tmp_path / "run.lock"
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE)
    dead = int(child.communicate()[0])
    holder = lock.Holder(host=os.uname().nodename, pid=dead, pid_start=1.0, start_time=1.0)
    path.write_text(json.dumps(holder.__dict__))
    assert lock.active_holder(path, host=holder.host) is None
    got = lock.acquire(path, lock.me_from_env({}), host=holder.host)
    assert got.taken_over.pid == dead and "no longer runs" in got.why
    assert lock.Holder.from_text(path.read_text()).pid == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]  # no stale/new leftovers


def test_lock_same_slurm_job_is_the_same_writer_other_jobs_are_asked(tmp_path):
    path = tmp_path / "run.lock"
    elsewhere = lock.Holder(host="node7", pid=4242, job_id="101", start_time=1.0)
    path.write_text(json.dumps(elsewhere.__dict__))
    me = lock.Holder(host="node3", pid=77, job_id="101", restart_count=1)
    got = lock.acquire(path, me, host="node3", job_active=lambda j: True)
    assert "same Slurm job 101" in got.why
    path.unlink()
    path.write_text(json.dumps(elsewhere.__dict__))
    other = lock.Holder(host="node3", pid=78, job_id="202")
    with pytest.raises(lock.RunLocked, match="Slurm job 101 is still active"):
        lock.acquire(path, other, host="node3", job_active=lambda j: True)
    with pytest.raises(lock.RunLocked, match="cannot ask Slurm"):
        lock.acquire(path, other, host="node3", job_active=lambda j: None)
    got = lock.acquire(path, other, host="node3", job_active=lambda j: False)
    assert "has ended" in got.why and got.taken_over.job_id == "101"


def test_squeue_states_reads_active_jobs_and_tells_cannot_from_ended():
    def runner(argv, **_kw):
        assert argv[:2] == ["squeue", "-h"]
        return SimpleNamespace(returncode=0, stdout="101|PENDING\n102|RUNNING\n", stderr="")
    assert lock.squeue_states(["101", "102", "103"], runner) == {"101": "PENDING", "102": "RUNNING"}
    def answer(rc, err):
        return lambda argv, **_kw: SimpleNamespace(returncode=rc, stdout="", stderr=err)

    gone = answer(1, "slurm_load_jobs error: Invalid job id specified")
    assert lock.squeue_states(["9"], gone) == {}
    assert lock.slurm_job_active("9", gone) is False
    broken = answer(1, "Unable to contact slurm controller")
    assert lock.slurm_job_active("9", broken) is None


# ---- final stops are not requeued ---------------------------------------------------------------

@pytest.mark.parametrize("reason", sorted(policy.FINAL_REASONS))
def test_crash_requeue_treats_final_stops_as_final(reason):
    code = policy.FINAL_REASONS[reason]
    events = [{"event": "stop", "reason": reason, "code": code}, {"event": "exit", "reason": reason, "code": code}]
    assert crash.crashed(events)[0] is False
    assert crash.crashed(events[:1])[0] is False  # killed before its exit event: still final
    assert code in policy.FINAL_CODES


def test_storage_error_text_names_file_and_errno():
    e = StorageError("environment", errno.ESTALE, "/lustre/ckpt/iter_0000010/__0_0.distcp")
    assert "ESTALE" in str(e) and "__0_0.distcp" in str(e)


# ---- free space and a failed save -----------------------------------------------------------------

class SmallDisk(LocalStorage):
    def __init__(self, free):
        self.free = free

    def free_bytes(self, path):
        return self.free


def test_space_warning_before_a_save(tmp_path):
    from recovery.savefail import space_warning

    assert space_warning(tmp_path, 100, storage=SmallDisk(1000)) is None
    text, fields = space_warning(tmp_path / "not-yet", 600, storage=SmallDisk(1000))
    assert "after the next will not fit" in text and fields["free_bytes"] == 1000 and fields["path"] == str(tmp_path)
    text, _ = space_warning(tmp_path, 2000, storage=SmallDisk(1000))
    assert "the next save will not fit" in text
    assert space_warning(tmp_path, None) is None


def test_a_disk_full_save_removes_staging_and_names_path_and_numbers(tmp_path):
    from recovery.savefail import save_failed

    save(tmp_path, 10)
    d = prepare_staging(tmp_path, 20)
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    exc = RuntimeError("dist save failed")
    exc.failures = {0: OSError(errno.ENOSPC, "No space left on device", str(d / "__1_0.distcp"))}
    stop = save_failed(exc, tmp_path, 20, storage=SmallDisk(12345))
    assert stop["reason"] == "disk_full" and stop["code"] == policy.EXIT_DISK_FULL
    assert stop["errno"] == "ENOSPC" and stop["path"].endswith("__1_0.distcp") and stop["free_bytes"] == 12345
    assert "committed checkpoints are untouched" in stop["detail"]
    assert names(tmp_path) == ["iter_0000010"] and verify(final_path(tmp_path, 10)) is None
    eio = save_failed(OSError(errno.EIO, "I/O error", "/x"), tmp_path, 20)
    assert eio["reason"] == "storage_error" and eio["code"] == policy.EXIT_STORAGE
    assert save_failed(ValueError("a bug"), tmp_path, 20) is None


# ---- the local launcher never dies from its own log echo -------------------------------------------

def test_log_echo_survives_a_full_disk_and_a_closed_terminal():
    import io

    from launch.local import _tee

    class Full:
        def write(self, _b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    class Closed(io.StringIO):
        def write(self, _s):
            raise OSError(errno.EIO, "Input/output error")

    lines = b"".join(b"iteration %d\n" % i for i in range(1000))
    echo = io.StringIO()
    _tee(io.BytesIO(lines), Full(), echo)  # no exception, every line still shown
    out = echo.getvalue()
    assert out.count("iteration ") == 1000 and out.count("WARNING: cannot write the rank log") == 1
    log = io.BytesIO()
    _tee(io.BytesIO(lines), log, Closed())
    assert log.getvalue().count(b"iteration ") == 1000 and b"WARNING: cannot echo to the terminal" in log.getvalue()


# ---- rank 0's decisions, with a plain context (no torch.distributed) ----------------------------------

def _rank0_ctx(tmp_path, *overrides, storage=None, restart=0):
    from launch.compose import compose_job

    job = compose_job(["model=tiny", "cluster=local", f"run.dir={tmp_path}", "run.name=ctxrun", *overrides])
    events = []
    ctx = SimpleNamespace(job=job, paths=job.paths_at(tmp_path), env={}, restart=restart, job_id=None,
                          storage=storage or LocalStorage(), run_lock=None, is_first=True, world=1, layout={},
                          emit=lambda ev, **f: events.append((ev, f)), log=lambda m: events.append(("log", m)))
    return ctx, events


def test_rank0_takes_the_lock_names_the_run_and_refuses_a_second_writer(tmp_path):
    from train.checkpointer import _decide

    ctx, _ = _rank0_ctx(tmp_path)
    start = _decide(ctx)
    assert start.ok and start.identity["name"] == "ctxrun"
    assert start.identity["id"] == (tmp_path / "run_id").read_text().strip()
    second, _ = _rank0_ctx(tmp_path)
    refused = _decide(second)
    assert not refused.ok and refused.decision.reason == "run_locked"
    assert refused.decision.code == policy.EXIT_RUN_LOCKED and f"pid {os.getpid()}" in refused.decision.detail
    ctx.run_lock.release()


def test_rank0_holds_the_lock_its_local_launcher_handed_over(tmp_path):
    """cluster=local: the launcher holds the run lock over all attempts; its rank 0 (given the record's token)
    holds it as it is and leaves it to the launcher at its end. Anyone else is still refused."""
    from launch.local import take_run_lock
    from train.checkpointer import _decide

    launcher = take_run_lock(tmp_path)
    record = (tmp_path / "run.lock").read_bytes()
    ctx, events = _rank0_ctx(tmp_path)
    ctx.env = {lock.HANDOVER_ENV: launcher.holder.token}
    start = _decide(ctx)
    assert start.ok and ctx.run_lock.handed and not [e for e in events if e[0] == "run_lock_takeover"]
    assert ctx.run_lock.release() is False and (tmp_path / "run.lock").read_bytes() == record
    for env in ({}, {lock.HANDOVER_ENV: "another launcher's token"}):
        other, _ = _rank0_ctx(tmp_path)
        other.env = env
        refused = _decide(other)
        assert refused.decision.reason == "run_locked" and f"pid {os.getpid()}" in refused.decision.detail
    assert launcher.release() and not (tmp_path / "run.lock").exists()


def test_rank0_restart_from_scratch_only_on_a_fresh_submission(tmp_path):
    from train.checkpointer import _decide

    ck = tmp_path / "checkpoints"
    ctx, _ = _rank0_ctx(tmp_path, "training.restart_from_scratch=true", restart=1)
    ident = _decide(ctx).identity
    ctx.run_lock.release()
    save(ck, 10, run=ident)
    flip(final_path(ck, 10))
    requeued, _ = _rank0_ctx(tmp_path, "training.restart_from_scratch=true", restart=1)
    start = _decide(requeued)  # a requeue never throws checkpoints away, even with the flag set
    assert not start.ok and start.decision.reason == "no_loadable_checkpoint"
    requeued.run_lock.release()
    fresh, _ = _rank0_ctx(tmp_path, "training.restart_from_scratch=true", restart=0)
    start = _decide(fresh)
    assert start.ok and start.resume.path is None and [n["event"] for n in start.notices][0] == "start_over"
    assert len(list_quarantine(ck)) == 1
    fresh.run_lock.release()


def test_a_save_that_cannot_fit_stops_before_writing(tmp_path):
    from train.checkpointer import Checkpointer

    ck = tmp_path / "checkpoints"
    save(ck, 10)
    ctx, events = _rank0_ctx(tmp_path, storage=SmallDisk(500))
    ckpt = Checkpointer(ctx, parts=None)
    ckpt.last_bytes = 10_000
    stop = ckpt._stage(20)
    assert stop["reason"] == "disk_full" and stop["code"] == policy.EXIT_DISK_FULL and stop["free_bytes"] == 500
    assert names(ck) == ["iter_0000010"]  # no staging left behind
    ckpt.last_bytes = 300  # fits once, not twice: a warning and an event, the save goes on
    assert ckpt._stage(20) is None
    assert [e for e, _ in events if e != "log"] == ["disk_space_warning"]


def test_a_save_error_without_errno_on_a_disk_without_room_is_a_full_disk(tmp_path):
    from recovery.savefail import save_failed

    prepare_staging(tmp_path, 20)
    torch_words = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    stop = save_failed(torch_words, tmp_path, 20, storage=SmallDisk(100), expected_bytes=5000)
    assert stop["reason"] == "disk_full" and "unexpected pos" in stop["detail"] and "100 bytes free" in stop["detail"]
    assert names(tmp_path) == []
    assert save_failed(torch_words, tmp_path, 20, storage=SmallDisk(10**9), expected_bytes=5000) is None  # a crash


def test_an_oserror_that_crossed_a_process_as_text_is_still_classified():
    from torch.distributed.checkpoint.api import CheckpointException

    e = CheckpointException("write", {0: (RuntimeError("Worker failure: [Errno 28] No space left on device"), None)})
    assert classify(e).kind == "disk_full"
    assert classify(RuntimeError("Worker failure: [Errno 13] Permission denied")).kind == "environment"
    assert classify(RuntimeError("Worker failure: [Errno 2] No such file")) is None
