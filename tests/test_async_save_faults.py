"""Faults during an asynchronous checkpoint write, on real Megatron-Core training (tiny model, 2 CPU ranks).

``training.async_save=true``: a periodic save forks a writer per rank and training goes on;
``SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S`` holds each writer before its first byte, so the faults
below land while the save is in flight (the harness waits for ``checkpoint_async_started``
and no commit yet). One faulted run, one attempt per fault:

1. SIGUSR2 to every process: the stop waits for the save in flight (written, committed) and
   then saves the stop step synchronously (exit 42);
2. SIGKILL of rank 1 during the write;
3. SIGKILL of rank 0 during the write.

And on a real small tmpfs (root only): the disk fills up while the first save's writers sleep,
the write fails with ENOSPC on the rank, every rank stops with ``disk_full`` (exit 8) and the
staging directory is removed (nothing torn is left to load); after space is freed the run
completes. (That a failed save keeps the committed checkpoints is shown for the shared
commit protocol in ``test_never_lost_training.py``.)

Asserted: every resume starts at the newest committed checkpoint (the save in flight never
counts: never loaded, never committed), every logged loss and the final model and optimizer
tensors are bitwise equal to an uninterrupted run with *synchronous* saves.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from faults import Fault, checkpoint_tensors, losses_by_attempt, run_attempt, run_until_done, write_rank_logs_tail
from recovery import policy
from recovery.commit import final_path
from recovery.events import read_events
from recovery.resume import find_latest_verified
from warm_ranks import rank_popen

pytestmark = pytest.mark.training

ITERS = 10
INTERVAL = 2
WORLD = 2
STEP_SLEEP = {"SLURMTRON_TEST_STEP_SLEEP_S": "0.1"}
WRITE_SLEEP = {"SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S": "2"}  # each forked writer waits before writing


def write_job(run_dir: Path, *extra: str) -> None:
    from launch.compose import compose_job, job_to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job([
        "model=tiny", "parallelism=tp1", "parallelism.distributed_optimizer=true", f"cluster.gpus_per_node={WORLD}",
        "cluster.nodes=1", f"training.train_iters={ITERS}", f"training.checkpoint_interval={INTERVAL}",
        "training.keep_checkpoints=2", "training.zero_progress_restarts=5", f"run.dir={run_dir}", *extra,
    ])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))


def final_tensors(ckpt_root: Path, tmp: Path, tag: str) -> dict:
    found = find_latest_verified(ckpt_root)
    assert found.step == ITERS, found
    out = tmp / f"{tag}_final.pt"
    return checkpoint_tensors(found.path, out)


def assert_bitwise(run_dir: Path, ref_dir: Path, tmp: Path, ckpt_root: Path | None = None) -> None:
    import torch

    want = losses_by_attempt(ref_dir)[0]
    runs = losses_by_attempt(run_dir)
    assert set().union(*[set(v) for v in runs.values()]) == set(range(1, ITERS + 1))
    for restart, losses in runs.items():
        for step, loss in losses.items():
            assert loss == want[step], (restart, step, loss, want[step])
    a = final_tensors(ref_dir / "checkpoints", tmp, "ref")
    b = final_tensors(ckpt_root or run_dir / "checkpoints", tmp, run_dir.name)
    assert sorted(a) == sorted(b) and len(a) > 10
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, with synchronous saves."""
    run_dir = tmp_path_factory.mktemp("ref_sync")
    write_job(run_dir, "training.async_save=false")
    atts = run_until_done(run_dir, WORLD, max_attempts=1, timeout_s=300)
    assert [a.codes for a in atts] == [[0] * WORLD], write_rank_logs_tail(run_dir)
    return run_dir


