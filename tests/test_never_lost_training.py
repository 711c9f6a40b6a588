"""Never lose a checkpoint, on real Megatron-Core training (tiny model, one CPU rank, a few steps).

One module run (a shared 4-step run with checkpoints at steps 2 and 4) serves the cases:

* every checkpoint corrupt -> the job refuses (exit 5, ``stop`` ``no_loadable_checkpoint``, each
  checkpoint listed), trains nothing and changes nothing; ``training.restart_from_scratch=true``
  then moves them to ``quarantine/`` and trains from step 0;
* another run's checkpoint in this run's directory -> refused (exit 6) whatever the paths say;
* ``EACCES`` on one shard of the real run directory, read as an unprivileged user -> an
  environment error naming the file, not a corrupt checkpoint;
* a second writer while the first holds the run lock -> refused (exit 9) naming the holder;
* a full disk (a real 1-checkpoint tmpfs): the second save is refused before writing (exit 8),
  staging gone, the committed checkpoint intact; a save that does not fit at all fails mid-write
  with ENOSPC (exit 8), staging removed;
* kill -9 during a save on a nearly full disk: the next attempt takes over the stale lock,
  resumes from the committed checkpoint and completes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from recovery import lock, policy
from recovery.commit import final_path
from recovery.events import read_events
from recovery.quarantine import list_quarantine
from recovery.resume import verify
from trainutil import start_ranks, train, wait_ranks

pytestmark = pytest.mark.training

REPO = Path(__file__).resolve().parent.parent
BASE = ["model=tiny", "parallelism=tp1", "cluster=local", "training.checkpoint_interval=2",
        "training.keep_checkpoints=3"]


def run(run_dir: Path, *extra: str, attempt: int = 0, env: dict | None = None):
    return train(run_dir, [*BASE, f"run.name={run_dir.name}", *extra], world=1, attempt=attempt, extra_env=env)


def stops(result, attempt_events=None):
    return [e for e in (attempt_events or result.events) if e["event"] == "stop"]


def flip(ckpt: Path) -> None:
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"]
    shard = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def digest(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished 4-step run with verified checkpoints at steps 2 and 4 (copied by each test)."""
    d = tmp_path_factory.mktemp("never") / "base"
    r = run(d, "training.train_iters=4")
    assert r.codes == [0], r.all_logs()
    return d


