"""Injected faults on real Megatron-Core training (CPU, gloo, 2 ranks): resume is exact.

Each layout (TP2, PP2 and DP2) runs once without interruption and once with injected faults, one attempt after another (the harness,
:mod:`tests.faults`, relaunches like Slurm's requeue; the worker decides everything else).
The layouts that split tensors and stages share these five faults (TP2 gets 1-3, PP2 1, 3
and 4, so each kind runs on one of them and the stop and the kill on both):

1. SIGUSR2 (the time-limit warning) to every rank at a random (seeded) step;
2. one flipped byte in the newest checkpoint before the restart, then SIGTERM to rank 1 only
   (the ranks must agree on the stop at the step boundary);
3. SIGKILL of one rank (no checkpoint on the way out);
4. SIGKILL of rank 0 *during* a save (``SLURMTRON_TEST_SAVE_SLEEP_S`` holds rank 0 after the
   shards are written, before the commit), leaving a torn staging directory.

DP2 (the ordinary optimizer, replicated) gets faults 1 and 3 (a stop checkpoint, then a kill): each
fault costs a relaunch, and the replicated state is what a resume reads, whatever ended the attempt
before. DP2 with the distributed optimizer gets the same faults, and a kill of each rank, during an
asynchronous write in ``test_async_save_faults.py`` (the periodic saves here are asynchronous too),
so it is not run again here.

Then it runs to completion. Asserted: every fault resumes; the corrupt and the torn
checkpoints are never loaded (the previous one is, with a ``resume_fallback`` event); every
resume starts exactly at the newest committed (and intact) checkpoint, so no step is lost
beyond it; every logged loss (including recomputed steps) and the final model and
optimizer tensors are bitwise equal to the uninterrupted run's. 4 + 3 + 2 = 9 faults.
The corruption and the torn save are checkpoint-directory faults (the fallback does not
depend on the layout), which is why each runs on one layout only.

Also: a TP2 checkpoint resumed under PP2 and under DP2 with the distributed optimizer
reproduces the TP2 run's losses (the shared-Adam-``step`` bug of the distributed optimizer
load shows up here as a loss difference of ~1e-2), and the zero-progress guard stops a
deterministic crash with exit 3 and the named reason.

Every rank is a subprocess with a timeout. About 6-8 minutes on 2 busy cores.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from recovery.commit import final_path
from recovery.events import read_events
from recovery.identity import RUN_ID_FILE
from recovery.policy import read_progress
from faults import Fault, checkpoint_tensors, losses_by_attempt, run_until_done, write_rank_logs_tail
from recovery.resume import find_latest_verified

pytestmark = pytest.mark.training

ITERS = 18
INTERVAL = 3
WORLD = 2
STEP_SLEEP = {"SLURMTRON_TEST_STEP_SLEEP_S": "0.15"}  # so a signal lands mid-run
SAVE_SLEEP = {"SLURMTRON_TEST_SAVE_SLEEP_S": "3"}  # rank 0 waits between shards and commit

LAYOUTS = {
    "tp2": ["parallelism=tp2", "parallelism.distributed_optimizer=true"],
    "pp2": ["parallelism=pp2", "parallelism.distributed_optimizer=true"],
    "dp2_distopt": ["parallelism=tp1", "parallelism.distributed_optimizer=true"],
    "dp2": ["parallelism=tp1", "parallelism.distributed_optimizer=false"],
}


def write_job(run_dir: Path, layout: str, *extra: str) -> None:
    from launch.compose import compose_job, job_to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job([
        *LAYOUTS[layout], f"cluster.gpus_per_node={WORLD}", "cluster.nodes=1",
        f"training.train_iters={ITERS}", f"training.checkpoint_interval={INTERVAL}",
        "training.keep_checkpoints=3", f"run.dir={run_dir}", *extra,
    ])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))


def final_tensors(run_dir: Path, tmp: Path) -> dict:
    """Every tensor of the newest verified checkpoint (model and optimizer), layout-free."""
    found = find_latest_verified(run_dir / "checkpoints")
    assert found.step == ITERS, (found, write_rank_logs_tail(run_dir))
    out = tmp / f"{run_dir.name}_final.pt"
    return checkpoint_tensors(found.path, out)


@dataclass
class Reference:
    run_dir: Path
    losses: dict  # step -> repr(loss)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted run per layout, computed once per module."""
    cache: dict = {}

    def get(layout: str) -> Reference:
        if layout not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref_{layout}")
            write_job(run_dir, layout)
            atts = run_until_done(run_dir, WORLD, max_attempts=1, timeout_s=300)
            assert [a.codes for a in atts] == [[0] * WORLD], write_rank_logs_tail(run_dir)
            losses = losses_by_attempt(run_dir)[0]
            assert sorted(losses) == list(range(1, ITERS + 1))
            cache[layout] = Reference(run_dir, losses)
        return cache[layout]

    return get


PLANS = {"tp2": (0, 1, 2), "pp2": (0, 2, 3)}  # attempts of the plan below; others (0, 2) (see the docstring)