def by_restart(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(int(e.get("restart_count") or 0), []).append(e)
    return out


@pytest.mark.timeout(900)
def test_stop_and_kills_during_an_async_write_resume_bitwise_equal(reference, tmp_path):
    run_dir = tmp_path / "faulted"
    write_job(run_dir)
    env = {**STEP_SLEEP, **WRITE_SLEEP}
    plan = [
        [Fault("signal_all", 1, signal.SIGUSR2, env=env, during="async_write")],
        [Fault("kill_rank", 1, rank=1, env=env, during="async_write")],
        [Fault("kill_rank", 1, rank=0, env=env, during="async_write")],
    ]
    # kill_grace_s: the survivor of a killed rank ends by itself (its broken collective is a crash) and must have
    # said checkpoint_abandoned by then; the harness's 5 s default before it kills survivors is short on a loaded
    # machine, and a longer one costs nothing when the survivor ends at once
    atts = run_until_done(run_dir, WORLD, plan, max_attempts=len(plan) + 1, timeout_s=240, kill_grace_s=30)
    logs = lambda: write_rank_logs_tail(run_dir)  # noqa: E731
    fired = [(f.kind, f.rank, d) for a in atts for f, _t, d in a.fired]
    assert len(fired) == 3 and all("while the save of step" in d for _k, _r, d in fired), (fired, logs())
    assert atts[0].codes == [42, 42], logs()
    assert atts[1].codes[1] == -signal.SIGKILL and atts[2].codes[0] == -signal.SIGKILL, [a.codes for a in atts]
    assert atts[-1].codes == [0, 0] and len(atts) == 4, ([a.codes for a in atts], logs())

    ev = by_restart(read_events(run_dir / "events.jsonl"))
    committed: set = set()
    for i in range(len(atts)):
        es = ev.get(i, [])
        kinds = [e["event"] for e in es]
        if i > 0:  # resume exactly at the newest committed checkpoint; never at the one in flight
            [resume] = [e for e in es if e["event"] == "resume"]
            assert resume["step"] == max(committed), (i, resume, sorted(committed))
            assert Path(resume["checkpoint"]).name == final_path(Path(""), resume["step"]).name  # never a .tmp
        started = [e["step"] for e in es if e["event"] == "checkpoint_async_started"]
        saved = [e for e in es if e["event"] == "checkpoint_saved"]
        if i in (1, 2):  # killed during the write: the save in flight was never committed
            assert started and started[-1] not in {e["step"] for e in saved}, (i, started, saved)
        if i == 1:  # rank 0 outlived rank 1: its broken collective is a crash that says the save was abandoned
            (gone,) = [e for e in es if e["event"] == "checkpoint_abandoned"]
            assert gone["step"] == started[-1] and gone["phase"] == "write", (gone, logs())
        committed |= {e["step"] for e in saved}
        if i == 0:  # the stop waited for the save in flight, then saved the stop step synchronously
            (sig,) = [e for e in es if e["event"] == "signal"]
            wait = [e for e in es if e["event"] == "checkpoint_wait"]
            assert wait and wait[0]["step"] == started[-1] and wait[0]["reason"] == "signal", (kinds, logs())
            assert [e["step"] for e in saved if e.get("mode") == "async"][-1] == started[-1]
            assert saved[-1]["step"] == sig["step"], saved
            assert saved[-1]["reason"] == ("signal" if sig["step"] != started[-1] else "interval")
    assert_bitwise(run_dir, reference, tmp_path)


@pytest.mark.timeout(600)
def test_disk_full_during_an_async_write_stops_cleanly_and_resumes_bitwise_equal(reference, tmp_path, small_disk):
    size = sum(p.stat().st_size for p in final_path(reference / "checkpoints", ITERS).rglob("*") if p.is_file())
    disk = small_disk(size * 6)
    run_dir = tmp_path / "diskfull"
    write_job(run_dir, f"cluster.checkpoint_root={disk}", f"run.name={run_dir.name}")
    ckpt = disk / run_dir.name
    filler = disk / "filler"

    def fill(_ranks) -> None:  # the disk fills up (another job, say) while the first save's writers sleep
        if filler.exists():
            return
        if any(e["event"] == "checkpoint_async_started" for e in read_events(run_dir / "events.jsonl")):
            st = os.statvfs(disk)
            with open(filler, "wb") as f:
                try:
                    f.write(b"\0" * (st.f_bavail * st.f_frsize))
                except OSError:
                    pass

    from launch.local import WORKER_MODULE, Ranks
    from launch.paths import RunPaths

    paths = RunPaths.of(run_dir)
    ranks = Ranks(argv=["-m", WORKER_MODULE, str(run_dir)], world=WORLD,
                  log_path=lambda r: paths.rank_log(0, r, prefix="faults"),
                  env={**os.environ, **STEP_SLEEP, **WRITE_SLEEP}, attempt=0, popen=rank_popen()).start()
    done = ranks.wait(timeout_s=240, grace_s=5, healthy=(0,), tick=fill)
    logs = lambda: write_rank_logs_tail(run_dir)  # noqa: E731
    assert done.codes == [policy.EXIT_DISK_FULL] * WORLD, (done.codes, logs())
    [stop] = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "stop"]
    assert stop["reason"] == "disk_full" and "step 2" in stop["detail"], stop
    assert stop["errno"] in ("ENOSPC", "EDQUOT"), stop
    assert [p.name for p in ckpt.iterdir() if p.is_dir()] == []  # the torn save was removed, nothing committed

    filler.unlink()  # space freed: the same run starts again (nothing was committed) and completes
    att = run_attempt(run_dir, WORLD, 1, ckpt_root=ckpt, env={**os.environ, **STEP_SLEEP}, timeout_s=240)
    assert att.codes == [0, 0], logs()
    assert not [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert_bitwise(run_dir, reference, tmp_path, ckpt)