def copy_run(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def test_all_corrupt_refuses_then_restart_from_scratch_quarantines(base_run, tmp_path):
    d = copy_run(base_run, tmp_path / "base")
    ck = d / "checkpoints"
    for s in (2, 4):
        flip(final_path(ck, s))
    before = {s: digest(final_path(ck, s)) for s in (2, 4)}
    n_events = len(read_events(d / "events.jsonl"))
    r = run(d, "training.train_iters=6")
    new = r.events[n_events:]
    assert r.codes == [policy.EXIT_NO_LOADABLE], r.all_logs()
    [stop] = stops(r, new)
    assert stop["reason"] == "no_loadable_checkpoint" and "iter_0000004: checksum mismatch" in stop["detail"]
    assert "iter_0000002: checksum mismatch" in stop["detail"]
    assert not [e for e in new if e["event"] == "iteration"]  # trained nothing
    assert {s: digest(final_path(ck, s)) for s in (2, 4)} == before  # changed nothing
    assert "not starting: no_loadable_checkpoint" in r.log()
    # the crash-requeue path treats it as final
    from recovery.crash import crashed
    assert crashed(new)[0] is False

    r = run(d, "training.train_iters=6", "training.restart_from_scratch=true")
    assert r.codes == [0], r.all_logs()
    moved = list_quarantine(ck)
    assert len(moved) == 2 and all(why == "training.restart_from_scratch=true" for _, why in moved)
    steps = [e["step"] for e in r.events[n_events:] if e["event"] == "iteration"]
    assert steps[:1] == [1] and steps[-1] == 6  # started over, deliberately


def test_another_runs_checkpoint_is_refused(base_run, tmp_path):
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copytree(final_path(base_run / "checkpoints", 4), final_path(other / "checkpoints", 4))
    r = run(other, "training.train_iters=6")
    assert r.codes == [policy.EXIT_FOREIGN], r.all_logs()
    [stop] = stops(r)
    assert stop["reason"] == "foreign_checkpoint" and "written by run 'base'" in stop["detail"]


_AS_NOBODY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from recovery.resume import plan_resume
os.setgid(65534); os.setuid(65534)
plan = plan_resume(sys.argv[2])
print(json.dumps({"action": plan.action, "reason": plan.reason, "detail": plan.detail}))
"""


def test_eacces_on_a_shard_of_a_real_run_is_an_environment_error(base_run):
    world_readable = Path(tempfile.mkdtemp(prefix="slurmtron-eacces-"))
    try:
        os.chmod(world_readable, 0o755)
        ck = world_readable / "checkpoints"
        shutil.copytree(base_run / "checkpoints", ck)
        for p in [ck, *ck.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        shard = max((p for p in final_path(ck, 4).rglob("*.distcp")), key=lambda p: p.stat().st_size)
        os.chmod(shard, 0o600)
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(REPO), str(ck)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert (out["action"], out["reason"]) == ("refuse", "storage_error")
        assert "EACCES" in out["detail"] and shard.name in out["detail"]
        assert verify(final_path(ck, 4)) is None  # root can read it: it was never corrupt
    finally:
        shutil.rmtree(world_readable, ignore_errors=True)


def test_a_second_writer_is_refused_while_the_lock_is_held_and_writes_no_event(base_run, tmp_path):
    """A second launch of a running run (the local launcher's spawner, the real worker) is refused with exit 9
    naming the holder in its log, and writes nothing into the holder's event log or checkpoints: the running
    attempt's status and report stay its own."""
    d = copy_run(base_run, tmp_path / "base")
    events_before = (d / "events.jsonl").read_bytes()
    checkpoints_before = digest(d / "checkpoints")
    held = lock.acquire(d / "run.lock", lock.me_from_env({}))  # a live holder: this test process
    try:
        r = run(d, "training.train_iters=6")
    finally:
        held.release()
    assert r.codes == [policy.EXIT_RUN_LOCKED], r.all_logs()
    log = r.log()
    assert "not starting: run_locked" in log and f"pid {os.getpid()}" in log, log[-3000:]
    assert (d / "events.jsonl").read_bytes() == events_before
    assert digest(d / "checkpoints") == checkpoints_before


def ckpt_bytes(base_run: Path) -> int:
    return sum(p.stat().st_size for p in final_path(base_run / "checkpoints", 4).rglob("*") if p.is_file())


def test_full_disk_stops_with_the_numbers_and_keeps_the_committed(base_run, tmp_path, small_disk):
    size = ckpt_bytes(base_run)
    disk = small_disk(int(size * 1.5))  # one checkpoint fits, two do not
    d = tmp_path / "full"
    # synchronous saves: the refused save is the step-4 one; an asynchronous step-2 save still being written at
    # step 4 would delay it to step 5 (at most one save in flight)
    r = run(d, "training.train_iters=6", f"cluster.checkpoint_root={disk}", "training.keep_checkpoints=1",
            "training.async_save=false")
    assert r.codes == [policy.EXIT_DISK_FULL], r.all_logs()
    [stop] = stops(r)
    assert stop["reason"] == "disk_full" and stop["free_bytes"] < size and "step 4" in stop["detail"]
    ck = disk / "full"
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["iter_0000002"]  # no staging left
    assert verify(final_path(ck, 2)) is None
    from recovery.crash import crashed
    assert crashed(r.events)[0] is False  # not requeued

    tiny = small_disk(int(size * 0.5))  # not even one fits: the first save fails mid-write
    d2 = tmp_path / "tiny"
    r = run(d2, "training.train_iters=2", f"cluster.checkpoint_root={tiny}")
    assert r.codes == [policy.EXIT_DISK_FULL], r.all_logs()
    [stop] = stops(r)
    assert stop["reason"] == "disk_full" and stop["errno"] in ("ENOSPC", "EDQUOT")
    assert [p.name for p in (tiny / "tiny").iterdir() if p.is_dir()] == []  # the torn save was removed


def test_kill_9_during_a_save_on_a_nearly_full_disk(base_run, tmp_path, small_disk):
    size = ckpt_bytes(base_run)
    disk = small_disk(int(size * 2.6))  # the committed one, one staging, a little more
    d = tmp_path / "kill"
    # synchronous saves: the kill lands in the step-4 save, held by SLURMTRON_TEST_SAVE_SLEEP_S before its commit
    extra = ["training.train_iters=6", f"cluster.checkpoint_root={disk}", "training.keep_checkpoints=1",
             "training.async_save=false"]
    from trainutil import write_job
    write_job(d, [*BASE, "cluster.gpus_per_node=1", f"run.name={d.name}", *extra])
    procs = start_ranks(d, 1, 0, {"SLURMTRON_TEST_SAVE_SLEEP_S": "30"})
    ck = disk / "kill"
    deadline = time.time() + 240
    while time.time() < deadline and not (final_path(ck, 2).is_dir() and (ck / "iter_0000004.tmp").is_dir()
                                          and any((ck / "iter_0000004.tmp").glob("*.distcp"))):
        time.sleep(0.5)
    for p in procs.procs:
        os.killpg(p.pid, signal.SIGKILL)
    wait_ranks(procs, 60)
    assert (ck / "iter_0000004.tmp").is_dir() and (d / "run.lock").exists()  # torn save, stale lock
    r = run(d, *extra, attempt=1)
    assert r.codes == [0], r.all_logs()
    kinds = [e["event"] for e in r.events]
    assert "run_lock_takeover" in kinds
    resumed = [e for e in r.events if e["event"] == "resume"]
    assert resumed and resumed[-1]["step"] == 2
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["iter_0000006"]
    assert not (d / "run.lock").exists()