def fault_plan(layout: str) -> list[list[Fault]]:
    rng = random.Random(f"faults-{layout}")  # seeded: a failure reproduces
    n = lambda: rng.randint(1, 3)  # noqa: E731
    plan = [
        # late enough that an interval checkpoint precedes the stop checkpoint, so the
        # corruption below has an intact previous checkpoint to fall back to
        [Fault("signal_all", rng.randint(INTERVAL + 1, 2 * INTERVAL), signal.SIGUSR2, env=STEP_SLEEP)],
        [Fault("corrupt_latest"), Fault("signal_rank", n(), signal.SIGTERM, rank=1, env=STEP_SLEEP)],
        [Fault("kill_rank", n(), rank=rng.randint(0, WORLD - 1), env=STEP_SLEEP)],
        [Fault("kill_in_save", n(), env={**STEP_SLEEP, **SAVE_SLEEP})],
    ]
    return [plan[i] for i in PLANS.get(layout, (0, 2))]  # drawn in full first: each fault's step stays put


def test_every_fault_kind_runs_on_a_layout_that_splits_the_model() -> None:
    kinds = lambda layout: {f.kind for step in fault_plan(layout) for f in step}  # noqa: E731
    every = {"signal_all", "corrupt_latest", "signal_rank", "kill_rank", "kill_in_save"}
    assert kinds("tp2") | kinds("pp2") == every
    assert {"signal_all", "kill_rank"} <= kinds("tp2") & kinds("pp2") & kinds("dp2") & kinds("dp2_distopt")


def by_restart(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(int(e.get("restart_count") or 0), []).append(e)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])  # dp2_distopt: test_async_save_faults.py
def test_faults_resume_bitwise_equal(layout, reference, tmp_path):
    ref = reference(layout)
    run_dir = tmp_path / f"faulted_{layout}"
    write_job(run_dir, layout)
    plan = fault_plan(layout)
    atts = run_until_done(run_dir, WORLD, plan, max_attempts=len(plan) + 2, timeout_s=240)
    logs = lambda: write_rank_logs_tail(run_dir)  # noqa: E731

    # every planned fault fired, and the run then completed
    fired = [f.kind for a in atts for f, _t, _d in a.fired]
    assert fired == [f.kind for step in plan for f in step], (fired, logs())
    stops = [a for a in atts if any(f.kind in ("signal_all", "signal_rank") for f in a.faults)]
    kills = [a for a in atts if any(f.kind == "kill_rank" for f in a.faults)]
    assert [a.codes for a in stops] == [[42, 42]] * len(stops) and stops, logs()
    assert len(kills) == 1 and any(c == -signal.SIGKILL for c in kills[0].codes), kills[0].codes
    for a in atts:
        if any(f.kind == "kill_in_save" for f in a.faults):
            assert a.codes[0] == -signal.SIGKILL, a.codes
    assert atts[-1].codes == [0, 0] and len(atts) == len(plan) + 1, ([a.codes for a in atts], logs())

    ev = by_restart(read_events(run_dir / "events.jsonl"))
    committed: set = set()  # intact committed checkpoints so far
    corrupt: set = set()  # committed ones made corrupt since
    for i, a in enumerate(atts):
        es = ev.get(i, [])
        kinds = [e["event"] for e in es]
        resume = [e for e in es if e["event"] == "resume"]
        fallback = [e for e in es if e["event"] == "resume_fallback"]
        if i > 0:
            # The commit point is the rename of iter_N.tmp; its checkpoint_saved line follows it. A SIGKILL of rank 0
            # in between (a kill_rank fault while an asynchronous commit runs in rank 0's thread, or while a
            # synchronous save commits) leaves a committed checkpoint without its line: seen on disk when this
            # attempt started. Only an attempt that ended by a kill may leave one.
            unlogged = {s for s in a.on_disk if s > max(committed, default=0) and s not in corrupt}
            if unlogged:
                assert any(f.kind in ("kill_rank", "kill_in_save") for f in atts[i - 1].faults), (
                    i, sorted(unlogged), sorted(committed), logs())
                committed |= unlogged
            # the corrupted checkpoint is no longer intact; the torn one never was
            if any(f.kind == "corrupt_latest" for f in a.faults):
                corrupted = max(committed)
                committed.discard(corrupted)
                corrupt.add(corrupted)
                assert any(e["skipped"].endswith(final_path(Path(""), corrupted).name)
                           and "checksum mismatch" in e["reason"] for e in fallback), (fallback, logs())
            if any(f.kind == "kill_in_save" for f in atts[i - 1].faults):
                assert any(e["skipped"].endswith(".tmp") and "staging" in e["reason"] for e in fallback), fallback
            # no step lost beyond the newest intact checkpoint: resume exactly there
            assert len(resume) == 1, (i, kinds, logs())
            assert resume[0]["step"] == max(committed), (i, resume, sorted(committed))
        saved = [e for e in es if e["event"] == "checkpoint_saved"]
        committed |= {e["step"] for e in saved}
        corrupt -= {e["step"] for e in saved}  # saved again: intact again
        if any(f.kind in ("signal_all", "signal_rank") for f in a.faults):
            (sig,) = [e for e in es if e["event"] == "signal"]
            # the stop step is durable: a stop checkpoint, or the periodic one the worker had
            # just written at that same boundary (it does not save a step twice)
            assert saved[-1]["step"] == sig["step"] and saved[-1]["reason"] in ("signal", "interval"), saved
            assert [e["method"] for e in es if e["event"] == "requeue"] == ["exit_code"]  # not under Slurm

    # training.max_restarts counts failures: a stop checkpoint marked its attempt planned, a killed attempt is not
    marks = {int(r["restart_count"]): r.get("planned_stop") for r in read_progress(run_dir)}
    for i, a in enumerate(atts):
        if any(f.kind == "signal_all" for f in a.faults):
            sig_step = next(e["step"] for e in ev[i] if e["event"] == "signal")
            assert marks.get(i) and marks[i]["step"] == sig_step, (i, marks)
        if any(f.kind in ("kill_rank", "kill_in_save") for f in a.faults):
            assert marks.get(i) is None, (i, marks)

    # replay parity said so: the resume after the corrupted checkpoint (at least) replayed logged steps, bitwise
    events = read_events(run_dir / "events.jsonl")
    matches = [e for e in events if e["event"] == "replay_match"]
    assert matches or "corrupt_latest" not in fired, logs()  # a kill after a logged step may replay none
    assert all(e["mode"] == "bitwise" and e["max_rel"] == 0.0 for e in matches), matches
    assert not [e for e in events if e["event"] == "replay_mismatch"], logs()
    # bitwise: every logged loss, including steps recomputed after a rollback
    runs = losses_by_attempt(run_dir)
    assert set().union(*[set(v) for v in runs.values()]) == set(range(1, ITERS + 1))
    for restart, losses in runs.items():
        for step, loss in losses.items():
            assert loss == ref.losses[step], (layout, restart, step, loss, ref.losses[step])
    # bitwise: the final model and optimizer state
    want, got = final_tensors(ref.run_dir, tmp_path), final_tensors(run_dir, tmp_path)
    assert sorted(got) == sorted(want) and len(want) > 10
    import torch

    diff = [k for k in want if not torch.equal(want[k], got[k])]
    assert diff == [], diff


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", ["pp2", "dp2_distopt"])
def test_reshard_tp2_checkpoint(target, reference, tmp_path):
    ref = reference("tp2")
    start = 12  # a kept interval checkpoint of the TP2 run (keep 3 of 3, 6, ..., 18)
    run_dir = tmp_path / f"reshard_{target}"
    write_job(run_dir, target)
    src = final_path(ref.run_dir / "checkpoints", start)
    assert find_latest_verified(ref.run_dir / "checkpoints").step == ITERS
    shutil.copytree(src, final_path(run_dir / "checkpoints", start))
    # the same run continued in another layout: it carries the run's identity (another run's checkpoint is refused)
    shutil.copy(ref.run_dir / RUN_ID_FILE, run_dir / RUN_ID_FILE)
    atts = run_until_done(run_dir, WORLD, max_attempts=1, timeout_s=300)
    assert atts[0].codes == [0, 0], write_rank_logs_tail(run_dir)
    events = read_events(run_dir / "events.jsonl")
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["step"] == start and resume["from_layout"]["tp"] == 2
    (js,) = [e for e in events if e["event"] == "job_start"]
    assert (js["layout"]["tp"], js["layout"]["pp"], js["layout"]["dp"]) == \
        {"pp2": (1, 2, 1), "dp2_distopt": (1, 1, 2)}[target]
    losses = losses_by_attempt(run_dir)[0]
    assert sorted(losses) == list(range(start + 1, ITERS + 1))
    for step, loss in losses.items():
        # a different layout sums in a different order: equal to float32 rounding (seen:
        # 2.4e-8 relative, about half the steps bitwise), far below the ~5e-3 a lost or
        # shared optimizer state causes
        assert float(loss) == pytest.approx(float(ref.losses[step]), rel=1e-6, abs=0), (step, loss)


@pytest.mark.timeout(300)
def test_zero_progress_guard_stops_a_deterministic_crash(tmp_path):
    run_dir = tmp_path / "crashing"
    # a checkpoint at step 2, then a crash at iteration 4 on every attempt
    # (synchronous saves: an asynchronous one may still be in flight at the crash, and is then lost by design)
    write_job(run_dir, "dp2", "training.checkpoint_interval=2", "training.zero_progress_restarts=1",
              "training.async_save=false")
    atts = run_until_done(run_dir, WORLD, max_attempts=6, timeout_s=200,
                          env={**os.environ, "SLURMTRON_TEST_FAIL_AT_ITER": "4"})
    assert [a.code for a in atts] == [1, 1, 3], ([a.codes for a in atts], write_rank_logs_tail(run_dir))
    assert atts[-1].codes == [3, 3]
    stops = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["crash", "crash", "zero_progress"]
    assert stops[-1]["code"] == 3 and "checkpoint step 2" in stops[-1]["detail"]
    assert "InjectedFailure" in stops[0]["detail"]
